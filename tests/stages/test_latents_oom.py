"""An out-of-memory latent encode that falls back to tiling: its latent is approximate, so it is stored under the
tiled key and listed as approximate, and a later run that has the memory encodes it exactly.

A CUDA out-of-memory error cannot happen on a CPU (and a CPU allocation failure is a plain RuntimeError), so the
test plays the GPU's part: a forward pre-hook on the real VAE's encoder raises torch's own OutOfMemoryError
whenever the VAE is not tiling, as a VAE too large for its card does until tiling shrinks what it holds at once, and
its tiles are ones that small card holds (32 px: the demo's clips are smaller than diffusers' 256 px, so with those
tiling would change no number). The redone latents are compared with a run that never ran short, bit for bit.
Everything else is real: clips from real videos, the tiny real VAE through `from_pretrained`, the real store.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import loraflow.stages.latents.latents as L
from loraflow.assets.checks import clips_without_latents
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.store import Store
from tests.factory import config_for, uninterrupted_latents


def out_of_memory_unless_tiling(vae: torch.nn.Module) -> None:
    def hook(_module: torch.nn.Module, _args: tuple) -> None:
        if not vae.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory (played by the test: the VAE fits only when tiling)")

    vae.encoder.register_forward_pre_hook(hook)


def test_a_tiled_fallback_is_listed_as_approximate_and_redone_exactly(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_for(tiny_k5, demo_data, tmp_path)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model_source(config), store)
    exact = {r.clip_key: r for r in L.latent_rows(config, get_family(config), model_source(config), store)}
    assert all(r.key != r.tiled_key for r in exact.values())  # tiling is off in the demo config
    keys = [r.key for r in exact.values()]
    reference = uninterrupted_latents(tiny_k5, demo_data, tmp_path / "reference", keys)

    load = L.load_component

    def small_card(path: str, name: str, *args, **kwargs):
        component = load(path, name, *args, **kwargs)
        if name == "vae":
            out_of_memory_unless_tiling(component)
            # the tiles a small card holds: diffusers' (256 px) are larger than the demo's clips, which would not tile
            component.tile_sample_min_height = component.tile_sample_min_width = 32
            component.tile_sample_stride_height = component.tile_sample_stride_width = 24
        return component

    monkeypatch.setattr(L, "load_component", small_card)
    report = L.encode_latents(config, family, model_source(config), store)
    assert {f.fallback for f in report.oom_fallbacks} == {"tiling"}
    listed = store.read_manifest("latents")
    assert listed and all(r["approximate"] and r["key"] == exact[r["clip_key"]].tiled_key for r in listed)
    stored = store.keys("latents")
    assert not stored & {r.key for r in exact.values()}  # nothing approximate under an exact key
    assert clips_without_latents(list(exact.values()), store) == []  # the blocking check counts them
    tiled = store.get("latents", [r.tiled_key for r in exact.values()])  # approximate indeed: other numbers
    assert all(not np.array_equal(tiled[r.tiled_key]["latent"], reference[r.key]) for r in exact.values())

    monkeypatch.setattr(L, "load_component", load)  # a card with the memory: the next run redoes them exactly
    again = L.encode_latents(config, family, model_source(config), store)
    assert again.computed == len(exact) and again.oom_fallbacks == ()
    listed = store.read_manifest("latents")
    assert all(not r["approximate"] and r["key"] == exact[r["clip_key"]].key for r in listed)
    for key, row in store.get("latents", keys).items():  # exactly: the bits of a run that never ran short
        assert np.array_equal(row["latent"], reference[key]), key


def test_a_clip_whose_latent_is_not_finite_is_quarantined_and_the_others_stored(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real tiny VAE, its encoder's output made NaN for the first clip it encodes (a forward hook on the real
    module, as a VAE run in too narrow a precision overflows): that clip is quarantined (non_finite_latent, its detail
    naming its file, its frames and the precision) and not stored, the other clips are stored as a clean run stores
    them, and the blocking check does not count the quarantined one as missing."""
    config = config_for(tiny_k5, demo_data, tmp_path)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model_source(config), store)
    planned = {r.clip_key: r for r in L.latent_rows(config, family, model_source(config), store)}
    assert len(planned) >= 2
    reference = uninterrupted_latents(tiny_k5, demo_data, tmp_path / "reference", [r.key for r in planned.values()])
    load = L.load_component
    encoded: list[int] = []

    def overflowing(path: str, name: str, *args, **kwargs):
        component = load(path, name, *args, **kwargs)
        if name == "vae":
            component.encoder.register_forward_hook(
                lambda _m, _i, out: out * torch.nan if not encoded.append(1) and len(encoded) == 1 else None)
        return component

    monkeypatch.setattr(L, "load_component", overflowing)
    report = L.encode_latents(config, family, model_source(config), store)
    (bad,) = report.quarantined
    clip = planned[bad.clip_key]
    assert bad.reason == "non_finite_latent" and bad.key not in store.keys("latents")
    assert clip.source in bad.detail and f"frames {clip.frames}" in bad.detail and "float32" in bad.detail, bad.detail
    assert report.computed == len(planned) - 1
    good = [r.key for r in planned.values() if r.clip_key != bad.clip_key]
    for key, row in store.get("latents", good).items():
        assert np.array_equal(row["latent"], reference[key]), key
    assert {r["clip_key"] for r in store.read_manifest("latents")} == set(planned) - {bad.clip_key}
    assert clips_without_latents(list(planned.values()), store) == []
