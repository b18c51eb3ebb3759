"""Scheduled re-caching: a `cache_dataset` run per dataset partition on the config's `recache_cron`.

Re-caching on a clock picks up what no sensor sees (a dataset on a network share, a caption edited in
place within the same second). Without `recache_cron` the schedule still exists, on a harmless default
cron and STOPPED, so it can be switched on from the UI.
"""

# No `from __future__ import annotations` here: Dagster inspects the real annotations of schedule functions.
import logging

from dagster import (
    DefaultScheduleStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SkipReason,
    schedule,
)

from loraflow.assets.partitions import DATASETS
from loraflow.config import ConfigError, load_config

log = logging.getLogger(__name__)
DEFAULT_CRON = "0 3 * * *"  # 03:00 UTC daily: only used once someone starts the schedule by hand
TRIGGER_TAG = "loraflow/trigger"


def recache_requests(config_path: str, partitions: list[str], tick: str) -> tuple[list[RunRequest], list[str]]:
    """(a run per training dataset that has a partition, the datasets without one). A schedule cannot add
    partitions (the dataset_watch sensor, `loraflow partitions` or `loraflow demo` do); a partition of a
    dataset no longer in the config is not re-cached, its run would only fail."""
    ids = [d.id for d in load_config(config_path).training_datasets]
    requests = [RunRequest(run_key=f"recache:{i}:{tick}", partition_key=i, tags={TRIGGER_TAG: "recache"})
                for i in ids if i in partitions]
    return requests, [i for i in ids if i not in partitions]


def recache_schedule(config_path: str) -> ScheduleDefinition:
    """The `recache` schedule for the config at `config_path` (read when the code location loads)."""
    try:
        cron = load_config(config_path).recache_cron
        note = f"cron from `recache_cron` in {config_path}" if cron else f"`recache_cron` is not set in {config_path}"
    except ConfigError as exc:
        # The code location must still load to show the problem; every asset run will fail on it loudly.
        log.warning("recache schedule: %s", exc)
        cron, note = None, f"{config_path} could not be read ({len(exc.problems)} problem(s)): schedule off"

    @schedule(name="recache", job_name="cache_dataset", cron_schedule=cron or DEFAULT_CRON, execution_timezone="UTC",
              default_status=DefaultScheduleStatus.RUNNING if cron else DefaultScheduleStatus.STOPPED,
              description=f"Re-cache clips and latents of every dataset partition, a run each; {note}.")
    def recache(context: ScheduleEvaluationContext) -> list[RunRequest] | SkipReason:
        partitions = context.instance.get_dynamic_partitions(DATASETS.name)
        when = context.scheduled_execution_time.isoformat()
        requests, unpartitioned = recache_requests(config_path, partitions, when)
        if unpartitioned:
            context.log.warning(f"datasets without a partition, not re-cached: {unpartitioned} (add them with the "
                                "dataset_watch sensor or `loraflow partitions`)")
        return requests or SkipReason(f"no dataset partition to re-cache (without a partition: {unpartitioned})")

    return recache
