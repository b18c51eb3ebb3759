"""The one config model and its parts: every key (`fields.py`: `ConfigFields`), the checks across keys and the loader
(`loraflow_config.py`: `LoraflowConfig`, `load_config`), a dataset entry (`dataset.py`), the peers' training options
and guide features (`training_options.py`, `guide_features.py`), LyCORIS adapter kinds (`adapter_kinds.py`),
validation adapters (`validation_adapters.py`), what each field does to a run's key (`run_key.py`: `setting`,
`StrictModel`, `run_key_settings`), and the errors (`errors.py`: `ConfigError`, how a problem is said). No torch at
import time: config validation runs without it (`validation_adapters.load_adapters` imports the model libraries where
it runs). Import the model from the package."""

from loraflow.config.dataset import DatasetConfig, VideoSettings
from loraflow.config.errors import ConfigError
from loraflow.config.fields import TreadConfig, TreadRoute, read_prompt_library
from loraflow.config.loraflow_config import LoraflowConfig, load_config, parse_config, select_datasets
from loraflow.config.run_key import StrictModel, setting

__all__ = [
    "ConfigError", "DatasetConfig", "LoraflowConfig", "StrictModel", "TreadConfig", "TreadRoute", "VideoSettings",
    "load_config", "parse_config", "read_prompt_library", "select_datasets", "setting",
]
