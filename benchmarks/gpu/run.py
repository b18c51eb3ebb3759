"""Every GPU measurement, in priority order, within one total time budget: the one entry point for a GPU machine.

Each measurement runs in a fresh subprocess (clean allocator, honest peak) with a timeout of what is left of the
budget, capped by the measurement's own limit, and the JSON is rewritten (atomically) after each one, so a run cut
off anywhere keeps what it measured. A measurement that runs past its timeout is recorded as `timeout`, one that
fails as `error` (its last stderr line); the next one starts while time is left. `--smoke` runs the same code on
the CPU with the tiny checkpoints (numbers meaningless): tests/test_gpu_entry.py runs it.

    benchmarks/gpu/install.sh wheelhouse/py3.12-manylinux_2_28_x86_64-gpu   # offline install (scripts/wheelhouse.sh)
    python benchmarks/gpu/run.py                     # -> benchmarks/results/gpu_<device>.json, 480 s in all
    python benchmarks/gpu/run.py --only train_k5_plain,vae_hv15_720p --budget 300
    python benchmarks/gpu/run.py --smoke --out /tmp/gpu_smoke.json

Measurements (priority order; the modules beside this file):
  matmul_peak        the device's bf16 matmul peak, measured: the denominator of every MFU below
  train_k5_*         Kandinsky 5 Video Lite t2v 512x768x61, rank 16, bf16: s/step, peaks, MFU (train.py)
  train_hv15_*       HunyuanVideo 1.5 t2v 480p x 61, gradient checkpointing (train.py)
  train_resume       train_main for a few steps, killed after its checkpoint and resumed: the same LoRA bits
                     (resume.py; on the tiny demo model and data, the stages write the caches)
  vae_hv15_720p      HunyuanVideo 1.5 VAE encode 720p x 121: stock vs exact patch conv (vae.py)
  vae_flux_1024      the Flux VAE (Kandinsky 5 Image) encoding one 1024x1024 image (vae.py)
  offload_startup    latents then text_embeds stages, offload_during_startup off/on (offload.py; tiny demo)
Not measured yet (issue 30): a 61-frame 512x768 validation render, the latents stage over 6 clips of 768x768x81,
the real-size text encoders through text_embeds (bf16, int8).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]  # loraflow, and the measurement modules beside this file


@dataclass(frozen=True)
class Measurement:
    name: str
    module: str  # a module beside this file with measure(work: Path, smoke: bool, **kwargs) -> dict
    kwargs: dict[str, Any] = field(default_factory=dict)
    cap_s: float = 120.0  # its own limit on a GPU; the time left of the budget may give it less


K5, HV15 = "kandinsky5-video", "hunyuanvideo-1.5"
REGISTRY: list[Measurement] = [
    Measurement("matmul_peak", "matmul", cap_s=30),
    Measurement("train_k5_plain", "train", {"family": K5, "variant": "plain"}, cap_s=150),  # writes the checkpoint
    Measurement("train_k5_checkpointing", "train", {"family": K5, "variant": "checkpointing"}),
    Measurement("train_k5_tread0.5", "train", {"family": K5, "variant": "checkpointing+tread0.5"}),
    Measurement("train_k5_fp8", "train", {"family": K5, "variant": "checkpointing+fp8"}),
    Measurement("train_k5_offload_streams", "train", {"family": K5, "variant": "checkpointing+offload"}),
    Measurement("train_hv15_checkpointing", "train", {"family": HV15, "variant": "checkpointing"}, cap_s=240),
    Measurement("train_resume", "resume", cap_s=180),
    Measurement("vae_hv15_720p", "vae", {"vae": "hv15", "size": (720, 1280), "frames": 121,
                                         "modes": ("stock", "patch")}, cap_s=180),
    Measurement("vae_flux_1024", "vae", {"vae": "flux", "size": (1024, 1024), "frames": 1, "modes": ("stock",)},
                cap_s=60),
    Measurement("offload_startup", "offload", cap_s=120),
]
SMOKE_CAP_S = 600.0  # per measurement on a CPU: the tiny models need seconds, a loaded shared CPU minutes


def estimate_for(measurement: Measurement, work: Path, smoke: bool) -> dict | None:
    """loraflow/estimates.py's numbers for a training measurement (train.py's `estimate`: the same config, latent
    and caption length on fake tensors, on the CPU); None for the others. Its keys beside the measured ones
    (`peak_allocated_gib`, `flops_per_step`) are compared by `compared`; a failed estimate records its error and
    the run goes on."""
    if measurement.module != "train":
        return None
    import train

    try:
        return train.estimate(work, smoke, **measurement.kwargs)
    except Exception as exc:  # noqa: BLE001 - an estimate must not cost the GPU measurements after it
        return {"error": f"{type(exc).__name__}: {exc}"}


def compared(result: dict[str, Any], estimate: dict[str, Any] | None) -> dict[str, float]:
    """measured / estimated for each number both have (1.0: the estimate was exact)."""
    if estimate is None:
        return {}
    both = [k for k, v in estimate.items() if isinstance(v, (int, float)) and isinstance(result.get(k), (int, float))]
    return {k: round(result[k] / estimate[k], 3) for k in both if estimate[k]}


def device_name(smoke: bool) -> str:
    import torch

    if smoke:
        return "cpu-smoke"
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/run.py needs a CUDA device (use --smoke for the CPU check at tiny size)")
    return torch.cuda.get_device_name()


def mfu(result: dict[str, Any], peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: the step's counted FLOPs per second over the measured bf16 matmul peak."""
    if peak_tflops is None or "flops_per_step" not in result:
        return None
    return round(result["flops_per_step"] / result["seconds_per_step"] / (peak_tflops * 1e12), 4)


