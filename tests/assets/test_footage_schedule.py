"""Raw footage through the `recache` schedule (issue 60's acceptance: from the UI, one stage from the CLI and the
schedule): a long recording with a hard cut and no caption file, `video.scene_cuts: detect` and `caption_strategy:
auto`, cached by the run the schedule requests (the `cache_dataset` job of the config's own graph, as Dagster's
daemon launches it): the clips lie inside scenes, every clip is captioned by the tiny Qwen2.5-VL, and the next tick's
run computes nothing again."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from dagster import DagsterInstance, build_schedule_context

from loraflow.assets.jobs import QUIET, build_defs
from loraflow.assets.partitions import sync_partitions
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.schedules import recache_schedule
from loraflow.contracts.clip_rows import read_clips
from loraflow.store import Store
from tests.factory import clips_config, write_config
from tests.stages.test_auto_captions import tiny_vl  # noqa: F401  (the module fixture: a tiny Qwen2.5-VL folder)
from tests.stages.test_scene_cuts import CUT, footage


def _materialized(result, name: str) -> dict:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == name]
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_the_recache_schedule_cuts_scenes_and_captions_raw_footage(tiny_k5: Path, tiny_vl: Path,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    footage(tmp_path / "data")  # long.mp4 and no long.txt
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(tmp_path / "data"), "caption_strategy": "auto",
                                               "video": {"num_frames": 17, "frame_extraction": "chunk",
                                                         "scene_cuts": "detect"}}],
                          caption_model_path=str(tiny_vl), caption_max_new_tokens=6, recache_cron="0 4 * * *")
    path = write_config(tmp_path / "footage.yaml", config.model_dump(mode="json", exclude_defaults=True))
    resource = LoraflowResource(config_path=str(path))
    job = build_defs(resource).resolve_job_def("cache_dataset")
    schedule = recache_schedule(str(path))
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        sync_partitions(instance, config)
        runs = []
        for hour in (4, 5):  # two ticks of the schedule, each a cache_dataset run as the daemon would launch it
            when = datetime(2026, 12, 2, hour, 0, tzinfo=timezone.utc)
            (request,) = schedule(build_schedule_context(instance=instance, scheduled_execution_time=when))
            runs.append(job.execute_in_process(instance=instance, partition_key=request.partition_key,
                                               tags=request.tags, run_config=QUIET))
    assert all(run.success for run in runs)
    clips = read_clips(Store(config.cache_dir, config.manifest_names))
    assert {c.scene.number for c in clips} == {1, 2}  # clips on both sides of the cut
    assert all((c.indices[0] < CUT) == (c.indices[-1] < CUT) for c in clips), "a clip spans the cut"
    assert all(c.captions and c.captions[0] for c in clips)  # every clip captioned by the captioner
    first, second = (_materialized(run, "captions") for run in runs)
    assert (first["computed"], first["captioned_clips"]) == (len(clips), len(clips))
    assert second["computed"] == 0  # the next tick captions nothing again
    assert _materialized(runs[1], "clips")["computed"] == 0
