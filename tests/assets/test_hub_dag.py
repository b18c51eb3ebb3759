"""The whole DAG through Dagster on a model named by Hugging Face id, offline from a pre-populated HF cache; run again
from the same cache moved elsewhere, it recomputes nothing.

Each pass is its own process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set, as a user runs it (huggingface_hub reads
both at import).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, demo_dict, hf_cache_snapshot, write_config

PASS = """
import json, sys
from dagster import DagsterInstance
from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource

results = materialize_everything(LoraflowResource(config_path=sys.argv[1]), DagsterInstance.ephemeral())
computed = {e.asset_key.path[-1]: e.materialization.metadata["computed"].value
            for r in results for e in r.get_asset_materialization_events()}
print(json.dumps({"success": [r.success for r in results], "computed": computed}))
"""


def run_pass(config: Path, cache: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PASS, str(config)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_dag_runs_offline_from_the_hf_cache_and_a_moved_cache_recomputes_nothing(
        tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    hf_cache_snapshot(cache, "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", tiny_k5, "c" * 40)
    settings = demo_dict(tiny_k5, demo_data, tmp_path, max_train_steps=2, checkpointing_steps=2)
    del settings["pretrained_model_name_or_path"]  # the flavour's diffusers repository, as the guides leave it
    config = write_config(tmp_path / "config.yaml", settings)
    first = run_pass(config, cache)
    assert first["success"] == [True, True]
    assert all(first["computed"][stage] > 0 for stage in ("clips", "latents", "text_embeds", "lora", "validation"))
    moved = tmp_path / "moved-hf"
    shutil.move(cache, moved)
    second = run_pass(config, moved)
    assert second["success"] == [True, True] and set(second["computed"].values()) == {0}
