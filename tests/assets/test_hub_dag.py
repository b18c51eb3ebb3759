"""The whole DAG through Dagster on a model named by Hugging Face id, offline from a pre-populated HF cache; run again
from the same cache moved elsewhere, it recomputes nothing. A Hub that cannot be reached fails the first step once, in
one message.

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

from tests.factory import K5_DEFAULT_REPO, REPO, demo_dict, hf_cache_snapshot, k5_settings, write_config

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


# One cache_dataset run (clips, then latents) of a config naming the flavour's repository, on a machine whose Hub
# refuses connections: the step failures it records, as the UI and the event log show them.
UNREACHABLE = """
import json, sys
from dagster import DagsterEventType, DagsterInstance
from loraflow.assets.jobs import build_defs
from loraflow.assets.partitions import DATASETS
from loraflow.assets.resources import LoraflowResource

instance = DagsterInstance.ephemeral()
instance.add_dynamic_partitions(DATASETS.name, ["v"])
result = build_defs(LoraflowResource(config_path=sys.argv[1])).resolve_job_def("cache_dataset").execute_in_process(
    raise_on_error=False, instance=instance, partition_key="v")
failures = [{"step": e.step_key, "description": getattr(e.step_failure_data.user_failure_data, "description", ""),
             "error": e.step_failure_data.error.message, "chained": bool(e.step_failure_data.error.cause
                                                                          or e.step_failure_data.error.context)}
            for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
retried = any(e.event_type == DagsterEventType.STEP_UP_FOR_RETRY for e in result.all_events)
print(json.dumps({"success": result.success, "retried": retried, "failures": failures}))
"""


def test_an_unreachable_hub_fails_the_first_step_once_saying_what_to_do(
        tmp_path: Path, unreachable_hub: dict[str, str]) -> None:
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path))  # the flavour's repository, not cached
    env = {k: v for k, v in unreachable_hub.items() if k != "DAGSTER_HOME"}  # an ephemeral instance: no guard thread
    done = subprocess.run([sys.executable, "-c", UNREACHABLE, str(config)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert not run["success"] and not run["retried"]  # retrying cannot bring the network: the message says what can
    (failure,) = run["failures"]  # clips resolves the model first; latents never starts
    assert failure["step"] == "clips" and not failure["chained"]  # no traceback from inside huggingface_hub
    message = failure["description"]
    assert "\n" not in message and message in failure["error"]
    assert message.startswith(f"the Hugging Face Hub ({unreachable_hub['HF_ENDPOINT']}) did not answer for "
                              f"{K5_DEFAULT_REPO} (ConnectError")
    assert "run with HF_HUB_OFFLINE=1; or set `pretrained_model_name_or_path` to a local diffusers" in message
