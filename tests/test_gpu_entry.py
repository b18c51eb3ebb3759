"""benchmarks/gpu/run.py, the one GPU entry point, end to end in --smoke mode (the CPU, tiny checkpoints): every
measurement leaves a sane result in the JSON, and one killed by its timeout leaves the earlier ones there."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO

RUN = REPO / "benchmarks" / "gpu" / "run.py"


def registry_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("gpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [m.name for m in module.REGISTRY]


def smoke(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(RUN), "--smoke", "--out", str(out), "--work", str(tmp_path / "work"), *args],
                   check=True, capture_output=True, timeout=1800)
    return json.loads(out.read_text())


def test_every_measurement_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    report = smoke(tmp_path, "--budget", "1500")
    results = report["results"]
    assert report["device"] == "cpu-smoke" and list(results) == registry_names()
    assert {k: r for k, r in results.items() if r["status"] != "ok"} == {}
    assert all(r["estimate"] is None for r in results.values())  # until loraflow/estimates.py is connected
    assert results["matmul_peak"]["tflops"] > 0
    for name in (k for k in results if k.startswith("train_") and k != "train_resume"):
        train = results[name]
        assert train["seconds_per_step"] > 0 and train["flops_per_step"] > 0 and 0 < train["mfu"], name
        assert all(math.isfinite(v) for v in train["losses"]), name
    # group offload without streams (the CPU) runs the same arithmetic as checkpointing alone
    assert results["train_k5_offload_streams"]["lora_max_abs_diff_vs_checkpointing"] == 0.0
    resume = results["train_resume"]
    assert resume["killed_at_checkpoint"] == "step-0000002" and resume["resumed_at_step"] == 2
    assert resume["same_lora_bits"] is True
    modes = {row["mode"]: row for row in results["vae_hv15_720p"]["modes"]}
    assert set(modes) == {"stock", "patch"} and math.isfinite(modes["patch"]["max_abs_diff_vs_exact"])
    offload = results["offload_startup"]["runs"]
    assert [s["stage"] for s in offload["offload_True"]] == ["latents", "text_embeds"]
    assert all(s["computed"] > 0 for run in offload.values() for s in run)  # each run starts from an empty cache


def test_a_measurement_killed_by_its_timeout_leaves_the_earlier_ones_and_the_next_runs(tmp_path: Path) -> None:
    report = smoke(tmp_path, "--only", "matmul_peak,train_k5_plain,vae_hv15_720p", "--timeout", "train_k5_plain=0.5")
    results = report["results"]
    assert list(results) == ["matmul_peak", "train_k5_plain", "vae_hv15_720p"]
    assert results["matmul_peak"]["status"] == "ok" and results["matmul_peak"]["tflops"] > 0
    assert results["train_k5_plain"] == {"status": "timeout", "timeout_s": 0.5, "mfu": None, "estimate": None,
                                         "measured_over_estimate": {}}
    assert results["vae_hv15_720p"]["status"] == "ok"
