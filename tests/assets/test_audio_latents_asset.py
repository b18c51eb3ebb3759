"""The `audio_latents` asset for a config that trains no sound (every Kandinsky 5 and HunyuanVideo 1.5 config): one
"off" version, nothing read or written, whatever the dataset holds. Its run with sound (Kandinsky 6, `train_audio`)
needs a Kandinsky 6 checkpoint: the stage itself is tested in tests/stages/test_audio_latents.py."""

from __future__ import annotations

from pathlib import Path

from dagster import DagsterInstance, materialize

from loraflow.assets.partitions import DATASETS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import audio_latents
from loraflow.contracts.audio_rows import STAGE
from tests.factory import demo_dict, write_config


def test_a_config_without_sound_materializes_one_off_version_and_writes_nothing(
        tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(DATASETS.name, ["demo-videos"])
    result = materialize([audio_latents], instance=instance, partition_key="demo-videos",
                         resources={"loraflow": LoraflowResource(config_path=str(config))})
    assert result.success
    (event,) = result.get_asset_materialization_events()
    assert event.materialization.tags["dagster/data_version"] == "off"
    assert event.materialization.metadata["status"].value == "off: train_audio is false"
    assert not (tmp_path / "cache" / STAGE).exists() and not any(tmp_path.rglob(STAGE))
