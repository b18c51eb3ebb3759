"""The Dagster product around the six assets: checks, the dataset partitions and sensor, the recache schedule,
retries."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import yaml
from dagster import (
    AddDynamicPartitionsRequest,
    AssetCheckSeverity,
    AssetKey,
    AssetSelection,
    DagsterEventType,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    Definitions,
    DeleteDynamicPartitionsRequest,
    SkipReason,
    build_asset_check_context,
    build_schedule_context,
    build_sensor_context,
    define_asset_job,
)
from safetensors.numpy import save_file

from loraflow.assets.checks import (
    ALL_CHECKS,
    bad_latents,
    captions_not_empty,
    clips_without_latents,
    latents_cover_clips,
    lora_problems,
    text_embeds_cover_captions,
)
from loraflow.assets.jobs import JOBS, build_defs
from loraflow.assets.partitions import DATASETS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.schedules import DEFAULT_CRON, recache_schedule
from loraflow.assets.sensors import CHANGED_TAG, dataset_watch
from loraflow.assets.stages import ALL_ASSETS
from loraflow.config import ConfigError, load_config
from loraflow.stages.clips.bucket_plan import LatentGeometry
from loraflow.stages.latents.latents import PlannedLatent
from loraflow.store import Store
from tests.factory import clip_row, demo_dict, write_config


# -- checks on a real materialization --------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """clips -> latents (the demo dataset's partition), then text_embeds -> lora, every check of those assets
    run in the same job as its asset."""
    root = tmp_path_factory.mktemp("product")
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, demo_data, root, max_train_steps=2,
                                                          checkpointing_steps=2))
    job = define_asset_job("up_to_lora", AssetSelection.assets("text_embeds", "lora"))
    defs = Definitions(assets=ALL_ASSETS, asset_checks=ALL_CHECKS, jobs=[*JOBS, job],
                       resources={"loraflow": LoraflowResource(config_path=str(config))})
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(DATASETS.name, ["demo-videos"])
    results = [defs.resolve_job_def("cache_dataset").execute_in_process(instance=instance, partition_key="demo-videos"),
               defs.resolve_job_def("up_to_lora").execute_in_process(instance=instance)]
    return results, config, root


def direct(resource: LoraflowResource):
    """The context of a check called directly: no partition, so it checks every dataset."""
    return build_asset_check_context(resources={"loraflow": resource})


def test_every_check_runs_in_the_job_and_passes_on_a_clean_materialization(trained) -> None:
    results, _, _ = trained
    assert all(r.success for r in results)
    evaluations = {e.check_name: e for r in results for e in r.get_asset_check_evaluations()}
    expected = {"latents_shape_and_finite", "latents_cover_clips", "text_embeds_cover_captions", "captions_not_empty",
                "lora_file_loads"}
    assert set(evaluations) == expected
    for name, evaluation in evaluations.items():
        assert evaluation.passed, (name, evaluation.description)
        assert evaluation.metadata["checked"].value > 0, name


def test_coverage_checks_name_the_clip_without_a_latent_and_the_caption_without_an_embedding(trained) -> None:
    _, config, root = trained
    resource = LoraflowResource(config_path=str(config))
    store = resource.store(resource.load())  # the config's own manifests, which the checks read
    latents_rows = store.read_manifest("latents")
    texts = store.read_manifest("text_embeds")
    clip = next(c for c in store.read_manifest("clips") if c["key"] == latents_rows[0]["clip_key"])
    try:
        store.write_manifest("latents", latents_rows[1:], part="demo-videos")
        store.write_manifest("text_embeds", [t for t in texts if t["text"] != clip["captions"][0]])
        result = latents_cover_clips(direct(resource))
        assert not result.passed and result.severity == AssetCheckSeverity.ERROR
        assert result.metadata["offending_count"].value == 1
        assert clip["source"] in result.metadata["offending"].value
        text_result = text_embeds_cover_captions(loraflow=resource)  # unpartitioned: no context
        assert not text_result.passed
        assert clip["source"] in text_result.metadata["offending"].value
    finally:
        store.write_manifest("latents", latents_rows, part="demo-videos")
        store.write_manifest("text_embeds", texts)
    assert latents_cover_clips(direct(resource)).passed


def test_a_latent_the_latents_stage_quarantined_is_not_reported_missing(tmp_path: Path) -> None:
    store = Store(str(tmp_path))  # one clip encodes to NaN every time: the check must not block every cache run
    store.write_manifest("clips", [clip_row(f"c{i}", "d", f"{i}.mp4").to_row() for i in range(2)], part="d")
    store.put("latents", [{"key": "l0", "latent": np.zeros((1,), np.float32)}])
    store.write_manifest("latents", [{"key": "l0", "clip_key": "c0", "bucket": "b"}], part="d")
    expected = [PlannedLatent(key=f"l{i}", tiled_key=f"t{i}", clip_key=f"c{i}", bucket="b", dataset="d",
                              source=f"{i}.mp4", frames="0-0")
                for i in range(2)]
    assert [r["clip"] for r in clips_without_latents(expected, store, ["d"])] == ["c1"]
    store.write_manifest("latents_quarantine", [{"key": "l1", "clip_key": "c1", "dataset": "d",
                                                 "reason": "non_finite_latent"}], part="d")
    assert clips_without_latents(expected, store, ["d"]) == [] == clips_without_latents(expected, store, None)


def test_latent_check_lists_wrong_shapes_and_non_finite_values(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    clips = [clip_row(f"c{i}", "d", f"{i}.mp4", num_frames=17, width=96).to_row() for i in range(3)]
    store.write_manifest("clips", clips)
    good = np.zeros((16, 5, 8, 12), np.float32)
    nan = good.copy()
    nan[0, 0, 0, :3] = np.nan
    wrong = np.zeros((16, 4, 8, 12), np.float32)  # 13 frames' worth in a 17-frame bucket
    store.put("latents", [{"key": "l0", "latent": good}, {"key": "l1", "latent": nan}])
    store.put("latents", [{"key": "l2", "latent": wrong}])
    store.write_manifest("latents", [{"key": f"l{i}", "clip_key": f"c{i}", "bucket": "96x64@17"} for i in range(3)]
                         + [{"key": "l3", "clip_key": "c0", "bucket": "96x64@17"}])  # listed, never stored
    checked, offending = bad_latents(store, LatentGeometry(channels=16, temporal=4, spatial=8))
    assert checked == 4
    problems = {row["latent"]: row["problem"] for row in offending}
    assert set(problems) == {"l1", "l2", "l3"}
    assert problems["l1"] == "3 non-finite values"
    assert "expected (16, 5, 8, 12)" in problems["l2"]
    assert "not in the store" in problems["l3"]


def test_empty_captions_warn_and_list_the_clip(tmp_path: Path, tiny_k5: Path, demo_data: Path) -> None:
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    store = Store(str(tmp_path / "cache"), load_config(config).manifest_names)  # the list the check reads
    store.write_manifest("clips", [clip_row("k", "demo-videos", "quiet.mp4", captions=("",)).to_row(),
                                   clip_row("k", "demo-videos", "loud.mp4", captions=("a dog",)).to_row()])
    result = captions_not_empty(direct(LoraflowResource(config_path=str(config))))
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
    assert "quiet.mp4" in result.metadata["offending"].value and "loud.mp4" not in result.metadata["offending"].value


def test_lora_check_lists_bad_keys_unpaired_tensors_and_non_finite_values(tmp_path: Path) -> None:
    a = np.ones((4, 8), np.float32)
    b = np.ones((8, 4), np.float32)
    good = tmp_path / "good.safetensors"
    save_file({"transformer.blocks.0.to_query.lora_A.weight": a, "transformer.blocks.0.to_query.lora_B.weight": b},
              str(good))
    assert lora_problems(good, rank=4) == (2, [])
    bad = tmp_path / "bad.safetensors"
    save_file({"transformer.blocks.0.to_query.lora_A.weight": a,
               "transformer.blocks.0.to_query.lora_B.weight": np.full((8, 4), np.inf, np.float32),
               "transformer.blocks.1.to_key.lora_A.weight": a,  # no lora_B partner
               "unet.down.lora_A.weight": a}, str(bad))
    checked, offending = lora_problems(bad, rank=4)
    problems = {row["tensor"]: row["problem"] for row in offending}
    assert checked == 4 and len(problems) == 3
    assert problems["transformer.blocks.0.to_query.lora_B.weight"] == "32 non-finite values"
    assert "no partner" in problems["transformer.blocks.1.to_key.lora_A.weight"]
    assert "transformer." in problems["unet.down.lora_A.weight"]
    assert "rank" in lora_problems(good, rank=8)[1][0]["problem"]
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert "does not open" in lora_problems(tmp_path / "junk.safetensors", rank=4)[1][0]["problem"]


# -- sensor --------------------------------------------------------------------------------------
def _watch_config(tmp_path: Path, **extra: object) -> tuple[Path, dict[str, Path]]:
    dirs = {name: tmp_path / name for name in ("cats", "dogs")}
    for d in dirs.values():
        d.mkdir()
        (d / "one.mp4").write_bytes(b"x" * 10)
        (d / "one.txt").write_text("one")
    data = {"model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tmp_path / "model"),
            "datasets": [{"id": name, "instance_data_dir": str(d)} for name, d in dirs.items()], **extra}
    return write_config(tmp_path / "config.yaml", data), dirs


def _tick(config: Path, cursor: str | None, instance: DagsterInstance):
    context = build_sensor_context(cursor=cursor, instance=instance,
                                   resources={"loraflow": LoraflowResource(config_path=str(config))})
    return dataset_watch(context)


def test_sensor_adds_a_partition_per_dataset_and_requests_a_run_per_changed_one(tmp_path: Path) -> None:
    config, dirs = _watch_config(tmp_path)
    with DagsterInstance.ephemeral() as instance:
        first = _tick(config, None, instance)  # never looked before: both datasets may be uncached
        (add,) = first.dynamic_partitions_requests
        assert isinstance(add, AddDynamicPartitionsRequest)
        assert (add.partitions_def_name, list(add.partition_keys)) == ("datasets", ["cats", "dogs"])
        assert [(r.partition_key, r.tags[CHANGED_TAG]) for r in first.run_requests] == [("cats", "cats"),
                                                                                          ("dogs", "dogs")]
        instance.add_dynamic_partitions(DATASETS.name, list(add.partition_keys))  # what the daemon does with it
        same = _tick(config, first.cursor, instance)
        assert isinstance(same.skip_reason, SkipReason) and not same.run_requests
        assert not same.dynamic_partitions_requests
        (dirs["dogs"] / "two.mp4").write_bytes(b"y" * 10)  # added
        added = _tick(config, same.cursor, instance)
        (request,) = added.run_requests
        assert (request.partition_key, request.tags[CHANGED_TAG]) == ("dogs", "dogs")  # cats is not re-planned
        (observation,) = added.asset_events
        assert (observation.asset_key, observation.partition) == (AssetKey("clips"), "dogs")
        assert observation.metadata["files"].value == {"before": 2, "after": 3, "missing_folder": False}
        (dirs["cats"] / "one.txt").write_text("one, edited caption")  # changed (size)
        changed = _tick(config, added.cursor, instance)
        assert [r.partition_key for r in changed.run_requests] == ["cats"]
        assert changed.run_requests[0].run_key != first.run_requests[0].run_key
        (dirs["dogs"] / "two.mp4").unlink()  # removed
        again = _tick(config, changed.cursor, instance)
        assert [r.partition_key for r in again.run_requests] == ["dogs"]
        assert again.run_requests[0].run_key != request.run_key


def test_sensor_runs_again_when_a_dataset_returns_to_a_state_it_had(tmp_path: Path) -> None:
    config, dirs = _watch_config(tmp_path)
    moved = tmp_path / "one.mp4"
    with DagsterInstance.ephemeral() as instance:
        first = _tick(config, None, instance)
        instance.add_dynamic_partitions(DATASETS.name, ["cats", "dogs"])  # what the daemon does with the request
        keys = {r.run_key for r in first.run_requests}
        cursor = first.cursor
        for _ in range(2):  # a file moved out and back (its mtime kept), twice: every change is a new run
            (dirs["dogs"] / "one.mp4").rename(moved)
            out = _tick(config, cursor, instance)
            moved.rename(dirs["dogs"] / "one.mp4")
            back = _tick(config, out.cursor, instance)
            cursor = back.cursor
            for result in (out, back):
                (request,) = result.run_requests
                assert request.partition_key == "dogs" and request.run_key not in keys  # Dagster would skip it
                keys.add(request.run_key)


def test_sensor_deletes_the_partition_of_a_removed_dataset_and_adds_a_new_one(tmp_path: Path) -> None:
    config, dirs = _watch_config(tmp_path)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(DATASETS.name, ["cats", "dogs"])
        cursor = _tick(config, None, instance).cursor
        data = yaml.safe_load(config.read_text())
        (tmp_path / "birds").mkdir()
        data["datasets"] = [data["datasets"][0], {"id": "birds", "instance_data_dir": str(tmp_path / "birds")}]
        write_config(config, data)
        result = _tick(config, cursor, instance)
        add, delete = result.dynamic_partitions_requests
        assert isinstance(add, AddDynamicPartitionsRequest) and list(add.partition_keys) == ["birds"]
        assert isinstance(delete, DeleteDynamicPartitionsRequest) and list(delete.partition_keys) == ["dogs"]
        assert [r.partition_key for r in result.run_requests] == ["birds"]  # dogs: no run for a removed dataset
        data["datasets"] = data["datasets"][:1]
        write_config(config, data)
        instance.add_dynamic_partitions(DATASETS.name, ["birds"])
        instance.delete_dynamic_partition(DATASETS.name, "dogs")
        only_delete = _tick(config, result.cursor, instance)
        assert not only_delete.run_requests and only_delete.skip_reason is None
        (delete,) = only_delete.dynamic_partitions_requests
        assert list(delete.partition_keys) == ["birds"]


def test_sensor_ignores_hidden_files_and_is_off_by_default(tmp_path: Path) -> None:
    config, dirs = _watch_config(tmp_path)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(DATASETS.name, ["cats", "dogs"])
        cursor = _tick(config, None, instance).cursor
        (dirs["cats"] / ".one.mp4.swp").write_bytes(b"z")
        assert _tick(config, cursor, instance).skip_reason is not None
    assert dataset_watch.default_status == DefaultSensorStatus.STOPPED
    assert dataset_watch.job_name == "cache_dataset"


# -- schedule, definitions, retries ------------------------------------------------------------------
def test_recache_schedule_follows_recache_cron(tmp_path: Path) -> None:
    (tmp_path / "on").mkdir()
    on, _ = _watch_config(tmp_path / "on", recache_cron="*/15 * * * *")
    schedule = recache_schedule(str(on))
    assert schedule.cron_schedule == "*/15 * * * *"
    assert schedule.default_status == DefaultScheduleStatus.RUNNING and schedule.job_name == "cache_dataset"
    (tmp_path / "off").mkdir()
    off, _ = _watch_config(tmp_path / "off")
    schedule = recache_schedule(str(off))
    assert schedule.cron_schedule == DEFAULT_CRON and schedule.default_status == DefaultScheduleStatus.STOPPED
    broken = write_config(tmp_path / "broken.yaml", {**yaml.safe_load(off.read_text()), "lora_rnk": 4})
    schedule = recache_schedule(str(broken))
    assert schedule.default_status == DefaultScheduleStatus.STOPPED and "could not be read" in schedule.description
    with pytest.raises(ConfigError, match=r"recache_cron: .* 5-field cron .* got 'every day'"):
        load_config(write_config(tmp_path / "bad_cron.yaml", {**yaml.safe_load(off.read_text()),
                                                                "recache_cron": "every day"}))


def test_recache_requests_a_run_per_dataset_partition(tmp_path: Path) -> None:
    config, _ = _watch_config(tmp_path, recache_cron="0 4 * * *")
    schedule = recache_schedule(str(config))
    with DagsterInstance.local_temp(str(tmp_path)) as instance:  # a schedule context needs a stored instance
        when = datetime(2025, 1, 2, 4, 0, tzinfo=timezone.utc)
        nothing = schedule(build_schedule_context(instance=instance, scheduled_execution_time=when))
        assert isinstance(nothing, SkipReason) and "cats" in nothing.skip_message  # no partition yet
        instance.add_dynamic_partitions(DATASETS.name, ["cats", "dogs", "gone"])  # gone: not in the config
        requests = schedule(build_schedule_context(instance=instance, scheduled_execution_time=when))
        assert [r.partition_key for r in requests] == ["cats", "dogs"]
        assert len({r.run_key for r in requests}) == 2 and all(r.tags["loraflow/trigger"] == "recache"
                                                               for r in requests)


def test_definitions_wire_partitions_jobs_checks_sensor_schedule_and_retries() -> None:
    from loraflow.definitions import code_location

    defs = code_location()
    assert {s.name for s in defs.schedules} == {"recache"}
    assert {s.name for s in defs.sensors} == {"dataset_watch"}
    graph = defs.resolve_asset_graph()
    partitioned = {key.path[-1]: graph.get(key).partitions_def for key in graph.get_all_asset_keys()}
    # dataset_files: the observable source the clips depend on, per dataset (a source changed after caching shows
    # that dataset's clips stale: issue 42 item 14)
    assert partitioned == {"dataset_files": DATASETS, "clips": DATASETS, "latents": DATASETS, "text_embeds": None,
                           "teacher_features": None, "lora": None, "validation": None}
    cache = defs.resolve_job_def("cache_dataset")
    assert cache.partitions_def == DATASETS
    assert cache.op_retry_policy is not None and cache.op_retry_policy.max_retries == 2
    # it observes every dataset's folder first (partitioned `dataset_files`), which makes Dagster give the job the
    # datasets' partitions; `loraflow demo` and the CLI run it without a partition key, which observes them all
    assert defs.resolve_job_def("train_and_validate").partitions_def == DATASETS
    check_names = {key.name for key in graph.asset_check_keys}
    assert check_names == {c.check_specs_by_output_name[n].name
                           for c in ALL_CHECKS for n in c.check_specs_by_output_name}


def test_a_config_error_fails_the_cache_job_once_without_retries(tmp_path: Path) -> None:
    # a flavour without a published diffusers repository: the model is a required key
    broken = write_config(tmp_path / "broken.yaml", {"model_family": "kandinsky5-video",
                                                     "model_flavour": "i2v-pro-pretrain-5s", "lora_rnk": 4})
    defs = build_defs(LoraflowResource(config_path=str(broken)))
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(DATASETS.name, ["demo-videos"])
    result = defs.resolve_job_def("cache_dataset").execute_in_process(raise_on_error=False, instance=instance,
                                                                      partition_key="demo-videos")
    assert not result.success
    types = [event.event_type for event in result.all_events]
    assert DagsterEventType.STEP_UP_FOR_RETRY not in types and DagsterEventType.STEP_RESTARTED not in types
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    message = failure.step_failure_data.user_failure_data.description
    assert "lora_rnk: unknown key; did you mean 'lora_rank'?" in message
    assert "pretrained_model_name_or_path: required key is missing" in message
    assert os.path.basename(str(broken)) in message
