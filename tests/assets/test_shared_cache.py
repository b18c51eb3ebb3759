"""Two configs sharing one cache_dir (issue 62 item 2, issue 59 item 3): shards are keyed by content, so the two share
them; each config's manifests are named by what they are made from (`LoraflowConfig.manifest_names`), so neither
reads nor deletes the other's. Two deployments: each its own Dagster instance and config, one cache_dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dagster import DagsterInstance

from loraflow.assets.jobs import build_defs
from loraflow.assets.partitions import sync_partitions
from loraflow.assets.resources import LoraflowResource
from loraflow.config import load_config
from loraflow.contracts.clip_rows import read_clips
from loraflow.store import Store
from tests.assets.test_partitions import make_dataset
from tests.factory import demo_dict, write_config


def config_of(model: Path, root: Path, name: str, datasets: dict[str, Path], **dataset_settings: Any) -> Path:
    """A config of `datasets` (id -> folder, each with `dataset_settings`) with the cache under root/cache and its
    own output folder."""
    config = demo_dict(model, root, root, max_train_steps=2, checkpointing_steps=2, output_dir=str(root / name))
    media = {**config["datasets"][0], **dataset_settings}
    config["datasets"] = [{**media, "id": id_, "instance_data_dir": str(folder)} for id_, folder in datasets.items()]
    config["datasets"] += demo_dict(model, root, root)["datasets"][1:]
    return write_config(root / f"{name}.yaml", config)


def cache(config: Path, dataset: str) -> None:
    """`cache_dataset` of one dataset, in the config's own Dagster instance (its own deployment)."""
    instance = DagsterInstance.ephemeral()
    sync_partitions(instance, load_config(config))
    job = build_defs(LoraflowResource(config_path=str(config))).resolve_job_def("cache_dataset")
    assert job.execute_in_process(instance=instance, partition_key=dataset, raise_on_error=False).success


def store_of(config: Path) -> Store:
    """The store every asset and check of the config reads."""
    resource = LoraflowResource(config_path=str(config))
    return resource.store(resource.load())


def files_under(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_two_configs_with_one_dataset_id_and_other_folders_never_read_each_others_clips(
        tiny_k5: Path, tmp_path: Path) -> None:
    cats, dogs = make_dataset(tmp_path / "cats", ["tabby", "siamese"]), make_dataset(tmp_path / "dogs", ["pug"])
    mine = config_of(tiny_k5, tmp_path, "mine", {"videos": cats})
    theirs = config_of(tiny_k5, tmp_path, "theirs", {"videos": dogs})
    cache(mine, "videos")
    cache(theirs, "videos")  # the last writer of the one id: it replaced the other config's list
    for config, captions in ((mine, {("a tabby",), ("a siamese",)}), (theirs, {("a pug",)})):
        store = store_of(config)
        clips = read_clips(store)
        assert {c.captions for c in clips} == captions, config.name
        assert {r["clip_key"] for r in store.read_manifest("latents")} == {c.key for c in clips}, config.name
    with pytest.raises(ValueError, match="holds 2 manifests of dataset 'videos'"):
        read_clips(Store(str(tmp_path / "cache")))  # a store that knows no config does not pick one of the two


def test_a_dataset_of_another_config_is_neither_read_nor_deleted(tiny_k5: Path, tmp_path: Path) -> None:
    cats, dogs = make_dataset(tmp_path / "cats", ["tabby"]), make_dataset(tmp_path / "dogs", ["pug"])
    mine = config_of(tiny_k5, tmp_path, "mine", {"cats": cats})
    theirs = config_of(tiny_k5, tmp_path, "theirs", {"dogs": dogs})
    cache(mine, "cats")
    cache(theirs, "dogs")  # dogs' config has no cats: its run deleted the cats parts
    assert store_of(mine).manifest_parts("clips") == store_of(mine).manifest_parts("latents") == ["cats"]
    assert {c.captions for c in read_clips(store_of(mine))} == {("a tabby",)}
    assert {c.captions for c in read_clips(store_of(theirs))} == {("a pug",)}
    before = files_under(tmp_path / "cache")
    for config in (mine, theirs):  # the getter every asset and check calls first: it writes and deletes nothing
        store_of(config)
    assert files_under(tmp_path / "cache") == before


def test_two_configs_with_one_dataset_folder_and_other_settings_never_read_each_others_clips(
        tiny_k5: Path, tmp_path: Path) -> None:
    videos = make_dataset(tmp_path / "videos", ["tabby", "pug"])
    mine = config_of(tiny_k5, tmp_path, "mine", {"videos": videos})
    theirs = config_of(tiny_k5, tmp_path, "theirs", {"videos": videos},
                       video={"num_frames": 9, "min_frames": 9, "bucket_strategy": "aspect_ratio"})
    cache(mine, "videos")
    cache(theirs, "videos")
    sizes = {}
    for config in (mine, theirs):
        store = store_of(config)
        clips = read_clips(store)
        sizes[config.name] = {c.bucket for c in clips}
        assert {r["clip_key"] for r in store.read_manifest("latents")} == {c.key for c in clips}, config.name
    assert sizes["mine.yaml"].isdisjoint(sizes["theirs.yaml"]), sizes  # 64 px buckets and 32 px ones
