"""Datasets as dynamic partitions: each dataset is cached in its own run, and only a changed one recomputes.

Two media datasets (`cats`, `dogs`: real H.264 files) on the tiny model. The runs go through the real jobs of
loraflow.assets.jobs in one ephemeral instance; the tests run in order and build on each other's state.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance

from loraflow.assets.jobs import build_defs
from loraflow.assets.partitions import DATASETS, sync_partitions
from loraflow.assets.resources import LoraflowResource
from loraflow.config import load_config
from loraflow.keys import data_version
from loraflow.store import Store
from tests.factory import REPO, demo_dict, write_config
from tests.media_factory import write_h264


def make_dataset(folder: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        write_h264(folder / f"{name}.mp4", num_frames=18, width=96, height=64)
        (folder / f"{name}.txt").write_text(f"a {name}\n", encoding="utf-8")
    return folder


def two_dataset_config(model: Path, root: Path, keep: tuple[str, ...] = ("cats", "dogs"), **overrides) -> Path:
    config = demo_dict(model, root / "cats", root, **overrides)
    media = config["datasets"][0]
    config["datasets"] = [{**media, "id": name, "instance_data_dir": str(root / name)} for name in keep] + \
        config["datasets"][1:]
    return write_config(root / f"config-{'-'.join(keep)}.yaml", config)


@pytest.fixture(scope="module")
def setup(tiny_k5: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("partitions")
    make_dataset(root / "cats", ["tabby", "siamese"])
    make_dataset(root / "dogs", ["collie", "pug"])
    config = two_dataset_config(tiny_k5, root, max_train_steps=2, checkpointing_steps=2)
    resource = LoraflowResource(config_path=str(config))
    instance = DagsterInstance.ephemeral()
    assert sync_partitions(instance, load_config(config)) == (["cats", "dogs"], [])
    return root, resource, instance, Store(str(root / "cache"))


def cache(setup, dataset: str, resource: LoraflowResource | None = None):
    _, default, instance, _ = setup
    job = build_defs(resource or default).resolve_job_def("cache_dataset")
    return job.execute_in_process(instance=instance, partition_key=dataset, raise_on_error=False)


def materialized(result, asset: str) -> tuple[str | None, dict, str]:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == asset]
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    return event.partition, metadata, event.materialization.tags["dagster/data_version"]


def test_each_partition_caches_only_its_dataset_in_its_own_run(setup) -> None:
    _, _, instance, store = setup
    cats = cache(setup, "cats")
    assert cats.success
    partition, clips, _ = materialized(cats, "clips")
    assert partition == "cats" and clips["dataset"] == "cats" and clips["computed"] == clips["clips"] == 2
    assert "cats" in clips["buckets"] and "dogs" not in clips["buckets"]
    assert store.manifest_parts("clips") == store.manifest_parts("latents") == ["cats"]
    cats_rows = store.read_manifest("clips")
    assert {r["dataset"] for r in cats_rows} == {"cats"}

    dogs = cache(setup, "dogs")
    assert dogs.success
    partition, clips, _ = materialized(dogs, "clips")
    assert partition == "dogs" and clips["computed"] == 2 and clips["reused"] == 0  # cats' clips not re-planned
    _, latents, _ = materialized(dogs, "latents")
    assert latents["computed"] == latents["latents"] == 2 and latents["dataset"] == "dogs"
    assert store.manifest_parts("clips") == store.manifest_parts("latents") == ["cats", "dogs"]
    assert store.read_manifest("clips", parts=["cats"]) == cats_rows  # the dogs run left the cats part alone
    assert instance.get_materialized_partitions(AssetKey("latents")) == {"cats", "dogs"}
    # Each partition's checks ran on its own dataset, and passed.
    evaluations = [e for e in dogs.get_asset_check_evaluations()]
    assert {e.check_name for e in evaluations} == {"latents_shape_and_finite", "latents_cover_clips",
                                                   "captions_not_empty"}
    assert all(e.passed and e.metadata["checked"].value == 2 for e in evaluations)


def test_a_new_file_recomputes_only_its_dataset(setup) -> None:
    root, _, _, _ = setup
    before = {d: cache(setup, d) for d in ("cats", "dogs")}
    make_dataset(root / "dogs", ["beagle"])
    after = {d: cache(setup, d) for d in ("cats", "dogs")}
    for asset in ("clips", "latents"):
        _, cats, cats_version = materialized(after["cats"], asset)
        _, dogs, dogs_version = materialized(after["dogs"], asset)
        assert (cats["computed"], cats["reused"]) == (0, 2), asset
        assert (dogs["computed"], dogs["reused"]) == (1, 2), asset
        assert cats_version == materialized(before["cats"], asset)[2]  # cats' content, and version, unchanged
        assert dogs_version != materialized(before["dogs"], asset)[2]


def test_unpartitioned_stages_read_every_dataset(setup) -> None:
    _, resource, instance, store = setup
    result = build_defs(resource).resolve_job_def("train_and_validate").execute_in_process(instance=instance)
    assert result.success
    (_, texts, _) = materialized(result, "text_embeds")
    captions = {c for r in store.read_manifest("clips") for c in r["captions"]}
    assert {"a tabby", "a pug", "a beagle"} <= captions and texts["computed"] >= len(captions)
    _, lora, _ = materialized(result, "lora")
    # lora's lineage: the data version of the latents it read, both datasets' parts together
    assert lora["inputs"]["latents"] == data_version(r["key"] for r in store.read_manifest("latents"))
    assert len(store.read_manifest("latents")) == 5


def test_a_dataset_removed_from_the_config_is_no_longer_read_or_cached(setup, tiny_k5: Path) -> None:
    root, _, instance, store = setup
    cats_only = two_dataset_config(tiny_k5, root, keep=("cats",), max_train_steps=2, checkpointing_steps=2)
    resource = LoraflowResource(config_path=str(cats_only))
    files = {p: p.stat().st_mtime_ns for p in (root / "cache").rglob("*") if p.is_file()}
    cats_store = resource.store(resource.load())  # what every asset and check of this config does first
    assert {p: p.stat().st_mtime_ns for p in (root / "cache").rglob("*") if p.is_file()} == files  # a getter
    assert {r["dataset"] for r in cats_store.read_manifest("clips")} == {"cats"}
    assert {r["dataset"] for r in cats_store.read_manifest("latents")} == {"cats"}
    assert cats_store.keys("clips") >= {r["key"] for r in cats_store.read_manifest("clips")}
    both = LoraflowResource(config_path=str(two_dataset_config(tiny_k5, root, max_train_steps=2)))
    # the dogs' parts are still the two-dataset config's: taking a dataset out of one config deletes nothing
    assert {r["dataset"] for r in both.store(both.load()).read_manifest("latents")} == {"cats", "dogs"}
    failed = cache(setup, "dogs", resource)
    assert not failed.success
    types = [e.event_type for e in failed.all_events]
    assert DagsterEventType.STEP_UP_FOR_RETRY not in types  # a partition of a removed dataset fails once
    (failure,) = [e for e in failed.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert "partition 'dogs' is not a training dataset" in failure.step_failure_data.user_failure_data.description
    assert sync_partitions(instance, resource.load()) == ([], ["dogs"])
    assert instance.get_dynamic_partitions(DATASETS.name) == ["cats"]


PARALLEL = """
import sys
from loraflow.config import load_config
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
config = load_config(sys.argv[1])
store = Store(config.cache_dir, config.manifest_names)
for _ in range(3):  # several manifest writes each, so the two processes' writes interleave
    build_clips(config, get_family(config), model_source(config), store, datasets=[sys.argv[2]])
    encode_latents(config, get_family(config), model_source(config), store, datasets=[sys.argv[2]])
