"""Peak memory and seconds of a real-size VAE encode (HunyuanVideo, HunyuanVideo 1.5: stock vs exact patch conv vs
tiling; Flux, Kandinsky 5 Image's 2D VAE: stock, one image).

Real-size = the diffusers default config of each class (the released architecture; Flux: its released config in
loraflow/pipelines/released/flux.vae.json) with random weights, bf16, on CUDA. Peak = torch.cuda.max_memory_allocated
during the encode minus what was allocated before it (weights, input). A mode that runs out of memory is recorded as
"oom". Exact modes run first: the others record their max abs difference from the first exact latent; every mode records
its latent's largest magnitude (`max_abs`), the scale of that difference.

Modes
  stock        diffusers defaults (HV: use_framewise_encoding=True -> approximate temporal tiles > 16 frames)
  stock_full   HV only: framewise encoding off, i.e. the exact whole-clip encode
  patch        enable_patch_conv(vae) (+ HV framewise off): exact, compared against stock_full/stock
  patch_framewise  HV only: patch conv inside diffusers' (approximate) temporal tiles
  tiling       vae.enable_tiling(...) (diffusers spatial tiles, HV also temporal; approximate)
  patch_tiling both
run.py picks the VAE, size, frames and modes of each measurement; `--smoke` runs tiny configs at 64x96 x 9 frames
in fp32 on the CPU, with 64 KiB slabs and 64-pixel tiles so every code path is taken.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from loraflow.kernels.patch_conv import disable_patch_conv, enable_patch_conv

TINY = {
    "hv": dict(block_out_channels=(8, 16, 32, 32), norm_num_groups=4, latent_channels=4, layers_per_block=1),
    "hv15": dict(block_out_channels=(8, 16, 32, 64, 64), latent_channels=4, layers_per_block=1),
    "flux": dict(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4, layers_per_block=1,
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
}


def flux_config(smoke: bool) -> dict[str, Any]:
    from loraflow.pipelines.released import released_config

    config = released_config("t2i-lite-sft", "vae")
    return config | TINY["flux"] if smoke else config


def build(name: str, device: torch.device, dtype: torch.dtype, smoke: bool) -> torch.nn.Module:
    from diffusers import AutoencoderKL, AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    with torch.device(device):
        if name == "flux":
            vae = AutoencoderKL.from_config(flux_config(smoke))
        else:
            cls = {"hv": AutoencoderKLHunyuanVideo, "hv15": AutoencoderKLHunyuanVideo15}[name]
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
            vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                              tile_latent_min_height=lat, tile_latent_min_width=lat)
        else:
            vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                              tile_sample_stride_height=tile * 3 // 4, tile_sample_stride_width=tile * 3 // 4)


def encode(vae: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float, float | None, float | None]:
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


def measure(work: Path, smoke: bool, vae: str, size: tuple[int, int], frames: int, modes: tuple[str, ...],
            slab_mib: int = 256, tile: int = 256) -> dict[str, Any]:
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    budget = slab_mib * 2**20
    if smoke:
        size, frames, tile, budget = (64, 96), 9, 64, 2**16
    model = build(vae, device, dtype, smoke)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    torch.manual_seed(1)
    x = (torch.rand(1, 3, frames, *size, device=device) * 2 - 1).to(dtype)  # (B, C, T, H, W)
    if vae == "flux":  # a 2D VAE: one image (B, C, H, W)
        x, frames = x[:, :, 0], 1
    rows, exact = [], None  # exact: the latent of the first exact whole-clip encode that succeeded

    def is_exact(mode: str) -> bool:  # whole-clip, untiled encodes
        return mode in ("stock_full", "patch") or (mode == "stock" and vae in ("hv15", "flux"))

    for mode in sorted(modes, key=lambda m: not is_exact(m)):
        configure(model, vae, mode, budget, tile)
        row: dict[str, Any] = {"mode": mode, "max_slab_bytes": budget if "patch" in mode else None,
                               "tile": tile if "tiling" in mode else None}
        try:
            latent, seconds, peak, reserved = encode(model, x)
            row.update(seconds=round(seconds, 2), latent=list(latent.shape), max_abs=latent.abs().max().item(),
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
        rows.append(row)
    return {"vae": type(model).__name__, "frames": frames, "height": size[0], "width": size[1], "dtype": str(dtype),
            "weights_gib": round(weights_gib, 2), "modes": rows}
