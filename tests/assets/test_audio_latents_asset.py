"""The `audio_latents` asset and a config that trains no sound (every Kandinsky 5 and HunyuanVideo 1.5 config): the
code location's graph and jobs are the ones it had before sound existed, and the asset, run by hand, is one "off"
version that reads and writes nothing. With sound (Kandinsky 6, `train_audio`) the cache run caches it and lora reads
it; run, it needs a Kandinsky 6 checkpoint: the stage itself is tested in tests/stages/test_audio_latents.py."""

from __future__ import annotations

from pathlib import Path

from dagster import AssetKey, DagsterInstance, materialize

from loraflow.assets.jobs import JOBS, graph
from loraflow.assets.partitions import DATASETS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import ALL_ASSETS, audio_latents
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


def test_a_config_without_sound_keeps_its_graph_and_jobs(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    assets, jobs = graph(LoraflowResource(config_path=str(config)))
    assert (assets, jobs) == (ALL_ASSETS, JOBS) and audio_latents not in assets
    assert [j.name for j in jobs] == ["cache_dataset", "train_and_validate"]
    (tmp_path / "bad.yaml").write_text("model_family: nothing-known\n")  # the location loads, to show the problem
    assert graph(LoraflowResource(config_path=str(tmp_path / "bad.yaml"))) == (ALL_ASSETS, JOBS)


def test_a_config_with_sound_caches_it_in_the_cache_dataset_run(demo_data: Path, tmp_path: Path) -> None:
    """With `train_audio` the dataset's one cache run (the job the dataset sensor and the recache schedule request)
    also caches its sound: a separate job would leave it stale after the folder changes. Seen failing while
    `cache_audio` was a job of its own (the sound was outside `cache_dataset`)."""
    from loraflow.demo.tiny import build_tiny

    data = demo_dict(build_tiny("kandinsky6", tmp_path / "k6"), demo_data, tmp_path, model_family="kandinsky6",
                     train_audio=True)
    data.pop("model_flavour")
    assets, jobs = graph(LoraflowResource(config_path=str(write_config(tmp_path / "config.yaml", data))))
    assert audio_latents in assets and [j.name for j in jobs] == ["cache_dataset", "train_and_validate"]
    cached = {key.to_user_string() for key in jobs[0].selection.resolve(assets)}
    assert cached == {"dataset_files", "clips", "latents", "audio_latents"}


def test_a_config_with_sound_trains_after_its_sound_is_cached(tmp_path: Path) -> None:
    """With `train_audio` the lora asset reads the audio latents (it is stale when they change, and a backfill caches
    them first), under the one `lora` key every other config has."""
    (tmp_path / "data").mkdir()
    data = demo_dict(tmp_path / "k6", tmp_path / "data", tmp_path, model_family="kandinsky6", train_audio=True)
    data.pop("model_flavour")
    assets, jobs = graph(LoraflowResource(config_path=str(write_config(tmp_path / "config.yaml", data))))
    assert audio_latents in assets and [j.name for j in jobs] == ["cache_dataset", "train_and_validate"]
    (lora,) = [a for a in assets if a.key == AssetKey("lora")]
    assert AssetKey("audio_latents") in lora.asset_deps[lora.key]
    (plain,) = [a for a in ALL_ASSETS if a.key == AssetKey("lora")]
    assert plain.asset_deps[plain.key] == lora.asset_deps[lora.key] - {AssetKey("audio_latents")}
