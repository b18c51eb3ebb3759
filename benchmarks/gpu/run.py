"""Every GPU measurement, in priority order, within one total time budget: the one entry point for a GPU machine.

Each measurement runs in a fresh subprocess (clean allocator, honest peak) with a timeout of what is left of the
budget, capped by the measurement's own limit, and the JSON is rewritten (atomically) after each one, so a run cut
off anywhere keeps what it measured. A measurement that runs past its timeout is recorded as `timeout`, one that
fails as `error` (its last stderr line); the next one starts while time is left. `--smoke` runs the same code on
the CPU with the tiny checkpoints (numbers meaningless): tests/test_gpu_entry.py runs it. There each measurement is
forked from a fork server that imported torch, diffusers and loraflow's stages once (`SMOKE_PRELOAD`: a new
interpreter spends more CPU time on those imports than a tiny measurement on its work); `--smoke --fresh` starts
new interpreters, as a GPU run always does.

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
import contextlib
import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]  # loraflow, and the measurement modules beside this file


@dataclass(frozen=True)
class Measurement:
    name: str
    module: str  # a module beside this file with measure(work: Path, smoke: bool, **kwargs) -> dict
    kwargs: dict[str, Any] = field(default_factory=dict)
    cap_s: float = 120.0  # its own limit on a GPU; the time left of the budget may give it less


K5_LITE = {"model": "k5-lite"}
REGISTRY: list[Measurement] = [  # issue 40's order: what is measured first survives a run cut short
    Measurement("matmul_peak", "matmul", cap_s=25),
    Measurement("vae_encode_hv15_256x73", "latents", {"size": (256, 256), "frames": 73}, cap_s=60),
    Measurement("vae_encode_hv15_768x81", "latents", {"size": (768, 768), "frames": 81}, cap_s=75),
    Measurement("train_k5_plain", "train", {**K5_LITE, "variant": "plain"}, cap_s=120),  # writes the checkpoint
    Measurement("train_k5_checkpointing", "train", {**K5_LITE, "variant": "checkpointing"}, cap_s=60),
    Measurement("train_k5_tread0.5", "train", {**K5_LITE, "variant": "checkpointing+tread0.5"}, cap_s=60),
    Measurement("train_hv15_720p_fp8", "train", {"model": "hv15-720p", "variant": "checkpointing+fp8"}, cap_s=150),
    Measurement("render_hv15_720p", "render", {"model": "hv15-720p", "size": (720, 1280), "frames": 121},
                cap_s=150),
    Measurement("train_k5_pro_fp8", "train", {"model": "k5-pro", "variant": "checkpointing+fp8"}, cap_s=180),
    Measurement("latents_stage_hv15_768x81", "latents", {"size": (768, 768), "frames": 81, "clips": 6}, cap_s=120),
    Measurement("train_resume", "resume", cap_s=120),
    Measurement("train_k5_fp8", "train", {**K5_LITE, "variant": "checkpointing+fp8"}),
    Measurement("train_k5_offload_streams", "train", {**K5_LITE, "variant": "checkpointing+offload"}),
    Measurement("train_hv15_checkpointing", "train", {"model": "hv15-480p", "variant": "checkpointing"}, cap_s=240),
    Measurement("vae_hv15_720p", "vae", {"vae": "hv15", "size": (720, 1280), "frames": 121,
                                         "modes": ("stock", "patch")}, cap_s=180),
    Measurement("vae_flux_1024", "vae", {"vae": "flux", "size": (1024, 1024), "frames": 1, "modes": ("stock",)},
                cap_s=60),
    Measurement("offload_startup", "offload", cap_s=120),
]
ESTIMATES = ROOT / "benchmarks" / "results" / "gpu_estimates.json"  # run.py --estimate-only
SMOKE_CAP_S = 600.0  # per measurement on a CPU: the tiny models need seconds, a loaded shared CPU minutes
# what the smoke's fork server imports before it forks a measurement ("__main__": this file, which puts the measurement
# modules beside it on sys.path): torch, diffusers' models, and loraflow's stages (transformers, peft, pyarrow, av)
SMOKE_PRELOAD = ["__main__", "torch", "diffusers.models.modeling_utils", "loraflow.demo.tiny", "loraflow.training.loop",
                 "loraflow.stages.clips.clips", "loraflow.stages.latents.latents", "loraflow.stages.text.text_embeds"]
PROGRESS = re.compile(r"\d+%\|.*\||\d+/\d+ \[")  # a tqdm line: "clips:   0%|          | 0/6 [00:00<?, ?clip/s]"


def estimate_for(measurement: Measurement, work: Path, smoke: bool) -> dict | None:
    """loraflow/estimates' numbers for a measurement (its module's `estimate`: the same config and sizes on fake
    tensors, on the CPU); None where the module has none. Its keys beside the measured ones (`peak_allocated_gib`,
    `flops_per_step`, ...) are compared by `compared`; a failed estimate records its error and the run goes on."""
    module = importlib.import_module(measurement.module)
    if not hasattr(module, "estimate"):
        return None
    try:
        return module.estimate(work, smoke, **measurement.kwargs)
    except Exception as exc:  # noqa: BLE001 - an estimate must not cost the measurements after it
        return {"error": f"{type(exc).__name__}: {exc}"}


def compared(result: dict[str, Any], estimate: dict[str, Any] | None) -> dict[str, float]:
    """measured / estimated for each number both have (1.0: the estimate was exact)."""
    if estimate is None:
        return {}
    both = [k for k, v in estimate.items() if isinstance(v, (int, float)) and isinstance(result.get(k), (int, float))]
    return {k: round(result[k] / estimate[k], 3) for k in both if estimate[k]}


def write_estimates(path: Path, measurements: list[Measurement], smoke: bool, write_json: Any) -> None:
    """Every measurement's estimate, computed here on the CPU (fake tensors: minutes at released size) so that a GPU
    run spends none of its time on them; the commit they were made on beside them."""
    from benchmarks import record

    report: dict[str, Any] = {"commit": record.commit(), "smoke": smoke, "estimates": {}}
    with tempfile.TemporaryDirectory() as work:
        if smoke:
            build_smoke_models(Path(work), measurements)
        for measurement in measurements:
            began = time.perf_counter()
            estimate = estimate_for(measurement, Path(work), smoke)
            if estimate is not None:
                report["estimates"][measurement.name] = estimate
                print(f"{measurement.name}: {time.perf_counter() - began:.0f} s {json.dumps(estimate)}", flush=True)
                write_json(path, report)
    print(f"wrote {path}")


def build_smoke_models(work: Path, measurements: list[Measurement]) -> None:
    """The tiny checkpoints the smoke estimates read (their configs); the children then find them built."""
    from train import MODELS

    from loraflow.demo.tiny import build_tiny

    for family in {MODELS[m.kwargs["model"]]["family"] for m in measurements if m.module in ("train", "render")}:
        build_tiny(family, work / family)


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


def run_one(measurement: Measurement, timeout: float, work: Path, smoke: bool,
            forks: ForkServer | None = None) -> dict[str, Any]:
    """The measurement in a process of its own (a new interpreter, or forked by the smoke's fork server); its result,
    or why there is none."""
    began = time.perf_counter()
    if forks is None:
        returncode, stdout, stderr = in_new_interpreter(measurement.name, timeout, work, smoke)
    else:
        returncode, stdout, stderr = forks.run(measurement.name, timeout, work)
    seconds = round(time.perf_counter() - began, 1)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if returncode is None:  # killed by its timeout
        # a measurement of several parts prints a RESULT after each: what it finished is kept
        partial = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {}
        return {"status": "timeout", "timeout_s": round(timeout, 1), **partial}
    if returncode or not lines:
        # the last line that is not a progress bar (tqdm redraws with carriage returns and ends on '|' or ']')
        said = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and not PROGRESS.search(ln)]
        last = said[-1:] or stderr.strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "error": f"exit {returncode}: {last[0]}", "wall_s": seconds}
    return {"status": "ok", "wall_s": seconds, **json.loads(lines[-1].removeprefix("RESULT "))}


def in_new_interpreter(name: str, timeout: float, work: Path, smoke: bool) -> tuple[int | None, str, str]:
    """`run.py --child NAME`, as a GPU run starts every measurement: exit status (None: killed by the timeout),
    stdout, stderr."""
    argv = [sys.executable, __file__, "--child", name, "--work", str(work)] + (["--smoke"] if smoke else [])
    # its own process group: a timeout kills what it started too (train_main, media workers)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        return None, *process.communicate()
    return process.returncode, stdout, stderr


def kill_session(pid: int) -> None:
    """SIGKILL the session `pid` leads: the measurement and what it started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # a forked child before its setsid (nothing of its own started yet), or just ended
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ForkServer:
    """`--smoke`: each measurement forked from multiprocessing's fork server, a process that imported SMOKE_PRELOAD
    and did nothing else (no tensor, thread, allocator or accelerator state for a child to inherit), instead of a new
    interpreter importing them again. The child runs what `--child` runs (`child`), in a session of its own, its
    stdout and stderr in files here; it dies with run.py as `--child` does."""

    def __init__(self) -> None:
        self.logs = tempfile.TemporaryDirectory(prefix="gpu-smoke-logs-")  # removed when run.py ends
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(SMOKE_PRELOAD)
        multiprocessing.forkserver.ensure_running()  # it imports while run.py does its own imports

    def run(self, name: str, timeout: float, work: Path) -> tuple[int | None, str, str]:
        """Exit status (None: killed by the timeout), stdout, stderr."""
        stdout, stderr = (Path(self.logs.name) / f"{name}.{stream}" for stream in ("stdout", "stderr"))
        for path in (stdout, stderr):
            path.write_text("")
        process = self.context.Process(target=forked_child, args=(name, work, stdout, stderr), name=name)
        process.start()
        process.join(timeout)
        returncode = process.exitcode
        if returncode is None:
            kill_session(process.pid)
            process.join()
        return returncode, stdout.read_text(), stderr.read_text()


def forked_child(name: str, work: Path, stdout: Path, stderr: Path) -> None:
    """What the smoke's fork server runs in a forked child: `child`, set up as `in_new_interpreter` sets it up."""
    os.setsid()  # what start_new_session does for a new interpreter
    # die with run.py: its end of the pipe that sent this child's arguments closes only when run.py is gone
    threading.Thread(target=lambda: (multiprocessing.parent_process().join(), os.killpg(0, signal.SIGKILL)),
                     daemon=True).start()
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    child(name, work, smoke=True)


def child(name: str, work: Path, smoke: bool) -> None:
    from loraflow.lifetime import die_with_parent

    die_with_parent()  # in a session of its own: a killed run.py must not leave it holding the GPU
    # what it starts (train_main) imports this checkout's loraflow too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    (measurement,) = [m for m in REGISTRY if m.name == name]
    for result in parts(importlib.import_module(measurement.module).measure(work, smoke, **measurement.kwargs)):
        print("RESULT " + json.dumps(result), flush=True)


def parts(result: dict[str, Any] | Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A measurement's result, or each of the growing results a measurement of several parts yields."""
    yield from [result] if isinstance(result, dict) else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=None, help="total seconds (default 480; smoke 900)")
    parser.add_argument("--only", default=None, help="comma-separated measurement names, run in registry order")
    parser.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                        help="override one measurement's own limit (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints on the CPU: checks the code paths")
    parser.add_argument("--fresh", action="store_true", help="smoke: start each measurement in a new interpreter, as "
                        "a GPU run does (default: forked from a process that imported torch and diffusers once)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/"
                        "gpu_<device>.json; smoke: a temporary file)")
    parser.add_argument("--work", type=Path, default=None, help="folder for checkpoints and caches, kept between "
                        "runs (default: a temporary one, removed at the end)")
    parser.add_argument("--estimates", type=Path, default=ESTIMATES,
                        help="the estimates written by --estimate-only (on the CPU, before a GPU run), used where "
                        "they name a measurement; the others are computed beside the measurement")
    parser.add_argument("--estimate-only", action="store_true",
                        help="write loraflow's estimate of each chosen measurement to --estimates and stop (no GPU)")
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
    forks = ForkServer() if args.smoke and not (args.fresh or args.estimate_only) else None
    from loraflow.training.checkpoints import write_json  # atomic: a run killed mid-write leaves the previous JSON

    if args.estimate_only:
        return write_estimates(args.estimates, [m for m in REGISTRY if m.name in chosen], args.smoke, write_json)
    from benchmarks import record

    made = json.loads(args.estimates.read_text()) if args.estimates.is_file() and not args.smoke else {}
    ready = made.get("estimates", {})
    device = device_name(args.smoke)
    out = args.out or (Path(tempfile.gettempdir()) / "gpu_cpu-smoke.json" if args.smoke else
                       ROOT / "benchmarks" / "results" / f"gpu_{re.sub(r'[^a-z0-9]+', '-', device.lower())}.json")
    budget = args.budget or (900.0 if args.smoke else 480.0)
    deadline = time.monotonic() + budget
    # a lent machine's copy of the tree has no git: the estimates' commit (made here) names the code then
    report: dict[str, Any] = {"commit": record.commit(), "estimates_commit": made.get("commit", "unknown"),
                              "device": device, "smoke": args.smoke, "budget_s": budget, "results": {}}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(1) as estimates:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            build_smoke_models(work, [m for m in REGISTRY if m.name in chosen])
        for measurement in (m for m in REGISTRY if m.name in chosen):
            # on the CPU while the child measures: no GPU time
            estimating = estimates.submit(lambda m=measurement: ready.get(m.name) or estimate_for(m, work, args.smoke))
            left = deadline - time.monotonic()
            cap = float(caps.get(measurement.name, SMOKE_CAP_S if args.smoke else measurement.cap_s))
            if left < 1:
                result: dict[str, Any] = {"status": "not run: budget spent"}
            else:
                result = run_one(measurement, min(cap, left), work, args.smoke, forks)
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
