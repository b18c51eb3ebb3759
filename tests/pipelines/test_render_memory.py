"""Renders under a `RenderPlan` (loraflow/pipelines/render_memory.py) on the tiny real Kandinsky 5 Video, against the
plain render (fp32, every model on the device, the whole latent decoded at once).

- offload (every block streamed, the last blocks swapped) and parking (the transformer and the VAE taking turns on
  the device) move the same weights: on the CPU, from the CPU to the CPU, so the render is the same, bit for bit;
- VAE tiling decodes overlapping tiles and blends them at their seams: approximate. Each output pixel is a convex
  combination of the decodes of the tiles covering it (diffusers' `blend_v` / `blend_h`: weights 1 - y/e and y/e of
  two tiles, in place, at the same image position; a pixel one tile covers is that tile's), so it differs from the
  whole decode by at most d(x), the largest difference there between a covering tile's own decode and the whole
  decode. The render's uint8 is round(255 * clip(x / 2 + 0.5, 0, 1)): at most floor(127.5 d(x)) + 1 levels apart
  (clipping shrinks distances, rounding adds at most one level). The test decodes each tile alone to get d(x), pixel
  by pixel: where one tile covers a pixel the bound is that tile's own difference, tight;
- precision: the adapter file's values reach the render unrounded (peft makes an adapter in its base layer's dtype:
  bf16, or fp8 under layerwise casting).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from loraflow.config import parse_config
from loraflow.contracts.renders import negative_prompt, render_settings, render_video
from loraflow.contracts.text_set import cached_texts
from loraflow.pipelines import get_family
from loraflow.pipelines.base import LORA_ADAPTER
from loraflow.pipelines.render_memory import RenderPlan
from loraflow.pipelines.sources import model_source

CPU = torch.device("cpu")
TILE = 32  # pixels: the tiny render (64x48) decodes in 2 x 3 tiles of 4 x 4 latents, 1 latent of overlap


def render(validation_inputs: tuple, plan: RenderPlan, tiles: int | None = None) -> tuple[np.ndarray, Any]:
    """One LoRA render of the validation prompt with `plan`, and the pipeline (`tiles`: tile size in pixels)."""
    _, _, lora = validation_inputs
    config = parse_config(validation_inputs[0])
    pipe = get_family(config).load_renderer(model_source(config), str(lora), CPU, plan=plan)
    pipe.set_progress_bar_config(disable=True)
    if tiles:
        pipe.vae.enable_tiling(tile_sample_min_height=tiles, tile_sample_min_width=tiles,
                               tile_sample_stride_height=tiles * 3 // 4, tile_sample_stride_width=tiles * 3 // 4)
    return render_with(validation_inputs, pipe), pipe


def render_with(validation_inputs: tuple, pipe: Any) -> np.ndarray:
    """The validation prompt's LoRA render through this pipeline, as validation renders it."""
    data, store, _ = validation_inputs
    config = parse_config(data)
    family, model = get_family(config), model_source(config)
    prompt, negative = config.validation_prompt, negative_prompt(config, family)
    texts = cached_texts(store, [(prompt, ""), (negative, "")])
    return render_video(family, pipe, texts[prompt, ""], texts[negative, ""], render_settings(config, family, model,
                                                                                                store))


@pytest.fixture(scope="module")
def plain(validation_inputs) -> np.ndarray:
    return render(validation_inputs, RenderPlan())[0]


@pytest.mark.parametrize("plan", [RenderPlan(park=True), RenderPlan(blocks_to_swap=1),
                                  RenderPlan(blocks_to_swap=2, park=True), RenderPlan(offload_all=True, park=True)],
                         ids=["park", "swap-1", "swap-all+park", "offload-all+park"])
def test_offload_and_parking_render_the_plain_render_bit_for_bit(validation_inputs, plain: np.ndarray,
                                                                 plan: RenderPlan) -> None:
    video, pipe = render(validation_inputs, plan)
    assert np.array_equal(video, plain)
    blocks = pipe.transformer.visual_transformer_blocks
    hooked = [getattr(b, "_diffusers_hook", None) is not None for b in blocks]
    assert hooked == ([True] * len(blocks) if plan.offload_all else [i >= len(blocks) - plan.blocks_to_swap
                                                                      for i in range(len(blocks))])
    assert hasattr(pipe.vae, "_hf_hook") == plan.park  # the parking hook: the VAE moves in for its decode


def test_tiled_render_stays_within_the_tiles_own_difference(validation_inputs, plain: np.ndarray) -> None:
    decoded: list[torch.Tensor] = []
    video, pipe = render(validation_inputs, RenderPlan(vae_tiling=True), tiles=TILE)
    vae = pipe.vae
    assert vae.use_tiling
    # the latent the tiled render decoded: the same denoise, so the plain render decoded it too
    original = vae.decode
    vae.decode = lambda z, *a, **k: decoded.append(z) or original(z, *a, **k)
    # deterministic: the recorded latent is the one rendered
    assert np.array_equal(render_with(validation_inputs, pipe), video)
    (z,) = decoded
    with torch.no_grad():
        whole = vae.decoder(vae.post_quant_conv(z))
        bound = torch.zeros_like(whole)  # per pixel: the largest difference of a tile covering it from the whole
        latent_tile, stride = TILE // 8, TILE * 3 // 4 // 8
        for i in range(0, z.shape[-2], stride):
            for j in range(0, z.shape[-1], stride):
                tile = vae.decoder(vae.post_quant_conv(z[..., i:i + latent_tile, j:j + latent_tile]))
                rows, cols = slice(i * 8, i * 8 + tile.shape[-2]), slice(j * 8, j * 8 + tile.shape[-1])
                bound[..., rows, cols] = torch.maximum(bound[..., rows, cols], (tile - whole[..., rows, cols]).abs())
    levels = (127.5 * bound[0].permute(1, 2, 3, 0)).floor().numpy().astype(int) + 1  # (F, H, W, 3) as the render
    difference = np.abs(video.astype(int) - plain)
    print(f"tiled vs whole decode: up to {difference.max()} levels, {(difference > 0).mean():.0%} of values; bound "
          f"{levels.min()}-{levels.max()} levels, median {int(np.median(levels))}")
    assert difference.max() > 0  # tiling ran: the render differs
    assert (difference <= levels).all()  # and no more than its tiles allow, pixel by pixel


@pytest.mark.parametrize("precision", ["bf16", "fp8-layerwise"])
def test_a_render_in_training_precision_keeps_the_adapter_file_exact(validation_inputs, precision: str) -> None:
    """bf16 and fp8 base weights (layerwise casting: stored in float8_e4m3fn), the adapter fp32 with the file's very
    values, as training holds it; the VAE in the transformer's dtype (what the pipelines expect)."""
    _, _, lora = validation_inputs
    video, pipe = render(validation_inputs, RenderPlan(precision=precision))
    assert video.shape == (5, 48, 64, 3)
    query = pipe.transformer.visual_transformer_blocks[0].self_attention.to_query
    assert query.base_layer.weight.dtype == (torch.float8_e4m3fn if precision == "fp8-layerwise" else torch.bfloat16)
    assert pipe.vae.dtype == torch.bfloat16
    state = get_peft_model_state_dict(pipe.transformer, adapter_name=LORA_ADAPTER)
    saved = load_file(Path(lora))
    assert len(state) == len(saved) and all(v.dtype == torch.float32 for v in state.values())
    assert all(torch.equal(saved[f"transformer.{k}"], v) for k, v in state.items())
