"""The one config model (`loraflow_config.py`: `LoraflowConfig`, `load_config`) and its parts: a dataset entry
(`dataset.py`), the peers' training options and guide features (`training_options.py`, `guide_features.py`), LyCORIS
adapter kinds (`adapter_kinds.py`), validation adapters (`validation_adapters.py`), and how an error is said
(`errors.py`). No torch at import time: config validation runs without it (`validation_adapters.load_adapters`
imports the model libraries where it runs). Import the model from the package."""

from loraflow.config.dataset import DatasetConfig, StrictModel, VideoSettings, setting
from loraflow.config.loraflow_config import (
    ConfigError, LoraflowConfig, TreadConfig, TreadRoute, load_config, parse_config, read_prompt_library,
    select_datasets,
)

__all__ = [
    "ConfigError", "DatasetConfig", "LoraflowConfig", "StrictModel", "TreadConfig", "TreadRoute", "VideoSettings",
    "load_config", "parse_config", "read_prompt_library", "select_datasets", "setting",
]
