"""HunyuanVideo 1.5's VAE encode as the latents stage runs it: peak memory and seconds beside loraflow's estimate.

The VAE is its released config (loraflow/pipelines/released/hv15.vae.json) with random weights, in fp32 with exact
patch conv (`vae_enable_patch_conv: true`), prepared by the stage's own `prepare_vae` and called through the
family's `vae_encode` (uint8 frames in, the scaled latent out), as `encode_latents` does.
- one clip (`clips` 0): a random clip of `frames` x `size` on the GPU, one no-grad encode; `peak_allocated_gib` is
  torch.cuda.max_memory_allocated over the weights, the clip and the encode, beside `estimates.vae_encode` (the
  latents row of `loraflow check`);
- the stage (`clips` N): N clips of that size written as mp4 (x264) with captions, then `build_clips` and
  `encode_latents` from an empty cache, timed apart (SimpleTuner users report more than 10 minutes for a few
  768x768x81 clips on an H100): the model folder is the tiny HunyuanVideo 1.5's with the released-size VAE in it
  (only the VAE runs in this stage).
`--smoke`: the tiny VAE config at 64x96, 9 frames, on the CPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

HV15 = "hunyuanvideo-1.5"
TINY_VAE = {"block_out_channels": (8, 16, 32, 64, 64), "latent_channels": 4, "layers_per_block": 1}
SMOKE = {"size": (64, 96), "frames": 9}


def vae_config(smoke: bool) -> dict[str, Any]:
    from loraflow.pipelines.released import released_config

    config = released_config("t2v-720p", "vae")
    return {**config, **TINY_VAE} if smoke else config


def stage_config(folder: Path, data: Path, cache: Path, size: int, frames: int) -> Any:
    from loraflow.config import parse_config

    return parse_config({
        "model_family": HV15, "model_flavour": "t2v-720p", "pretrained_model_name_or_path": str(folder),
        "output_dir": str(cache.parent / "output"), "cache_dir": str(cache), "vae_enable_patch_conv": True,
        "datasets": [{"id": "clips", "instance_data_dir": str(data), "caption_strategy": "textfile",
                      "resolution": size, "resolution_type": "pixel_area",
                      "video": {"num_frames": frames, "min_frames": frames}}]})


def measure(work: Path, smoke: bool, size: tuple[int, int], frames: int, clips: int = 0) -> dict[str, Any]:
    if smoke:
        size, frames = SMOKE["size"], SMOKE["frames"]
    return stage(work, smoke, size, frames, clips) if clips else one_clip(smoke, size, frames)


def one_clip(smoke: bool, size: tuple[int, int], frames: int) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    from loraflow.pipelines import get_family
    from loraflow.stages.latents.latents import prepare_vae

    device = torch.device("cpu" if smoke else "cuda")
    config = stage_config(Path("unused-model"), Path("unused-data"), Path("unused/cache"), max(size), frames)
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo15.from_config(vae_config(smoke)).eval()
    family = get_family(config)
    prepare_vae(vae, config, family)
    clip = torch.randint(0, 256, (1, frames, *size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    clip = clip.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    with torch.no_grad():
        latent = family.vae_encode(vae, clip, config.latent_sampling)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"height": size[0], "width": size[1], "frames": frames, "dtype": "float32", "patch_conv": True,
            "latent": list(latent.shape), "seconds": round(seconds, 2),
            "peak_allocated_gib": None if peak is None else round(peak, 2),
            "weights_gib": round(sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**30, 3)}


def estimate(work: Path, smoke: bool, size: tuple[int, int], frames: int, clips: int = 0) -> dict[str, Any]:
    """`loraflow check`'s latents row for one clip of this size (`estimates.vae_encode`, fake tensors)."""
    from loraflow import estimates
    from loraflow.pipelines import get_family

    if smoke:
        size, frames = SMOKE["size"], SMOKE["frames"]
    config = stage_config(Path("unused-model"), Path("unused-data"), Path("unused/cache"), max(size), frames)
    row = estimates.vae_encode(config, get_family(config), vae_config(smoke), frames, *size, "cuda")
    return {"peak_allocated_gib": round(row.peak_gib, 3),
            "parts_gib": {k: round(v / 2**30, 3) for k, v in row.parts.items()}, "per_clip": True}


def write_clips(data: Path, n: int, size: tuple[int, int], frames: int) -> None:
    """n clips of a bright square drifting over noise, mp4 (x264, 24 fps), each with its caption file."""
    import numpy as np

    from loraflow.media.writers import write_media

    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    height, width = size
    for i in range(n):
        video = rng.integers(0, 64, (frames, height, width, 3), dtype=np.uint8)
        for t in range(frames):
            x = (t * 4 + i * 40) % (width - 64)
            video[t, height // 3: height // 3 + 64, x: x + 64] = 230
        write_media(video, data / f"clip_{i:02d}", 24.0)
        (data / f"clip_{i:02d}.txt").write_text(f"a bright square drifting right, clip {i}")


def stage(work: Path, smoke: bool, size: tuple[int, int], frames: int, clips: int) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    from loraflow.demo.tiny import build_tiny
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.store import Store

    # the stage refuses output under system folders such as /dev: device.sh's work folder may be /dev/shm
    root = (work if not str(work.resolve()).startswith("/dev/") else Path(tempfile.mkdtemp())) / "latents-stage"
    shutil.rmtree(root, ignore_errors=True)
    folder, data = root / "model", root / "data"
    build_tiny(HV15, folder)
    if not smoke:  # the released-size VAE in the tiny folder (random weights, fp32 as the stage loads it)
        shutil.rmtree(folder / "vae")
        with torch.device("cuda"):
            AutoencoderKLHunyuanVideo15.from_config(vae_config(False)).save_pretrained(folder / "vae")
        torch.cuda.empty_cache()
    began = time.perf_counter()
    write_clips(data, clips, size, frames)
    written = time.perf_counter() - began
    config = stage_config(folder, data, root / "cache", max(size), frames)
    family, model, store = get_family(config), model_source(config), Store(config.cache_dir)
    if torch.cuda.is_available() and not smoke:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    build_clips(config, family, model, store)
    clipped = time.perf_counter() - began
    began = time.perf_counter()
    report = encode_latents(config, family, model, store)
    encoded = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and not smoke else None
    return {"clips": clips, "height": size[0], "width": size[1], "frames": frames, "computed": report.computed,
            "write_clips_s": round(written, 1), "clips_stage_s": round(clipped, 1),
            "latents_stage_s": round(encoded, 1), "peak_allocated_gib": None if peak is None else round(peak, 2),
            "note": json.dumps({"vae": "released config, random weights, fp32, patch conv"})}
