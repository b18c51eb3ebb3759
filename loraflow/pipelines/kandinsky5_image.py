"""Kandinsky 5.0 Image (Lite, t2i): prompt template, scaling, transformer call, LoRA targets, render.

Mirrors diffusers' `Kandinsky5T2IPipeline` (pipelines/kandinsky5/pipeline_kandinsky_t2i.py); the parity
tests in tests/pipelines/test_families.py hold this file to its numbers. Images are clips of one frame:
latents are (B, 16, 1, h, w) like every family's (B, C, T, h, w).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline

from loraflow.keys import content_key
from loraflow.kernels.tread import TokenLayout
from loraflow.pipelines import kandinsky5
from loraflow.pipelines.base import (
    RenderSettings, TextRow, compute_dtype, load_pipeline, scaled_posterior, set_lora_scale,
)
from loraflow.pipelines.comfyui import ComfyRule
from loraflow.pipelines.flavours import DEFAULT_FLAVOUR, FLAVOURS, NOT_BUILT, Flavour
from loraflow.pipelines.kandinsky5 import CLIP_TOKENS, KANDINSKY5_COMFYUI_NAMES, MAX_TEXT_TOKENS, Kandinsky5Shared

log = logging.getLogger(__name__)

FAMILY = "kandinsky5-image"
# The T2I pipeline's `prompt_template` (K5T2I:178); we crop the hidden states after its prefix.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, "
    "texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>"
)
NEGATIVE_PROMPT = ""  # the T2I pipeline's default negative prompt (K5T2I:660)
TEXT_SIGNATURE = content_key(template=PROMPT_TEMPLATE, max_tokens=MAX_TEXT_TOKENS, clip_tokens=CLIP_TOKENS)
VAE_FACTOR = 8  # the pipeline hard-codes vae_scale_factor_spatial = 8 (K5T2I:181)


def template_crop(tokenizer: Any) -> int:
    """Tokens in the template before the user text; 40 for the real Qwen2.5 tokenizer."""
    return kandinsky5.template_crop(tokenizer, PROMPT_TEMPLATE)


@dataclass(frozen=True)
class Kandinsky5Image(Kandinsky5Shared):
    prompt_template: ClassVar[str] = PROMPT_TEMPLATE
    flavour: Flavour
    name: str = FAMILY
    spatial_multiple: int = 16  # VAE 8x, patch 2x2
    vae_temporal_factor: int = 1  # a 2D VAE: every frame is its own image
    text_components: tuple[str, ...] = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    default_negative_prompt: str = NEGATIVE_PROMPT
    text_signature: str = TEXT_SIGNATURE  # part of every text key: a new template re-encodes
    max_text_tokens: int = MAX_TEXT_TOKENS  # caption tokens kept by encode_text; longer ones are truncated
    tread_layout: TokenLayout = TokenLayout("visual_transformer_blocks", rope_arg=3, rope_token_dim=1)
    comfyui_names: tuple[ComfyRule, ...] = KANDINSKY5_COMFYUI_NAMES  # same transformer class as video
    image_condition_components: tuple[str, ...] = ()  # the image condition is latent frame 0 itself

    # 1. text: Kandinsky5Shared (encode_text, collate_text) ----------------------------------------

    # 2. latents ----------------------------------------------------------------------------------
    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        """uint8 (B, 1, H, W, 3) -> (B, 16, 1, H/8, W/8): Flux VAE `mode()` * scaling_factor, no shift
        (distribution: (B, 32, 1, H/8, W/8), mean and logvar scaled alike; `scaled_posterior`).

        The K5 image pipelines decode `latents / scaling_factor` (K5T2I:804) and ignore the Flux VAE's
        shift_factor; caching with the shift would train on latents the pipeline never decodes.
        """
        num_frames = frames.shape[1]
        if num_frames != 1:
            raise ValueError(f"{self.name} trains on single images; got clips of {num_frames} frames. "
                             "Set the dataset's `video.num_frames: 1`.")
        # [-1, 1] as diffusers' VaeImageProcessor computes it (x / 255 * 2 - 1), in fp32 before any cast
        pixels = (frames[:, 0].permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0).to(vae.dtype)  # (B, 3, H, W)
        posterior = vae.encode(pixels).latent_dist
        latents = scaled_posterior(posterior, sampling, vae.config.scaling_factor)  # (B, 16 or 32, h, w)
        return latents[:, :, None]

    # 3. transformer --------------------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        text: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """The T2I pipeline's denoiser call (K5T2I:698-722): plain 16-channel latents, RoPE scale 1."""
        if transformer.config.visual_cond:
            raise ValueError("this Kandinsky 5 image checkpoint has visual_cond=True (an image-to-image model); "
                             "the t2i flavours need a text-to-image checkpoint")
        _, _, frames, height, width = noisy.shape
        dtype = compute_dtype(transformer)
        out = transformer(
            hidden_states=noisy.permute(0, 2, 3, 4, 1).to(dtype),  # (B, 1, h, w, 16): channels-last DiT layout
            encoder_hidden_states=text["text_embeds"].to(dtype),
            pooled_projections=text["pooled_embeds"].to(dtype),
            timestep=(sigma * 1000).to(dtype),
            visual_rope_pos=[
                torch.arange(frames, device=noisy.device),
                torch.arange(height // 2, device=noisy.device),
                torch.arange(width // 2, device=noisy.device),
            ],
            text_rope_pos=torch.arange(text["text_embeds"].shape[1], device=noisy.device),
            scale_factor=[1.0, 1.0, 1.0],
            sparse_params=None,
            return_dict=True,  # with False this model returns the bare tensor, unlike most diffusers models
        ).sample
        return out.permute(0, 4, 1, 2, 3).float()  # (B, 16, 1, h, w)

    # lora_targets, save_lora: Kandinsky5Shared

    # 4. render ---------------------------------------------------------------------------------------
    def load_renderer(
        self, model_path: str, lora_path: str | None, device: torch.device, transformer: torch.nn.Module | None = None
    ) -> Kandinsky5T2IPipeline:
        return load_pipeline(Kandinsky5T2IPipeline, model_path, lora_path, device, transformer)

    @torch.no_grad()
    def render(
        self, pipe: Kandinsky5T2IPipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
        lora_scale: float | None = 1.0,
    ) -> np.ndarray:
        size = (settings.width, settings.height)
        if size not in pipe.resolutions:
            # The pipeline would silently snap to its closest trained size; render what was asked instead.
            log.warning("%s: %dx%d is not a size Kandinsky 5 Image was trained at (%s); rendering it anyway",
                        self.name, *size, ", ".join(f"{w}x{h}" for w, h in pipe.resolutions))
            pipe.resolutions = [*pipe.resolutions, size]
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
        set_lora_scale(pipe.transformer, lora_scale)
        image = pipe(
            **self.prompt_embeds(prompt, negative, pipe.device),
            height=settings.height,
            width=settings.width,
            num_inference_steps=settings.num_inference_steps,
            guidance_scale=settings.guidance,
            generator=torch.Generator().manual_seed(settings.seed),
            output_type="np",
        ).image  # (1, H, W, 3) in [0, 1]
        return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)  # (F=1, H, W, 3)


def make_family(flavour: str | None) -> Kandinsky5Image:
    chosen = FLAVOURS[FAMILY][flavour or DEFAULT_FLAVOUR[FAMILY]]
    if not chosen.built:  # the config refuses it first; this guards callers that build a family by hand
        # i2i uses another template (with the source image's vision tokens), a 33-channel input and the
        # source image's latents: training it as t2i would not match its inference.
        raise NotImplementedError(f"model_flavour '{chosen.name}': {NOT_BUILT}")
    return Kandinsky5Image(flavour=chosen)
