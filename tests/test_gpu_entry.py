"""benchmarks/gpu/run.py, the one GPU entry point, end to end in --smoke mode (the CPU, tiny checkpoints): every
measurement leaves a sane result in the JSON, and one killed by its timeout leaves the earlier ones there. The smoke
forks its measurements from a process that imported torch and diffusers once; two tests start them as a GPU run
does, each in a new interpreter (`--fresh`, `in_new_interpreter`)."""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.factory import REPO
from tests.numerics import FLOAT32_AGREEMENT

RUN = REPO / "benchmarks" / "gpu" / "run.py"


def run_module() -> Any:
    """benchmarks/gpu/run.py imported (it puts its folder on sys.path: restored after)."""
    spec = importlib.util.spec_from_file_location("gpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules["gpu_run"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        del sys.modules["gpu_run"]
    return module


def smoke(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(RUN), "--smoke", "--out", str(out), "--work", str(tmp_path / "work"), *args],
                   check=True, capture_output=True, timeout=3600)
    return json.loads(out.read_text())


def test_every_measurement_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    report = smoke(tmp_path, "--budget", "3000")
    results = report["results"]
    assert report["device"] == "cpu-smoke" and list(results) == [m.name for m in run_module().REGISTRY]
    assert {k: r for k, r in results.items() if r["status"] != "ok"} == {}
    # loraflow/estimates' training step beside each training measurement (tiny configs, the smoke size)
    trained = {k for k in results if k.startswith("train_") and k != "train_resume"}
    # and beside the VAE encodes, the latents stage and the render (their own modules' `estimate`)
    estimated = trained | {k for k in results if k.startswith(("vae_encode_", "latents_stage_", "render_"))}
    assert all(r["estimate"] is None for k, r in results.items() if k not in estimated)
    assert all("error" not in results[k]["estimate"] and results[k]["estimate"] for k in estimated)
    for name in trained:  # HunyuanVideo 1.5 too: `known_values` answers what its forward asks of the batch
        estimate = results[name]["estimate"]
        assert estimate["peak_allocated_gib"] > 0 and estimate["flops_per_step"] > 0, name
        # the CPU has no measured peak: only the FLOPs are compared
        assert set(results[name]["measured_over_estimate"]) == {"flops_per_step"}, name
    assert results["matmul_peak"]["tflops"] > 0
    for name in (k for k in results if k.startswith("train_") and k != "train_resume"):
        train = results[name]
        assert train["seconds_per_step"] > 0 and train["flops_per_step"] > 0 and 0 < train["mfu"], name
        assert all(math.isfinite(v) for v in train["losses"]), name
    # group offload without streams (the CPU) runs the same arithmetic as checkpointing alone
    assert results["train_k5_offload_streams"]["lora_max_abs_diff_vs_checkpointing"] == 0.0
    render = results["render_hv15_720p"]
    assert render["denoise_s"] > 0 and render["decode_s"] > 0 and render["decode_tiled_s"] > 0
    assert results["latents_stage_hv15_768x81"]["computed"] == 6
    assert results["vae_encode_hv15_768x81"]["latent"][1] == 4  # the tiny VAE's latent channels
    resume = results["train_resume"]
    assert resume["killed_at_checkpoint"] == "step-0000002" and resume["resumed_at_step"] == 2
    assert resume["same_lora_bits"] is True
    modes = {row["mode"]: row for row in results["vae_hv15_720p"]["modes"]}
    assert set(modes) == {"stock", "patch"} and modes["stock"]["max_abs"] > 0
    # patch conv is the stock encode in other pieces: float32 rounding apart (tests/numerics.py), no more
    assert modes["patch"]["max_abs_diff_vs_exact"] <= FLOAT32_AGREEMENT * modes["stock"]["max_abs"]
    offload = results["offload_startup"]["runs"]
    assert [s["stage"] for s in offload["offload_True"]] == ["latents", "text_embeds"]
    assert all(s["computed"] > 0 for run in offload.values() for s in run)  # each run starts from an empty cache


def test_a_measurement_killed_by_its_timeout_leaves_the_earlier_ones_and_the_next_runs(tmp_path: Path) -> None:
    # forked with everything imported, the tiny measurement (load, a step, a counted step) takes over a second
    # here: 0.1 s ends it on any CPU
    report = smoke(tmp_path, "--only", "matmul_peak,train_k5_plain,vae_hv15_720p", "--timeout", "train_k5_plain=0.1")
    results = report["results"]
    assert list(results) == ["matmul_peak", "train_k5_plain", "vae_hv15_720p"]
    assert results["matmul_peak"]["status"] == "ok" and results["matmul_peak"]["tflops"] > 0
    estimate = results["train_k5_plain"].pop("estimate")  # computed beside the measurement: there even so
    assert estimate["peak_allocated_gib"] > 0 and estimate["flops_per_step"] > 0
    assert results["train_k5_plain"] == {"status": "timeout", "timeout_s": 0.1, "mfu": None,
                                         "measured_over_estimate": {}}
    assert results["vae_hv15_720p"]["status"] == "ok"


def test_a_new_interpreter_past_its_timeout_is_killed_and_recorded_as_a_timeout(tmp_path: Path) -> None:
    """A GPU run's way (`in_new_interpreter`): the child is still importing torch and diffusers at 0.5 s."""
    run = run_module()
    (train,) = [m for m in run.REGISTRY if m.name == "train_k5_plain"]
    assert run.run_one(train, 0.5, tmp_path, smoke=True) == {"status": "timeout", "timeout_s": 0.5}


def test_a_run_killed_mid_measurement_leaves_the_json_of_the_ones_before(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    # a new interpreter per measurement, as on a GPU
    run = subprocess.Popen([sys.executable, str(RUN), "--smoke", "--fresh", "--only", "matmul_peak,train_k5_plain",
                            "--out", str(out), "--work", str(tmp_path / "work")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600  # a guard, not a measurement: the smoke run writes it within seconds
        while not out.exists():  # written atomically: once there, it is whole
            assert run.poll() is None, "run.py ended before it wrote any JSON"
            assert time.monotonic() < deadline, "run.py wrote no JSON within 600 s"
            time.sleep(0.05)
        run.send_signal(signal.SIGKILL)  # its child measures train_k5_plain (it dies with run.py)
    finally:
        run.wait()
    assert run.returncode == -signal.SIGKILL, "the kill should land while train_k5_plain runs"
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["matmul_peak"] and results["matmul_peak"]["status"] == "ok"


def test_mfu_and_the_comparison_with_estimates_divide_what_both_sides_have() -> None:
    run = run_module()
    assert run.mfu({"flops_per_step": 4e14, "seconds_per_step": 2.0}, 800.0) == 0.25  # 200 of 800 TFLOP/s
    assert run.mfu({"flops_per_step": 4e14, "seconds_per_step": 1.0}, None) is None  # no measured peak: no MFU
    measured = {"peak_allocated_gib": 30.0, "seconds_per_step": 2.0}
    assert run.compared(measured, {"peak_allocated_gib": 24.0, "flops_per_step": 1e15}) == {"peak_allocated_gib": 1.25}
    assert run.compared(measured, None) == {}
