"""`dataset_files`: each training dataset's folder, an observable source asset partitioned like `clips`.

Its data version is the folder's state (`sensors.dataset_state`: every file's path, size and mtime, captions
included; i2i: the source images' folder too). `clips` depends on it, so Dagster records which version each of its
partitions was cached from; once an observation finds a folder changed, that partition of `clips` shows as stale
("has a new dependency data version"), by Dagster's own staleness. It is observed first in every `cache_dataset`
run (the version that run caches) and every `train_and_validate` run (a training run on a changed folder shows it;
the `lora` stage also warns, naming the files), and from the UI's "Observe sources".
"""

# No `from __future__ import annotations` here: Dagster inspects the real annotations of observe functions.
from dagster import DataVersionsByPartition, OpExecutionContext, observable_source_asset

from loraflow.assets.partitions import DATASETS, existing_partition
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.sensors import dataset_state


@observable_source_asset(partitions_def=DATASETS, group_name="loraflow",
                         description="A training dataset's folder: files, sizes and mtimes. A new version makes "
                                     "that dataset's clips stale.")
def dataset_files(context: OpExecutionContext, loraflow: LoraflowResource) -> DataVersionsByPartition:
    config = loraflow.load()
    datasets = {d.id: d for d in config.training_datasets}
    partitions = [existing_partition(context.instance, context.partition_key)] if context.has_partition_key else \
        context.instance.get_dynamic_partitions(DATASETS.name)
    return DataVersionsByPartition({i: dataset_state(config, datasets[i])["hash"] for i in partitions
                                    if i in datasets})
