"""The jobs, and the whole DAG as runs: one `cache_dataset` run per dataset, then one `train_and_validate` run.

One job cannot hold the whole DAG: a run of a job with partitioned assets has one partition key, so a run of
clips -> ... -> validation would train after caching one dataset only. The partitioned part (`clips`,
`latents`) is therefore its own job, a run per dataset (in parallel under `dagster dev`, each in its own
process); `text_embeds`, `teacher_features`, `lora` and `validation` read every dataset and run once after
them. (In the UI, materializing all six launches an asset backfill, which Dagster orders the same way.) A config
that trains sound (`train_audio`) caches it in the same `cache_dataset` run, so the dataset sensor and the recache
schedule, which request that job, keep the sound cached too.
"""

from __future__ import annotations

from typing import Any

from dagster import (
    AssetSelection,
    Backoff,
    DagsterInstance,
    Definitions,
    ExecuteInProcessResult,
    RetryPolicy,
    define_asset_job,
)

from loraflow.assets.partitions import sync_partitions
from loraflow.assets.resources import LoraflowResource
from loraflow.config import ConfigError, load_config
from loraflow.lifetime import keep_signal_handlers

# Transient failures (a flaky network store, a worker killed for memory) are retried; a config error raises
# Failure(allow_retries=False) in LoraflowResource.load and is not. Retries resume from committed shards.
TRANSIENT = RetryPolicy(max_retries=2, delay=10, backoff=Backoff.EXPONENTIAL)

# Each job observes `dataset_files` first: the folder version a cache run caches, and whether a training run's
# caches are stale (assets/dataset_files.py).
CACHED = ("dataset_files", "clips", "latents")


def cache_job(sound: bool = False, auto_captions: bool = False) -> Any:  # an UnresolvedAssetJobDefinition
    """The `cache_dataset` job: one dataset (the partition), its folder observed, clips and latents and their checks;
    with `sound` (a `train_audio` config, Kandinsky 6) the clips' sound as audio latents too, in the same run; with
    `auto_captions` (a `caption_strategy: auto` dataset) the clips' captions too."""
    return define_asset_job(
        "cache_dataset", AssetSelection.assets(*CACHED, *(["audio_latents"] if sound else []),
                                               *(["captions"] if auto_captions else [])),
        op_retry_policy=TRANSIENT,
        description="One dataset (the partition): its folder observed, clips and latents"
                    + (", the clips' sound as audio latents (train_audio)," if sound else "")
                    + (", the clips' captions (caption_strategy auto)," if auto_captions else "") + " and their checks")


train_and_validate = define_asset_job(
    "train_and_validate",
    AssetSelection.assets("dataset_files", "text_embeds", "teacher_features", "lora", "validation"),
    description="Every dataset's folder observed and captions embedded (and CREPA's teacher features), then LoRA "
                "training and validation")
JOBS = [cache_job(), train_and_validate]


def trains_audio(config_path: str) -> bool:
    """Whether the code location's config trains sound (`train_audio`). A config that does not load: False (the code
    location still loads, to show the problem; every run fails on it, as for the recache schedule)."""
    return _graph_options(config_path)[0]


def _graph_options(config_path: str) -> tuple[bool, bool]:
    """(train_audio, a dataset with caption_strategy auto) of the config; a config that does not load: neither."""
    try:
        config = load_config(config_path)
    except ConfigError:
        return False, False
    return config.train_audio, any(d.caption_strategy == "auto" for d in config.training_datasets)


def graph(resource: LoraflowResource) -> tuple[list, list]:
    """(assets, jobs) of the code location: with `train_audio`, the audio_latents asset too (which lora then reads),
    cached by the `cache_dataset` job; with a `caption_strategy: auto` dataset the captions asset too (which
    text_embeds then reads), also in `cache_dataset`; every other config has the six assets and two jobs, unchanged."""
    from loraflow.assets.stages import ALL_ASSETS, assets_for

    sound, auto_captions = _graph_options(resource.config_path)
    if not sound and not auto_captions:
        return ALL_ASSETS, JOBS
    return assets_for(sound, auto_captions), [cache_job(sound, auto_captions), train_and_validate]


def build_defs(resource: LoraflowResource, **extra: object) -> Definitions:
    """The assets, checks and jobs with this resource (a config of its own, beside the code location's)."""
    from loraflow.assets.checks import ALL_CHECKS

    assets, jobs = graph(resource)
    return Definitions(assets=assets, asset_checks=ALL_CHECKS, jobs=jobs, resources={"loraflow": resource}, **extra)


QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # the terminal gets logs, not every event


def materialize_everything(resource: LoraflowResource, instance: DagsterInstance) -> list[ExecuteInProcessResult]:
    """What `loraflow demo` runs: a partition per training dataset added to the instance, one `cache_dataset`
    run per dataset, then `train_and_validate`. Stops after the first failed run (and returns it last)."""
    with keep_signal_handlers():  # in a background job, Dagster would leave SIGTERM ignored
        return _run_every_job(build_defs(resource), resource, instance)


def _run_every_job(defs: Definitions, resource: LoraflowResource,
                   instance: DagsterInstance) -> list[ExecuteInProcessResult]:
    config = resource.load()
    sync_partitions(instance, config)
    results = []
    for dataset in config.training_datasets:
        results.append(defs.resolve_job_def("cache_dataset").execute_in_process(
            instance=instance, partition_key=dataset.id, raise_on_error=False, run_config=QUIET))
        if not results[-1].success:
            return results
    results.append(defs.resolve_job_def("train_and_validate").execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET))
    return results