def run_one(measurement: Measurement, timeout: float, work: Path, smoke: bool) -> dict[str, Any]:
    """The measurement in a fresh process; its result, or why there is none."""
    argv = [sys.executable, __file__, "--child", measurement.name, "--work", str(work)] + (["--smoke"] if smoke else [])
    # the child's own children (train_main) import this checkout's loraflow too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    began = time.perf_counter()
    # its own process group: a timeout kills what it started too (train_main, media workers)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return {"status": "timeout", "timeout_s": round(timeout, 1)}
    seconds = round(time.perf_counter() - began, 1)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if process.returncode or not lines:
        last = stderr.strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "error": f"exit {process.returncode}: {last[0]}", "wall_s": seconds}
    return {"status": "ok", "wall_s": seconds, **json.loads(lines[-1].removeprefix("RESULT "))}


def child(name: str, work: Path, smoke: bool) -> None:
    from loraflow.lifetime import die_with_parent

    die_with_parent()  # in a session of its own: a killed run.py must not leave it holding the GPU
    (measurement,) = [m for m in REGISTRY if m.name == name]
    result = importlib.import_module(measurement.module).measure(work, smoke, **measurement.kwargs)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=None, help="total seconds (default 480; smoke 900)")
    parser.add_argument("--only", default=None, help="comma-separated measurement names, run in registry order")
    parser.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                        help="override one measurement's own limit (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints on the CPU: checks the code paths")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/"
                        "gpu_<device>.json; smoke: a temporary file)")
    parser.add_argument("--work", type=Path, default=None, help="folder for checkpoints and caches, kept between "
                        "runs (default: a temporary one, removed at the end)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.work, args.smoke)

    names = [m.name for m in REGISTRY]
    chosen = args.only.split(",") if args.only else names
    if any(not re.fullmatch(r"[\w.+-]+=\d+(\.\d*)?", item) for item in args.timeout):
        sys.exit(f"--timeout takes NAME=SECONDS (e.g. train_k5_plain=90); got {' '.join(args.timeout)}")
    caps = dict(item.split("=", 1) for item in args.timeout)
    unknown = sorted((set(chosen) | set(caps)) - set(names))
    if unknown:
        sys.exit(f"unknown measurement {', '.join(unknown)}: choose among {', '.join(names)}")
    from loraflow.training.checkpoints import write_json  # atomic: a run killed mid-write leaves the previous JSON

    device = device_name(args.smoke)
    out = args.out or (Path(tempfile.gettempdir()) / "gpu_cpu-smoke.json" if args.smoke else
                       ROOT / "benchmarks" / "results" / f"gpu_{re.sub(r'[^a-z0-9]+', '-', device.lower())}.json")
    budget = args.budget or (900.0 if args.smoke else 480.0)
    deadline = time.monotonic() + budget
    report: dict[str, Any] = {"device": device, "smoke": args.smoke, "budget_s": budget, "results": {}}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(1) as estimates:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:  # the estimates read the tiny configs; the children then find them built
            from loraflow.demo.tiny import build_tiny

            for family in {m.kwargs["family"] for m in REGISTRY if m.name in chosen and m.module == "train"}:
                build_tiny(family, work / family)
        for measurement in (m for m in REGISTRY if m.name in chosen):
            # on the CPU while the child measures: no GPU time
            estimating = estimates.submit(estimate_for, measurement, work, args.smoke)
            left = deadline - time.monotonic()
            cap = float(caps.get(measurement.name, SMOKE_CAP_S if args.smoke else measurement.cap_s))
            if left < 1:
                result: dict[str, Any] = {"status": "not run: budget spent"}
            else:
                result = run_one(measurement, min(cap, left), work, args.smoke)
            peak = report["results"].get("matmul_peak", {}).get("tflops")
            estimate = estimating.result()
            result.update(mfu=mfu(result, peak), estimate=estimate, measured_over_estimate=compared(result, estimate))
            report["results"][measurement.name] = result
            print(json.dumps({measurement.name: result}), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
