"""One dynamic partition per training dataset: `clips` and `latents` are cached a dataset at a time.

The partition key is the dataset's `id`. Each dataset is its own run, so several processes cache datasets at
once and each partition's page shows that dataset's counts, buckets and quarantine. Partitions live in the
Dagster instance, not in code: `dataset_watch` adds them (and removes those of datasets taken out of the
config), as do `loraflow demo` and `loraflow partitions`.
"""

from __future__ import annotations

from dagster import DagsterInstance, DynamicPartitionsDefinition

from loraflow.config import LoraflowConfig

DATASETS = DynamicPartitionsDefinition(name="datasets")


def partition_changes(instance: DagsterInstance, config: LoraflowConfig) -> tuple[list[str], list[str]]:
    """(ids to add, keys to delete): the config's training datasets against the instance's partitions."""
    existing = set(instance.get_dynamic_partitions(DATASETS.name))
    wanted = [d.id for d in config.training_datasets]
    return [i for i in wanted if i not in existing], sorted(existing - set(wanted))


def sync_partitions(instance: DagsterInstance, config: LoraflowConfig) -> tuple[list[str], list[str]]:
    """Make the instance's partitions the config's training datasets; return (added, deleted).

    Deleting a partition keeps its runs and materializations in the event log, and the store keeps its shards:
    adding the dataset back shows its history again and re-plans it from the cache.
    """
    added, deleted = partition_changes(instance, config)
    if added:
        instance.add_dynamic_partitions(DATASETS.name, added)
    for key in deleted:
        instance.delete_dynamic_partition(DATASETS.name, key)
    return added, deleted
