"""The one resource: which config file this code location runs, and the store it names."""

from __future__ import annotations

import os

from dagster import ConfigurableResource, Failure

from loraflow.config import ConfigError, LoraflowConfig, load_config
from loraflow.store import Store

DEFAULT_CONFIG = "configs/demo.yaml"


class LoraflowResource(ConfigurableResource):
    """Typed: swap the config (and so the store URL: local, memory://, s3://) per deployment or test."""

    config_path: str = os.environ.get("LORAFLOW_CONFIG", DEFAULT_CONFIG)

    def load(self) -> LoraflowConfig:
        """The validated config. A bad config fails the step without retries: it fails the same way again."""
        try:
            return load_config(self.config_path)
        except ConfigError as exc:
            raise Failure(description=str(exc), metadata={"config": self.config_path, "problems": exc.problems},
                          allow_retries=False) from None

    def store(self, config: LoraflowConfig) -> Store:
        return Store(config.cache_dir)
