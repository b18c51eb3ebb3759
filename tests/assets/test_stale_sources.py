"""Sources changed after caching: a video replaced and another deleted after `cache_dataset`. `train_and_validate`
still trains on the caches as they are (what a user may want), but no longer silently: the `lora` stage warns in the
run naming the files and the job that refreshes them, its metadata lists them, `loraflow check` says so, and
Dagster's own staleness marks that dataset's `clips` stale (the observed `dataset_files` has a new data version).
Re-caching clears all of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance

from loraflow.assets.jobs import QUIET, build_defs, materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import ALL_ASSETS
from loraflow.cli import main
from loraflow.config import load_config
from loraflow.contracts.clip_rows import changed_sources
from loraflow.store import Store
from tests.factory import demo_dict, write_config

DATASET = "demo-videos"


def clips_status(instance: DagsterInstance) -> tuple[str, list[str]]:
    """Dagster's stale status of the dataset's `clips` partition and its causes, as the UI computes them."""
    from dagster._utils.test.data_versions import get_stale_status_resolver

    resolver = get_stale_status_resolver(instance, ALL_ASSETS)
    causes = resolver.get_stale_causes(AssetKey("clips"), DATASET)
    return resolver.get_status(AssetKey("clips"), DATASET).value, [c.reason for c in causes]


@pytest.fixture(scope="module")
def changed_after_caching(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("stale")
    data = root / "data"
    shutil.copytree(demo_data, data)
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, data, root, max_train_steps=1,
                                                          checkpointing_steps=1))
    resource, instance = LoraflowResource(config_path=str(config)), DagsterInstance.ephemeral()
    first = materialize_everything(resource, instance)
    assert [r.success for r in first] == [True, True]
    before = clips_status(instance)
    shutil.copyfile(data / "clip_01.mp4", data / "clip_03.mp4")  # replaced by another video
    (data / "clip_04.mp4").unlink()  # and one deleted (its caption left behind)
    again = build_defs(resource).resolve_job_def("train_and_validate").execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET)
    return {"config": config, "resource": resource, "instance": instance, "before": before, "run": again}


def test_the_lora_stage_warns_naming_the_files_and_the_job(changed_after_caching: dict) -> None:
    run = changed_after_caching["run"]
    assert run.success  # the caches are trained on as they are
    (event,) = [e for e in run.get_asset_materialization_events() if e.asset_key == AssetKey("lora")]
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["changed_sources"] == 2
    assert "clip_03.mp4 | changed" in meta["changed_sources_table"]
    assert "clip_04.mp4 | deleted" in meta["changed_sources_table"]
    warnings = [e.user_message for e in changed_after_caching["instance"].all_logs(run.run_id)
                if e.level == 30 and "changed since it was cached" in e.user_message]  # logging.WARNING
    assert len(warnings) == 1
    assert ("clip_03.mp4 (changed), clip_04.mp4 (deleted)" in warnings[0] and "`cache_dataset` job (partition "
            f"'{DATASET}'" in warnings[0])


def test_dagster_shows_the_datasets_clips_stale(changed_after_caching: dict) -> None:
    assert changed_after_caching["before"] == ("FRESH", [])
    assert clips_status(changed_after_caching["instance"]) == ("STALE", ["has a new dependency data version"])


def test_check_warns_and_recaching_clears_it(changed_after_caching: dict, capsys: pytest.CaptureFixture[str]) -> None:
    config = changed_after_caching["config"]
    assert main(["check", str(config), "--no-estimates"]) == 0  # a warning, not a problem
    out = capsys.readouterr().out
    assert f"warning: dataset '{DATASET}': 2 source file(s) changed since it was cached" in out
    resource, instance = changed_after_caching["resource"], changed_after_caching["instance"]
    recached = build_defs(resource).resolve_job_def("cache_dataset").execute_in_process(
        instance=instance, partition_key=DATASET, run_config=QUIET)
    assert recached.success and clips_status(instance) == ("FRESH", [])
    loaded = load_config(config)
    assert changed_sources(Store(loaded.cache_dir, loaded.manifest_names), loaded.dataset_folders) == []
    assert main(["check", str(config), "--no-estimates"]) == 0
    assert "changed since it was cached" not in capsys.readouterr().out
