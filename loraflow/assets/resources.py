"""The one resource: which config file this code location runs, and the store it names."""

from __future__ import annotations

import os

from dagster import ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from loraflow.config import ConfigError, LoraflowConfig, load_config
from loraflow.pipelines.sources import HubUnreachable, ModelRefused, ModelSource, model_source
from loraflow.store import Store

DEFAULT_CONFIG = "configs/demo.yaml"


class LoraflowResource(ConfigurableResource):
    """Typed: swap the config (and so the store URL: local, memory://, s3://) per deployment or test."""

    # LORAFLOW_CONFIG as it is when the resource is built (the code location builds it when Dagster loads it)
    config_path: str = Field(default_factory=lambda: os.environ.get("LORAFLOW_CONFIG", DEFAULT_CONFIG))

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Every step sets up this resource before its work: a step worker dies with its run's process from here on
        (dead_runs.die_with_run), so a killed run leaves no step at work."""
        from loraflow.assets.runs.dead_runs import die_with_run

        die_with_run(context.instance, context.run.run_id if context.run else None)

    def load(self) -> LoraflowConfig:
        """The validated config. A bad config fails the step without retries: it fails the same way again."""
        try:
            return load_config(self.config_path)
        except ConfigError as exc:
            raise Failure(description=str(exc), metadata={"config": self.config_path, "problems": exc.problems},
                          allow_retries=False) from None

    def model(self, config: LoraflowConfig) -> ModelSource:
        """The config's model, resolved once per step and handed to the stage (a repository is downloaded into the
        Hugging Face cache first). A Hub that cannot be reached fails the step without retries, in one message
        naming the Hub and the two ways out, not huggingface_hub's traceback: retrying cannot bring the network. A model
        whose components loraflow will not load fails the same way, naming each (retrying reads the same files)."""
        try:
            return model_source(config)
        except (HubUnreachable, ModelRefused) as exc:
            raise Failure(description=str(exc), metadata={"config": self.config_path}, allow_retries=False) from None

    def store(self, config: LoraflowConfig) -> Store:
        """The config's store, its manifests named by the config (`manifest_names`): no stage reads the lists of a
        dataset taken out of the config, nor those another config or other settings wrote into the cache_dir."""
        return Store(config.cache_dir, config.manifest_names)

    def dataset(self, config: LoraflowConfig, partition_key: str) -> str:
        """The dataset a partition stands for; a partition whose dataset left the config fails without retries."""
        ids = [d.id for d in config.training_datasets]
        if partition_key not in ids:
            raise Failure(description=f"partition '{partition_key}' is not a training dataset of {self.config_path} "
                                      f"({', '.join(ids) or 'none'}): the dataset_watch sensor or `loraflow "
                                      "partitions` deletes the partitions of removed datasets",
                          metadata={"config": self.config_path}, allow_retries=False)
        return partition_key
