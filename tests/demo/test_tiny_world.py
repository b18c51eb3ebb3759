"""The tiny world's VAE carries the demo world by construction, and its transformer is pre-trained once and cached."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo

from loraflow.demo import tiny_world
from loraflow.demo.dataset import world_clips
from loraflow.demo.tiny_world import WorldRecipe, decode_frames, mosaic_vae, pretrain, shape_centroid
from loraflow.pipelines.kandinsky5 import tiny_parts as parts
from loraflow.pipelines.kandinsky5.video.family import make_family


def test_mosaic_vae_is_cell_means_and_loads_back(tmp_path: Path) -> None:
    """encode -> decode is 8x8 (x4 frames) cell means, repeated: checked against numpy's, to a few 8-bit levels.

    The construction is exact but for the GroupNorm std (K/2 * sqrt(1 + |c|^2 / K^2), K = 100: at most 1.5e-4 of a
    colour) and float32 rounding; both are far below one 8-bit level (1/127.5 = 7.8e-3), so decoded uint8 pixels are
    the rounded cell means, +-1 where a mean sits on a rounding boundary.
    """
    mosaic_vae().save_pretrained(tmp_path / "vae")
    vae = AutoencoderKLHunyuanVideo.from_pretrained(tmp_path / "vae").eval()  # the real loader reads it back
    [(video, _)] = world_clips(3, 1, ((96, 64),), 17, ("left_to_right",))
    decoded = decode_frames(vae, video)

    pixels = video.astype(np.float64) / 127.5 - 1.0
    groups = [pixels[:1]] + [pixels[1 + 4 * k : 5 + 4 * k] for k in range(4)]  # frame 0 alone, then 4 at a time
    cells = [g.mean(axis=0).reshape(8, 8, 12, 8, 3).mean(axis=(1, 3)) for g in groups]  # (8, 12, 3) cell means
    expected = np.concatenate([np.repeat(np.repeat(c, 8, 0), 8, 1)[None].repeat(len(g), 0)
                               for c, g in zip(cells, groups)])
    expected = np.round((np.clip(expected, -1, 1) + 1) * 127.5)
    assert np.abs(decoded.astype(np.float64) - expected).max() <= 1

    shifts = [shape_centroid(f)[0] for f in decoded]  # so where the shape is, and where it goes, survives
    assert shifts[-1] - shifts[0] > 20


def test_shape_centroid_finds_the_drawn_shape() -> None:
    frame = np.zeros((64, 96, 3), np.uint8)
    frame[10:20, 60:70] = (220, 40, 40)
    assert np.allclose(shape_centroid(frame), (64.5, 14.5))


def test_pretraining_lowers_the_flow_loss_and_is_cached(tmp_path: Path) -> None:
    """A short recipe (40 steps) on the real pieces: the transformer's weights change, the flow-matching loss on
    world clips it never trained on drops, and a second call trains nothing (the file is read back). Measured: 1.79
    -> 0.71 by default and under AVX2 kernels with one thread; asking for 10% leaves the rest as margin."""
    family = make_family("i2v-lite-5s")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text = parts.kandinsky5_text_components()
        transformer = parts.kandinsky5_transformer(visual_cond=True, model_dim=128)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    recipe = replace(WorldRecipe(), clips=16, steps=40)
    vae = mosaic_vae()
    loss_before = _held_out_loss(family, transformer, vae, text)

    pretrain(family, transformer, vae, text, recipe, tmp_path)
    [weights] = tmp_path.glob("*/transformer.safetensors")
    assert _held_out_loss(family, transformer, vae, text) < 0.9 * loss_before
    assert any(not torch.equal(before[k], v) for k, v in transformer.state_dict().items())

    stamp = os.stat(weights).st_mtime_ns
    again = parts.kandinsky5_transformer(visual_cond=True, model_dim=128)
    again.load_state_dict(before)
    pretrain(family, again, vae, text, recipe, tmp_path)
    assert os.stat(weights).st_mtime_ns == stamp  # read, not retrained
    assert all(torch.equal(v, transformer.state_dict()[k]) for k, v in again.state_dict().items())


def _held_out_loss(family, transformer, vae, text) -> float:
    from loraflow.kernels.flow_matching import flow_mse, noisy_sample

    losses = []
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for video, caption in world_clips(11, 6, ((96, 64),), 17, WorldRecipe().motions):
            x0 = family.vae_encode(vae, torch.from_numpy(video)[None])
            rows = family.collate_text(family.encode_text(text, [caption]), torch.device("cpu"))
            for sigma in (0.3, 0.6, 0.9):
                noise = torch.randn(x0.shape, generator=generator)
                s = torch.tensor([sigma])
                given = family.flavour.conditioning_frames
                prediction = family.velocity(transformer, noisy_sample(x0, noise, s, given), s, rows)
                losses.append(flow_mse(prediction, x0, noise, given).item())
    return float(np.mean(losses))


KEY_PROGRAM = """
import torch
from loraflow.demo import tiny_world
torch.manual_seed(0)
family, transformer, vae, text = tiny_world.world_inputs()
print(tiny_world._key(family, transformer, text, tiny_world.WorldRecipe()))
"""


def test_the_cache_key_is_the_same_in_every_process_and_names_the_shipped_weights() -> None:
    """Seen failing: diffusers' config carries `_use_default_values`, a set's order, which changed with the process's
    hash seed; every `make demo` then pre-trained again. The key is also the shipped weights' name: a change to the
    recipe, the architecture or `_VERSION` without new weights would pre-train for minutes in every fresh clone and CI
    run (seen failing with `steps` 2000 -> 2001)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    keys = {subprocess.run([sys.executable, "-c", KEY_PROGRAM], cwd=repo, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()[-1] for seed in ("1", "2")}
    assert len(keys) == 1, keys
    assert (tiny_world.SHIPPED / f"{keys.pop()}.safetensors").is_file(), (
        "the tiny world's recipe changed: pre-train it (`rm -r .loraflow/tiny_world && loraflow demo`), then ship "
        "`.loraflow/tiny_world/<key>/transformer.safetensors` as `loraflow/demo/tiny_world_weights/<key>.safetensors` "
        "in place of the old file")


@pytest.mark.soak
def test_the_recipe_pre_trains_weights_as_good_as_the_shipped_ones(tmp_path: Path) -> None:
    """The shipped weights are what the recipe makes: pre-trained again here (292 s on 2 quiet cores, 36 min at load
    4-5: hence a soak), from the same initial weights, the held-out flow loss lands near the shipped weights' and far
    below the untrained transformer's (passed once at load 4-5, c75197e). Not bit for bit: 2000 AdamW steps on another
    CPU or thread count drift apart in the last bits and then chaotically; what the demo needs
    (tests/demo/test_demo_learns.py) is a world this good. Seen failing with the recipe cut to 40 steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        family, transformer, vae, text = tiny_world.world_inputs()
    untrained = _held_out_loss(family, transformer, vae, text)
    shipped = _held_out_loss(family, pretrain(family, copy.deepcopy(transformer), vae, text, cache_root=tmp_path),
                             vae, text)
    assert not list(tmp_path.iterdir())  # read from the shipped file, nothing trained
    again = _held_out_loss(family, pretrain(family, transformer, vae, text, cache_root=tmp_path, shipped=None), vae,
                           text)
    assert again < 0.5 * untrained and shipped < 0.5 * untrained, (untrained, shipped, again)
    assert abs(again - shipped) < 0.25 * shipped, (shipped, again)
