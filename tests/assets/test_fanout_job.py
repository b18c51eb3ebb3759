"""`cache_latents_fanout`: Dagster's dynamic mapping runs one step per shard; `cache_dataset` then lists them all."""

from __future__ import annotations

from pathlib import Path

from dagster import DagsterInstance, Definitions

from loraflow.assets.fanout import cache_latents_fanout
from loraflow.assets.jobs import QUIET, build_defs
from loraflow.assets.partitions import sync_partitions
from loraflow.assets.resources import LoraflowResource
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.store import Store
from tests.factory import demo_dict, write_config


def test_one_step_per_shard_then_cache_dataset_computes_nothing(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    resource = LoraflowResource(
        config_path=str(write_config(tmp_path / "c.yaml", demo_dict(tiny_k5, demo_data, tmp_path))))
    config = resource.load()
    store = Store(config.cache_dir, config.manifest_names)
    clips = build_clips(config, get_family(config), model_source(config), store, datasets=["demo-videos"])
    assert not clips.quarantined, clips.quarantined  # (a decode_timeout here means a host too loaded for this test)
    instance = DagsterInstance.ephemeral()
    fanout = Definitions(jobs=[cache_latents_fanout], resources={"loraflow": resource})
    run_config = {**QUIET, "ops": {"latents_shards": {"config": {"dataset": "demo-videos", "workers": 3}}}}
    result = fanout.resolve_job_def("cache_latents_fanout").execute_in_process(instance=instance, run_config=run_config)
    assert result.success
    steps = sorted(e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS")
    assert [s for s in steps if s.startswith("latents_shard[")] == [f"latents_shard[shard_{i}]" for i in range(3)]
    assert result.output_for_node("latents_fanned_out") == clips.computed  # every clip, once
    assert len(store.keys("latents")) == clips.computed and not store.manifest_parts("latents")

    sync_partitions(instance, config)
    cached = build_defs(resource).resolve_job_def("cache_dataset").execute_in_process(
        instance=instance, partition_key="demo-videos", run_config=QUIET)
    (latents,) = [e for e in cached.get_asset_materialization_events() if e.asset_key.path[-1] == "latents"]
    meta = latents.materialization.metadata
    assert (meta["computed"].value, meta["reused"].value) == (0, clips.computed)
