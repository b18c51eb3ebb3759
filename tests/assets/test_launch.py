"""The `lora` asset with num_processes 2: `accelerate launch` of two CPU ranks under Dagster Pipes (real subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dagster import DagsterEventType, DagsterInstance, materialize

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import lora
from loraflow.config import load_config
from loraflow.ops import train as T
from loraflow.store import Store
from tests.ops.test_train import build_caches, make_config


@pytest.fixture(scope="module")
def launched(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("launch")
    caches = build_caches(tiny_k5, demo_data, root)
    make_config(caches, root / "two", num_processes=2, max_train_steps=2)
    instance = DagsterInstance.ephemeral()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")  # the launched ranks use gloo on CPUs, also on a one-GPU machine
        result = materialize([lora], resources={"loraflow": LoraflowResource(config_path=str(root / "two.yaml"))},
                             instance=instance)
    return result, instance, load_config(root / "two.yaml")


def test_rank_0_reports_the_materialization(launched) -> None:
    result, _, config = launched
    assert result.success
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    run = T.run_dir(config, T.upstream_versions(Store(config.cache_dir)))
    assert meta["computed"] == 2 and meta["lora_path"] == str(run / T.LORA_FILE) and Path(meta["lora_path"]).is_file()
    assert event.materialization.tags["dagster/data_version"] == run.name
    history = json.loads((run / "history.json").read_text())
    assert meta["final_loss"] == history[-1]["loss"] and np.isfinite(meta["final_loss"])
    assert "data:image/png;base64," in meta["loss_curve"] and set(meta["inputs"]) == {"latents", "text_embeds"}


def test_only_rank_0_logs_to_dagster(launched) -> None:
    result, instance, _ = launched
    logs = [e.user_message for e in instance.all_logs(result.run_id) if e.dagster_event is None]
    assert sum("step 1/2 |" in m for m in logs) == 1 and sum("step 2/2 |" in m for m in logs) == 1
    assert any("rank 0 of 2" in m for m in logs) and not any("rank 1 of 2" in m for m in logs)
    assert not any(e.dagster_event.event_type == DagsterEventType.STEP_FAILURE
                   for e in instance.all_logs(result.run_id) if e.dagster_event is not None)