"""


def test_two_processes_cache_two_datasets_at_once(tiny_k5: Path, tmp_path: Path) -> None:
    make_dataset(tmp_path / "cats", ["tabby", "siamese"])
    make_dataset(tmp_path / "dogs", ["collie"])
    config = two_dataset_config(tiny_k5, tmp_path)
    processes = [subprocess.Popen([sys.executable, "-c", PARALLEL, str(config), name], cwd=REPO,
                                  stderr=subprocess.PIPE, text=True) for name in ("cats", "dogs")]
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    store = Store(str(tmp_path / "cache"))
    for stage in ("clips", "latents"):
        rows = store.read_manifest(stage)
        assert sorted(r["dataset"] for r in rows) == ["cats", "cats", "dogs"], stage  # neither list overwritten
    assert store.keys("latents") >= {r["key"] for r in store.read_manifest("latents")}


def test_a_job_run_before_loraflow_partitions_says_to_run_it(tiny_k5: Path, tmp_path: Path) -> None:
    """A fresh instance with no partition yet (the README's `loraflow partitions` step skipped): the cache_dataset run
    fails at its first step with one message naming `loraflow partitions`, not Dagster's "Nonexistent partition
    keys" when the first output is stored."""
    from dagster import DagsterInstance

    make_dataset(tmp_path / "cats", ["tabby"])
    config = two_dataset_config(tiny_k5, tmp_path, keep=("cats",))
    job = build_defs(LoraflowResource(config_path=str(config))).resolve_job_def("cache_dataset")
    with DagsterInstance.ephemeral() as instance:
        # as `dagster job execute --tags '{"dagster/partition": "cats"}'` launches it (partition_key= checks first)
        result = job.execute_in_process(instance=instance, tags={"dagster/partition": "cats"}, raise_on_error=False)
    assert not result.success
    failures = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert [e.step_key for e in failures] == ["dataset_files"]
    message = failures[0].step_failure_data.error.message
    assert "run `loraflow partitions`" in message and "Nonexistent" not in message, message
