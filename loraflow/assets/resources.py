"""The one resource: which config file this code location runs, and the store it names."""

from __future__ import annotations

import os

from dagster import ConfigurableResource

from loraflow.config import LoraflowConfig, load_config
from loraflow.store import Store

DEFAULT_CONFIG = "configs/demo.yaml"


class LoraflowResource(ConfigurableResource):
    """Typed: swap the config (and so the store URL: local, memory://, s3://) per deployment or test."""

    config_path: str = os.environ.get("LORAFLOW_CONFIG", DEFAULT_CONFIG)

    def load(self) -> LoraflowConfig:
        return load_config(self.config_path)

    def store(self, config: LoraflowConfig) -> Store:
        return Store(config.cache_dir)
