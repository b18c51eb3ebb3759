"""Scheduled re-caching: the cache_only job on the config's `recache_cron`.

Re-caching on a clock picks up what no sensor sees (a dataset on a network share, a caption edited in
place within the same second). Without `recache_cron` the schedule still exists, on a harmless default
cron and STOPPED, so it can be switched on from the UI.
"""

from __future__ import annotations

import logging

from dagster import DefaultScheduleStatus, ScheduleDefinition

from loraflow.config import ConfigError, load_config

log = logging.getLogger(__name__)
DEFAULT_CRON = "0 3 * * *"  # 03:00 UTC daily: only used once someone starts the schedule by hand


def recache_schedule(config_path: str) -> ScheduleDefinition:
    """The `recache` schedule for the config at `config_path` (read when the code location loads)."""
    try:
        cron = load_config(config_path).recache_cron
        note = f"cron from `recache_cron` in {config_path}" if cron else f"`recache_cron` is not set in {config_path}"
    except ConfigError as exc:
        # The code location must still load to show the problem; every asset run will fail on it loudly.
        log.warning("recache schedule: %s", exc)
        cron, note = None, f"{config_path} could not be read ({len(exc.problems)} problem(s)): schedule off"
    return ScheduleDefinition(
        name="recache",
        job_name="cache_only",
        cron_schedule=cron or DEFAULT_CRON,
        execution_timezone="UTC",
        default_status=DefaultScheduleStatus.RUNNING if cron else DefaultScheduleStatus.STOPPED,
        tags={"loraflow/trigger": "recache"},
        description=f"Re-cache clips, latents and text embeddings; {note}.",
    )
