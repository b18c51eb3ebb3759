"""Declarative automation, evaluated by Dagster itself on a real instance: which assets a tick would request.

`dagster.evaluate_automation_conditions` runs the evaluation of the `default_automation_condition_sensor` without
the daemon, so the conditions in stages.py are checked against real materializations of a real instance.
"""

from __future__ import annotations

from pathlib import Path

from dagster import AssetKey, AssetMaterialization, DagsterInstance, evaluate_automation_conditions, materialize

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import clips
from loraflow.definitions import code_location
from tests.factory import demo_dict, write_config

PARTITION = "demo-videos"
STAGES = ("clips", "latents", "text_embeds", "lora", "validation")


def _requested(result) -> set[str]:
    return {name for name in STAGES if result.get_num_requested(AssetKey(name))}


def test_upstream_updates_re_embed_and_re_render_but_never_start_training(tiny_k5: Path, demo_data: Path,
                                                                         tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    defs = code_location()
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("datasets", [PARTITION])
        tick = evaluate_automation_conditions(defs, instance)
        assert _requested(tick) == set()  # nothing cached yet: text_embeds waits for its upstream clips
        assert materialize([clips], partition_key=PARTITION, instance=instance,
                           resources={"loraflow": LoraflowResource(config_path=str(config))}).success
        tick = evaluate_automation_conditions(defs, instance, cursor=tick.cursor)
        assert _requested(tick) == {"text_embeds"}  # not lora: starting a training run is the user's call
        # A LoRA trained outside this instance's automation (the CLI, the UI): recorded as Dagster records any
        # materialization, it is what validation follows.
        for stage in ("text_embeds", "lora"):
            instance.report_runless_asset_event(AssetMaterialization(stage))
        tick = evaluate_automation_conditions(defs, instance, cursor=tick.cursor)
        assert _requested(tick) == {"validation"}
