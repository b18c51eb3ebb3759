"""`latent_sampling: distribution`: the cached posterior against diffusers' `latent_dist`, and its own keys.

For each family, on its tiny real-architecture VAE: the stored mean is diffusers' `latent_dist.mean` x the
pipeline's scaling, the stored variance is `latent_dist.var` x scaling², and `draw_latents` with a seeded
generator is `latent_dist.sample(generator)` x scaling for the same seed.

The mean is bit for bit: one clip per encode on both sides (the latents stage encodes one clip at a time; a batch of
two convolves with other blocking), the same ops. Variance and draw are other formulas of the same math (exp of the
scaled logvar vs exp(logvar) * scale²), so they are compared within the rounding of each formula, element by element
(u = 2^-24; exp within 1 ulp, 2u): `variance_tolerance` and `draw_tolerance`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from loraflow.config import ConfigError, load_config
from loraflow.contracts.latent_rows import draw_latents
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import get_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15
from loraflow.pipelines.kandinsky5.image import family as kandinsky5_image
from loraflow.pipelines.kandinsky5.video import family as kandinsky5_video
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents, latent_rows
from loraflow.store import Store
from tests.factory import config_for, demo_dict, write_config
from tests.numerics import U32

FAMILIES = {  # family -> (module, frames (F, H, W) the tiny VAE encodes)
    "kandinsky5-video": (kandinsky5_video, (5, 32, 32)),
    "kandinsky5-image": (kandinsky5_image, (1, 32, 32)),
    "hunyuanvideo-1.5": (hunyuanvideo15, (5, 32, 32)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_vae(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    module, frames = FAMILIES[request.param]
    path = build_tiny(request.param, tmp_path_factory.mktemp("tiny") / request.param)
    return module.make_family(None), load_component(path, "vae"), frames


def reference_posteriors(vae: torch.nn.Module, frames: torch.Tensor) -> list:
    """diffusers' posterior of each clip, from pixels normalized as the pipelines' image processors do."""
    pixels = torch.from_numpy(VaeImageProcessor.normalize(frames.numpy().astype(np.float32) / 255.0))
    posteriors = []
    for i in range(len(pixels)):
        x = pixels[i : i + 1].permute(0, 4, 1, 2, 3)  # (1, 3, F, H, W): a channels-last view, as numpy_to_pt makes
        if x.shape[2] == 1 and vae.__class__.__name__ == "AutoencoderKL":
            x = x[:, :, 0]  # Kandinsky 5 Image: the 2D Flux VAE
        posteriors.append(vae.encode(x).latent_dist)
    return posteriors


def variance_tolerance(logvar: torch.Tensor, scale: float, variance: torch.Tensor) -> torch.Tensor:
    """|exp(fl(logvar_vae + fl(2 ln s))) - fl(exp(logvar_vae) * fl(s²))| for the scaled `logvar`: the sum's and
    2 ln s's roundings move the exponent by u (|logvar_vae| + 2 |2 ln s|) <= u (|logvar| + 6 |ln s|), so the value
    by that relative; the three exps are within 1 ulp (2u), s² and the product round once each: 6u more. Times 2 for
    second-order terms."""
    return 2 * U32 * (logvar.abs() + 6 * abs(math.log(scale)) + 6) * variance.abs()


def draw_tolerance(mean: torch.Tensor, logvar: torch.Tensor, scale: float, sample: torch.Tensor) -> torch.Tensor:
    """mean + exp(logvar / 2) eps (the scaled posterior) vs (mean_vae + exp(logvar_vae / 2) eps) * s: the noise term
    carries half the exponent's shift, u (|logvar| / 2 + 3 |ln s|), two exps (2u each) and two products; the mean
    term its scaling's rounding; the whole the sums' and the final scaling's roundings (4u). Times 2 as above."""
    noise = (sample - mean).abs()
    return 2 * U32 * ((logvar.abs() / 2 + 3 * abs(math.log(scale)) + 6) * noise + mean.abs() + 4 * sample.abs())


