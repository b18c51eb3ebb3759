"""The tiny world: a tiny Kandinsky 5 Video VAE trained to reconstruct the demo's frames, cached once per config.

A random tiny VAE decodes any latent to coloured noise, so renders and LoRAs cannot be told apart by eye or by test.
This VAE is the real `AutoencoderKLHunyuanVideo` class, trained briefly as a plain autoencoder on single frames of the
demo world (`loraflow.ops.demo_data.world_frames`): its space is per-frame (the causal temporal convs see a lone frame
padded with copies of itself), so single frames teach it the pixels it must carry. It is written with
`save_pretrained` under `.loraflow/tiny_world/<key>/vae`, keyed by its config, training recipe and seed, and read
back with `from_pretrained`.

What it carries (tests/pipelines/test_tiny_world.py): where the shape is, to about a pixel, as a blob near its
colour; not the colours of flat backgrounds, which drift towards the world's mean colour (longer training did not
help: PSNR ~10 dB at 400 and 800 steps). Why: GroupNorm over a spatially constant map keeps only its normalised
pattern, not its level; after 300 steps the 8 flat colours of the world encode to just 2 distinct latents. So the
concept a LoRA is scored on should be motion or position, not hue (or every frame needs a fixed reference pattern).
Not yet used by `build_tiny`: the tiny checkpoints still carry the random `tiny.hunyuan_video_vae`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo

from loraflow.keys import content_key

CACHE_ROOT = Path(".loraflow") / "tiny_world"
_VERSION = 1  # bump when the recipe's code changes in a way its fields do not show


@dataclass(frozen=True)
class VaeRecipe:
    """How the world VAE is built. One GroupNorm group: with 2 channels a group (the random tiny VAE's 8 channels in
    4 groups), normalising removes the colour of a flat frame; wider early levels carry the three colour channels."""

    block_out_channels: tuple[int, ...] = (8, 16, 32, 32)
    norm_num_groups: int = 1
    steps: int = 400
    learning_rate: float = 1e-2
    batch: int = 8
    size: int = 64  # pixels: world frames are drawn at the demo's scale (a shape ~1/3 of the frame's short side)
    crop: int = 32  # pixels: each step trains on one random crop of them (the VAE is convolutional: any size decodes)
    frames: int = 512  # distinct training frames drawn from the world
    seed: int = 0

    def key(self) -> str:
        return content_key(version=_VERSION, **asdict(self))


def untrained_vae(recipe: VaeRecipe) -> AutoencoderKLHunyuanVideo:
    """The recipe's VAE at its random init; 4 blocks: the minimum for 8x spatial + 4x temporal compression."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return AutoencoderKLHunyuanVideo(
            latent_channels=16,
            block_out_channels=recipe.block_out_channels,
            layers_per_block=1,
            norm_num_groups=recipe.norm_num_groups,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        )


def to_pixels(frames: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> (N, 3, 1, H, W) in [-1, 1]: single-frame videos, as the pipeline scales them."""
    return torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(2).float() / 127.5 - 1.0


def train_vae(recipe: VaeRecipe) -> AutoencoderKLHunyuanVideo:
    """Train the recipe's VAE on world frames (L1 reconstruction of the posterior's mode), then set `scaling_factor`
    to 1 / the latents' std, so scaled latents have unit variance as flow matching's noise does."""
    from loraflow.ops.demo_data import world_frames

    vae = untrained_vae(recipe).train()
    pixels = to_pixels(world_frames(recipe.seed, recipe.frames, recipe.size))
    optimizer = torch.optim.Adam(vae.parameters(), recipe.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.learning_rate, total_steps=recipe.steps,
                                                   pct_start=0.1)
    generator = torch.Generator().manual_seed(recipe.seed)
    for _ in range(recipe.steps):
        top, left = (int(v) for v in torch.randint(0, recipe.size - recipe.crop + 1, (2,), generator=generator))
        batch = pixels[torch.randint(0, len(pixels), (recipe.batch,), generator=generator)]
        batch = batch[..., top : top + recipe.crop, left : left + recipe.crop]
        latents = vae.encode(batch).latent_dist.mode()
        loss = (vae.decode(latents).sample - batch).abs().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    vae.eval()
    with torch.no_grad():
        std = vae.encode(pixels[:64]).latent_dist.mode().std().item()
    vae.register_to_config(scaling_factor=1.0 / std)
    return vae


def world_vae(recipe: VaeRecipe = VaeRecipe(), cache_root: str | Path = CACHE_ROOT) -> Path:
    """The trained VAE's diffusers folder (built once, then read from the cache). Written in a staging folder and
    moved into place whole, so an interrupted build leaves no folder that looks complete."""
    target = Path(cache_root) / recipe.key() / "vae"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vae.", dir=target.parent))
    try:
        train_vae(recipe).save_pretrained(staging, safe_serialization=True)
        if target.exists():  # a folder without config.json is no finished build (ours publish whole): replace it
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:  # another process published the same recipe first: its folder holds the same weights
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def psnr(vae: AutoencoderKLHunyuanVideo, frames: np.ndarray) -> float:
    """Reconstruction PSNR (dB, peak 255) of uint8 frames through the VAE."""
    error = decode_frames(vae, frames).astype(np.float64) - frames
    return float(10 * np.log10(255.0**2 / np.mean(error**2)))


def shape_centroid(frame: np.ndarray) -> tuple[float, float]:
    """(x, y) in pixels of the shape in a uint8 (H, W, 3) frame: the pixels whose colour is furthest from the
    background's (the border's median colour), at least half as far as the furthest, averaged by that distance."""
    border = np.concatenate([frame[0], frame[-1], frame[:, 0], frame[:, -1]]).astype(np.float32)
    distance = np.linalg.norm(frame.astype(np.float32) - np.median(border, axis=0), axis=-1)
    weight = np.where(distance >= distance.max() / 2, distance, 0.0)
    ys, xs = np.mgrid[0 : frame.shape[0], 0 : frame.shape[1]]
    return float((weight * xs).sum() / weight.sum()), float((weight * ys).sum() / weight.sum())


def decode_frames(vae: AutoencoderKLHunyuanVideo, frames: np.ndarray) -> np.ndarray:
    """uint8 frames through encode -> mode -> decode, back as uint8 frames."""
    with torch.no_grad():
        decoded = vae.decode(vae.encode(to_pixels(frames)).latent_dist.mode()).sample.clamp(-1, 1)
    return ((decoded[:, :, 0].permute(0, 2, 3, 1) + 1) * 127.5).round().byte().numpy()
