"""The tiny world's VAE reconstructs the demo world measurably, and loads back through the real `from_pretrained`."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo

from loraflow.ops.demo_data import world_frames
from loraflow.pipelines.tiny_world import (
    VaeRecipe, decode_frames, psnr, shape_centroid, to_pixels, untrained_vae, world_vae,
)

# A shorter recipe than the demo's (about a minute on one core). Measured on 32 held-out frames: the random VAE puts
# the shape 10.5 px (mean) from where it is, up to 41 px; this one 0.9 px, up to 2.8 px; PSNR 8.3 -> 10.4 dB.
SHORT = replace(VaeRecipe(), steps=300)
MAX_SHIFT_PX = 4.0  # where the shape is survives the round trip: what a motion concept is scored by
MIN_GAIN_DB = 1.0  # colours only partly: backgrounds drift towards the world's mean colour


def _centroid_errors(vae: AutoencoderKLHunyuanVideo, frames: np.ndarray) -> np.ndarray:
    pairs = zip(frames, decode_frames(vae, frames))
    return np.array([np.hypot(*np.subtract(shape_centroid(a), shape_centroid(b))) for a, b in pairs])


def test_world_vae_carries_the_shape_and_is_built_once(tmp_path: Path) -> None:
    folder = world_vae(SHORT, tmp_path)
    vae = AutoencoderKLHunyuanVideo.from_pretrained(folder).eval()
    random = untrained_vae(SHORT).eval()
    held_out = world_frames(seed=1, count=32, size=64)  # another seed: frames it never trained on

    assert _centroid_errors(vae, held_out).max() < MAX_SHIFT_PX
    assert _centroid_errors(random, held_out).mean() > 2 * MAX_SHIFT_PX  # the measure can tell them apart
    assert psnr(vae, held_out) > psnr(random, held_out) + MIN_GAIN_DB

    with torch.no_grad():  # the scaling factor makes the pipeline's latents unit-variance, as its noise is
        scaled = vae.encode(to_pixels(held_out)).latent_dist.mode() * vae.config.scaling_factor
    assert 0.7 < scaled.std().item() < 1.4, scaled.std().item()

    stamp = os.stat(folder / "diffusion_pytorch_model.safetensors").st_mtime_ns
    assert world_vae(SHORT, tmp_path) == folder  # cached: the second call trains nothing
    assert os.stat(folder / "diffusion_pytorch_model.safetensors").st_mtime_ns == stamp
    assert len({SHORT.key(), replace(SHORT, seed=1).key(), replace(SHORT, steps=301).key()}) == 3


def test_shape_centroid_finds_the_drawn_shape() -> None:
    frame = np.zeros((64, 96, 3), np.uint8)
    frame[10:20, 60:70] = (220, 40, 40)
    assert np.allclose(shape_centroid(frame), (64.5, 14.5))
