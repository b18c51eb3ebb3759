"""GPU benchmark: peak memory and seconds of a real-size Hunyuan VAE encode, stock vs patch conv vs tiling.

Real-size = the diffusers default config of each class (the released architecture) with random
weights, bf16, on CUDA. Peak = torch.cuda.max_memory_allocated during the encode minus what was
allocated before it (weights, input). A config that runs out of memory is recorded as "oom".

Modes
  stock        diffusers defaults (HV: use_framewise_encoding=True -> approximate temporal tiles > 16 frames)
  stock_full   HV only: framewise encoding off, i.e. the exact whole-clip encode
  patch        enable_patch_conv(vae) (+ HV framewise off): exact, compared against stock_full/stock
  patch_framewise  HV only: patch conv inside diffusers' (approximate) temporal tiles
  tiling       vae.enable_tiling(...) (diffusers spatial tiles, HV also temporal; approximate)
  patch_tiling both
A full run is long (stock configs at 720p mostly end in OOM, which is quick); split it with
--vaes / --sizes / --frames / --modes when a command has a time limit.

    python benchmarks/gpu_vae.py                       # everything -> benchmarks/results/vae_gpu.json
    python benchmarks/gpu_vae.py --vaes hv15 --sizes 720x1280 --frames 121 --modes patch
    python benchmarks/gpu_vae.py --smoke               # tiny configs, CPU ok, writes to a temp file
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraflow.kernels.patch_conv import disable_patch_conv, enable_patch_conv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vae_gpu.json"
TINY = {
    "hv": dict(block_out_channels=(8, 16, 32, 32), norm_num_groups=4, latent_channels=4, layers_per_block=1),
    "hv15": dict(block_out_channels=(8, 16, 32, 64, 64), latent_channels=4, layers_per_block=1),
}


def build(name: str, device: torch.device, dtype: torch.dtype, smoke: bool) -> torch.nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15

    cls = {"hv": AutoencoderKLHunyuanVideo, "hv15": AutoencoderKLHunyuanVideo15}[name]
    torch.manual_seed(0)
    with torch.device(device):
        vae = cls(**(TINY[name] if smoke else {}))
    vae.decoder = None  # encode only; frees ~half the weights
    return vae.to(dtype=dtype).eval()


def configure(vae: torch.nn.Module, name: str, mode: str, budget: int, tile: int) -> None:
    disable_patch_conv(vae)
    vae.use_tiling = False
    if name == "hv":
        vae.use_framewise_encoding = mode not in ("stock_full", "patch")
    if "patch" in mode:
        enable_patch_conv(vae, max_slab_bytes=budget)
    if "tiling" in mode:
        lat = tile // vae.spatial_compression_ratio
        if name == "hv15":  # the latent tile size must be passed too, it is not derived
            vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_latent_min_height=lat, tile_latent_min_width=lat)
        else:
            vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                              tile_sample_stride_height=tile * 3 // 4, tile_sample_stride_width=tile * 3 // 4)


def measure(vae: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float, float | None, float | None]:
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.no_grad():
        latent = vae.encode(x).latent_dist.mode()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    return latent.float().cpu(), seconds, peak, reserved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny configs and sizes; runs on CPU")
    ap.add_argument("--vaes", default="hv15,hv")
    ap.add_argument("--sizes", default="480x848,720x1280", help="comma-separated HxW")
    ap.add_argument("--frames", default="61,121")
    ap.add_argument("--modes", default="stock,stock_full,patch,patch_framewise,tiling,patch_tiling")
    ap.add_argument("--budget-mb", type=int, default=256, help="max_slab_bytes for patch modes, MiB")
    ap.add_argument("--tile", type=int, default=256, help="sample-space tile size for the tiling modes (diffusers default 256)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        sys.exit("needs CUDA (use --smoke for the CPU smoke path)")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    budget = args.budget_mb * 2**20
    if args.smoke:  # small enough to run anywhere, small budget/tiles so every code path is taken
        args.sizes, args.frames, args.tile, budget = "64x96", "5,9,17", 64, 4096
    out_path = args.out or (Path(tempfile.gettempdir()) / "vae_gpu_smoke.json" if args.smoke else RESULTS)

    runs: list[dict] = []
    for name in args.vaes.split(","):
        vae = build(name, device, dtype, args.smoke)
        weights_gib = sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**30
        for size in args.sizes.split(","):
            height, width = map(int, size.split("x"))
            for frames in map(int, args.frames.split(",")):
                torch.manual_seed(1)
                x = (torch.rand(1, 3, frames, height, width, device=device) * 2 - 1).to(dtype)  # (B, C, T, H, W)
                exact = None  # latent of the exact whole-clip encode, when one succeeded
                def is_exact(mode: str) -> bool:  # whole-clip, untiled encodes
                    return mode in ("stock_full", "patch") or (mode == "stock" and name == "hv15")

                # exact modes first, so the approximate ones can be compared against them
                for mode in sorted(args.modes.split(","), key=lambda m: not is_exact(m)):
                    if mode in ("stock_full", "patch_framewise") and name != "hv":
                        continue
                    configure(vae, name, mode, budget, args.tile)
                    row = {"vae": type(vae).__name__, "mode": mode, "frames": frames, "height": height, "width": width,
                           "dtype": str(dtype), "weights_gib": round(weights_gib, 2)}
                    try:
                        latent, seconds, peak, reserved = measure(vae, x)
                        row.update(seconds=round(seconds, 2), latent=list(latent.shape),
                                   peak_gib=None if peak is None else round(peak, 2),
                                   max_reserved_gib=None if reserved is None else round(reserved, 2))
                        if exact is None and is_exact(mode):
                            exact = latent
                        elif exact is not None:
                            row["max_abs_diff_vs_exact"] = (latent - exact).abs().max().item()
                    except torch.OutOfMemoryError:
                        row["result"] = "oom"
                    finally:
                        gc.collect()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    print(json.dumps(row), flush=True)
                    runs.append(row)
                del x
        del vae
        gc.collect()

    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    # Merge with an earlier (partial) run in the same file: rows of the same config are replaced.
    key = lambda r: (r["vae"], r["mode"], r["frames"], r["height"], r["width"], r.get("max_slab_bytes"), r.get("tile"))  # noqa: E731
    for r in runs:
        r.update(max_slab_bytes=budget if "patch" in r["mode"] else None, tile=args.tile if "tiling" in r["mode"] else None)
    if out_path.exists():
        fresh = {key(r) for r in runs}
        runs = [r for r in json.loads(out_path.read_text())["runs"] if key(r) not in fresh] + runs
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"info": info, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
