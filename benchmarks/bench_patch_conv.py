"""CPU benchmark: peak memory and time of a real-size Hunyuan VAE encode with and without patch conv.

Real-size means the diffusers default config of each class (the shipped architectures), with
random weights, fp32, at a small resolution so that it runs on a laptop-class CPU.

Every measurement runs in a fresh subprocess so that allocator state cannot leak between runs.
Peak memory = VmHWM after the encode minus VmRSS just before it (the kernel's high-water mark is
reset through /proc/self/clear_refs first), with glibc's mmap threshold pinned low so large tensors
are returned to the OS on free and the RSS really tracks live tensors.

    .venv/bin/python benchmarks/bench_patch_conv.py            # writes benchmarks/results/patch_conv_cpu.json
    .venv/bin/python benchmarks/bench_patch_conv.py --frames 9 --size 64x64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("patch_conv_cpu.json")
# --quick: HunyuanVideo 1.5's VAE at a quarter of its widths (the released one's random init alone takes a minute)
SMALL_HV15 = {"block_out_channels": (32, 64, 128, 256, 256)}


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _child(
    vae_name: str, mode: str, frames: int, height: int, width: int, budget_mb: int, dtype: str, latent_path: str
) -> dict:
    import torch
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15

    sys.path.insert(0, str(ROOT))
    from loraflow.kernels.patch_conv import enable_patch_conv

    torch.manual_seed(0)
    cls, settings = {"hv": (AutoencoderKLHunyuanVideo, {}), "hv15": (AutoencoderKLHunyuanVideo15, {}),
                     "hv15-small": (AutoencoderKLHunyuanVideo15, SMALL_HV15)}[vae_name]
    vae = cls(**settings).to(getattr(torch, dtype)).eval()  # default config == the released architecture
    vae.decoder = None  # encode never touches it; keeps the baseline RSS small
    if vae_name == "hv":
        vae.use_framewise_encoding = False  # whole-clip encode: the exact path we compare against
    patched = enable_patch_conv(vae, max_slab_bytes=budget_mb * 2**20) if mode == "patch" else 0
    x = torch.randn(1, 3, frames, height, width, dtype=getattr(torch, dtype))  # (B, C, T, H, W)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    base = _status_mb("VmRSS")
    load = os.getloadavg()[0]  # other processes on the box make `seconds` noisy; record how busy it was
    t0 = time.perf_counter()
    with torch.no_grad():
        latent = vae.encode(x).latent_dist.mode()
    seconds = time.perf_counter() - t0
    peak = _status_mb("VmHWM")
    torch.save(latent, latent_path)
    return {
        "vae": cls.__name__,
        "mode": mode,
        "patched_modules": patched,
        "input": [1, 3, frames, height, width],
        "dtype": dtype,
        "latent": list(latent.shape),
        "seconds": round(seconds, 2),
        "loadavg_1min_at_start": round(load, 2),
        "peak_mb": round(peak - base, 1),
        "max_slab_mb": budget_mb if mode == "patch" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", default="17", help="comma-separated frame counts (4k+1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--size", default="128x128", help="HxW")
    ap.add_argument("--budgets-mb", default="256,32", help="max_slab_bytes values to try, MiB (256 = default)")
    ap.add_argument("--vaes", default="hv15,hv")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", nargs=8, metavar=("VAE", "MODE", "T", "H", "W", "BUDGET", "DTYPE", "LATENT"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="HunyuanVideo 1.5's VAE at a quarter width, 5x64x64")
    args = ap.parse_args()
    if args.quick:
        args.frames, args.size, args.budgets_mb, args.vaes = "5", "64x64", "1", "hv15-small"
    if args.child:
        v, m, t, h, w, b, dt, lp = args.child
        print(json.dumps(_child(v, m, int(t), int(h), int(w), int(b), dt, lp)))
        return

    import torch

    height, width = map(int, args.size.lower().split("x"))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")

    runs, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for vae_name, frames in [(v, int(f)) for v in args.vaes.split(",") for f in args.frames.split(",")]:
            stock = None
            for mode, budget in [("stock", 0)] + [("patch", int(b)) for b in args.budgets_mb.split(",")]:
                lp = os.path.join(tmp, f"{vae_name}_{mode}_{budget}.pt")
                cmd = [sys.executable, __file__, "--child", vae_name, mode, str(frames), str(height), str(width),
                       str(budget), args.dtype, lp]
                proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                if stock is None:
                    stock, stock_latent = res, torch.load(lp)
                else:
                    res["max_abs_diff_vs_stock"] = (torch.load(lp) - stock_latent).abs().max().item()
                    res["peak_ratio_vs_stock"] = round(res["peak_mb"] / stock["peak_mb"], 3)
                    res["time_ratio_vs_stock"] = round(res["seconds"] / stock["seconds"], 3)
                    summary[f"{res['vae']} T={frames} max_slab={budget}MiB"] = {
                        k: res[k] for k in ("peak_ratio_vs_stock", "time_ratio_vs_stock", "max_abs_diff_vs_stock")
                    }
                print(json.dumps(res), flush=True)
                runs.append(res)

    out = {
        "what": f"peak RSS delta (MiB) and seconds of vae.encode(x).latent_dist.mode(); {args.dtype}, CPU, "
        "random weights, "
        "diffusers default (= released) configs, HV with use_framewise_encoding=False",
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "note": "peak_mb is per-process and robust; seconds are wall time and inflate when loadavg exceeds "
        "the cpu count",
        "runs": runs,
        "summary": summary,
    }
    record.write(args.out, out, quick=args.quick)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