@torch.no_grad()
def test_stored_distribution_and_draws_equal_diffusers_posterior(family_vae) -> None:
    family, vae, size = family_vae
    frames = torch.randint(0, 256, (2, *size, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    scale = vae.config.scaling_factor
    encoded = torch.cat([family.vae_encode(vae, clip[None], "distribution") for clip in frames])  # as the stage does
    mode = torch.cat([family.vae_encode(vae, clip[None]) for clip in frames])
    channels = mode.shape[1]
    assert encoded.shape == (mode.shape[0], 2 * channels, *mode.shape[2:])
    mean, logvar = encoded[:, :channels], encoded[:, channels:]
    assert torch.equal(mean, mode)  # a diagonal Gaussian's mode is its mean
    for i, posterior in enumerate(reference_posteriors(vae, frames)):
        assert torch.equal(mean[i], (posterior.mean * scale).reshape(mean[i].shape))  # one clip a call, both sides
        # variance of a scaled sample: scale² x var (logvar + 2 log scale, checked through exp)
        variance = (posterior.var * scale**2).reshape(logvar[i].shape)
        tolerance = variance_tolerance(logvar[i], scale, variance)
        assert ((logvar[i].exp() - variance).abs() <= tolerance).all()
        assert ((posterior.var.reshape(variance.shape) - variance).abs() > tolerance).any()  # unscaled: fails
        assert posterior.var.std() > 0  # the VAE's variance is not a constant: the check can fail
        # same seed, same eps: the draw is diffusers' sample, scaled (K5 Image: (16, h, w) vs (16, 1, h, w))
        drawn = draw_latents(mean[i][None], logvar[i][None], torch.Generator().manual_seed(7 + i))
        sample = (posterior.sample(torch.Generator().manual_seed(7 + i)) * scale).reshape(drawn.shape)
        tolerance = draw_tolerance(mean[i][None], logvar[i][None], scale, sample)
        assert ((drawn - sample).abs() <= tolerance).all()
        unscaled_std = mean[i][None] + (sample - mean[i][None]) / scale  # the std of the unscaled posterior: fails
        assert ((unscaled_std - sample).abs() > tolerance).any()
        assert not torch.allclose(drawn, mean[i][None], atol=1e-4)  # a draw, not the mean


def test_draw_latents_is_mean_plus_std_times_seeded_normal() -> None:
    mean = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 2, 2)
    logvar = torch.full_like(mean, math.log(4.0))  # std 2
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(3))
    # exp(fl(ln 4) / 2) = 2 (1 + d), |d| <= 0.7u + 2u (ln 4's rounding, exp's ulp); then a product and a sum
    drawn = draw_latents(mean, logvar, torch.Generator().manual_seed(3))
    assert ((drawn - (mean + 2.0 * eps)).abs() <= 2 * U32 * (4 * 2 * eps.abs() + (mean + 2 * eps).abs())).all()
    first = draw_latents(mean, logvar, torch.Generator().manual_seed(3))
    again = draw_latents(mean, logvar, torch.Generator().manual_seed(4))
    assert not torch.equal(first, again)  # a new seed (epoch) draws a new sample


def test_switching_latent_sampling_adds_keys_and_leaves_mode_rows(tiny_k5: Path, demo_data: Path,
                                                                   tmp_path: Path) -> None:
    as_mode = config_for(tiny_k5, demo_data, tmp_path, name="mode.yaml")
    as_dist = load_config(write_config(tmp_path / "dist.yaml", demo_dict(tiny_k5, demo_data, tmp_path,
                                                                        latent_sampling="distribution")))
    family, store = get_family(as_mode), Store(as_mode.cache_dir, as_mode.manifest_names)
    build_clips(as_mode, family, model_source(as_mode), store)
    first = encode_latents(as_mode, family, model_source(as_mode), store)
    mode_keys = {r["key"] for r in store.read_manifest("latents")}
    shards = Path(as_mode.cache_dir) / "latents" / "shards"
    mode_shards = {p.name: p.read_bytes() for p in shards.glob("*.parquet")}

    switched = encode_latents(as_dist, family, model_source(as_dist), store)  # the clips as_mode listed: its own
    assert as_dist.manifest_names.of("clips") == as_mode.manifest_names.of("clips")
    dist_keys = {r["key"] for r in store.named(as_dist.manifest_names).read_manifest("latents")}
    assert {r["key"] for r in store.named(as_mode.manifest_names).read_manifest("latents")} == mode_keys  # kept
    assert (switched.computed, switched.reused) == (first.computed, 0)
    assert len(dist_keys) == len(mode_keys) and not dist_keys & mode_keys
    assert {p.name: p.read_bytes() for p in shards.glob("*.parquet") if p.name in mode_shards} == mode_shards
    assert store.keys("latents") == mode_keys | dist_keys

    # the distribution row's `latent` is the mean = the mode row's latent; its logvar is beside it
    by_clip = {}
    for config in (as_mode, as_dist):
        for row in latent_rows(config, get_family(config), model_source(config), store):
            by_clip.setdefault(row.clip_key, []).append(row.key)
    mode_key, dist_key = next(iter(by_clip.values()))
    rows = store.get("latents", [mode_key, dist_key])
    np.testing.assert_array_equal(rows[dist_key]["latent"], rows[mode_key]["latent"])
    assert "latent_logvar" not in rows[mode_key]
    assert rows[dist_key]["latent_logvar"].shape == rows[dist_key]["latent"].shape
    assert np.isfinite(rows[dist_key]["latent_logvar"]).all()

    # back to mode: the old rows, untouched
    assert encode_latents(as_mode, family, model_source(as_mode), store).computed == 0
    assert encode_latents(as_dist, family, model_source(as_dist), store).computed == 0


def test_a_bad_latent_sampling_fails_at_load_naming_the_allowed_values(tiny_k5: Path, demo_data: Path,
                                                                       tmp_path: Path) -> None:
    path = write_config(tmp_path / "bad.yaml", demo_dict(tiny_k5, demo_data, tmp_path, latent_sampling="sample"))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "latent_sampling" in message and "'sample'" in message
    assert "'mode'" in message and "'distribution'" in message


def test_the_families_reject_an_unknown_sampling(tiny_k5: Path) -> None:
    vae = load_component(tiny_k5, "vae")
    frames = torch.zeros((1, 5, 32, 32, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="mode, distribution"):
        kandinsky5_video.make_family(None).vae_encode(vae, frames, "sample")
