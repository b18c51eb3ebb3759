"""One dynamic partition per training dataset: `clips` and `latents` are cached a dataset at a time.

The partition key is the dataset's `id`. Each dataset is its own run, so several processes cache datasets at
once and each partition's page shows that dataset's counts, buckets and quarantine. Partitions live in the
Dagster instance, not in code: `dataset_watch` adds them (and removes those of datasets taken out of the
config), as do `loraflow demo` and `loraflow partitions`.
"""

from __future__ import annotations

from dagster import DagsterInstance, DynamicPartitionsDefinition, Failure

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


def existing_partition(instance: DagsterInstance, partition_key: str) -> str:
    """The run's partition key, which must be one the instance holds. Dagster itself accepts a run of a partition it
    does not have (`dagster job execute --tags '{"dagster/partition": ...}'` before `loraflow partitions`) and fails it
    only when the first output is stored, with "Partition range ... Nonexistent partition keys" and a traceback; the
    first step of each dataset's run asks here instead and says what to do."""
    if not instance.has_dynamic_partition(DATASETS.name, partition_key):
        raise Failure(description=f"partition '{partition_key}' does not exist in this Dagster instance (DAGSTER_HOME "
                                  "names it): run `loraflow partitions` (a partition per training dataset of "
                                  "$LORAFLOW_CONFIG) once, then launch the job again", allow_retries=False)
    return partition_key
