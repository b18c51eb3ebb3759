"""Kandinsky 5.0 Image (Lite, t2i): prompt template, scaling, transformer call, LoRA targets, render.

Mirrors diffusers' `Kandinsky5T2IPipeline` (pipelines/kandinsky5/pipeline_kandinsky_t2i.py); the parity
tests in tests/pipelines/test_families.py hold this file to its numbers. Images are clips of one frame:
latents are (B, 16, 1, h, w) like every family's (B, C, T, h, w).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline
from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean

from loraflow.keys import content_key
from loraflow.kernels.tread import TokenLayout
from loraflow.pipelines.base import (
    RenderSettings, TextRow, compute_dtype, load_pipeline, scaled_posterior, set_lora_scale,
)
from loraflow.pipelines.flavours import DEFAULT_FLAVOUR, FLAVOURS, Flavour
from loraflow.pipelines.kandinsky5_video import KANDINSKY5_COMFYUI_NAMES, ComfyRule

log = logging.getLogger(__name__)

FAMILY = "kandinsky5-image"
# The T2I pipeline's `prompt_template` (K5T2I:178); we crop the hidden states after its prefix.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, "
    "texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>"
)
NEGATIVE_PROMPT = ""  # the T2I pipeline's default negative prompt (K5T2I:660)
MAX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length
CLIP_TOKENS = 77
TEXT_SIGNATURE = content_key(template=PROMPT_TEMPLATE, max_tokens=MAX_TEXT_TOKENS, clip_tokens=CLIP_TOKENS)
VAE_FACTOR = 8  # the pipeline hard-codes vae_scale_factor_spatial = 8 (K5T2I:181)


def template_crop(tokenizer: Any) -> int:
    """Tokens in the template before the user text; 40 for the real Qwen2.5 tokenizer.

    Computed, not hard-coded: a different tokenizer (the tiny offline one) splits the prefix differently.
    """
    return len(tokenizer(PROMPT_TEMPLATE.split("{}")[0])["input_ids"])


@dataclass(frozen=True)
class Kandinsky5Image:
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

    # 1. text -------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, components: Mapping[str, Any], texts: list[str]) -> list[TextRow]:
        """Qwen2.5-VL last hidden state after the template + CLIP-L pooled output, one text at a time.

        One at a time because the transformer has no text mask: each row keeps exactly its valid tokens.
        """
        tokenizer, qwen = components["tokenizer"], components["text_encoder"]
        clip_tokenizer, clip = components["tokenizer_2"], components["text_encoder_2"]
        crop = template_crop(tokenizer)
        rows = []
        for text in texts:
            text = prompt_clean(text)
            ids = tokenizer(
                PROMPT_TEMPLATE.format(text), max_length=crop + MAX_TEXT_TOKENS, truncation=True, return_tensors="pt"
            )["input_ids"].to(qwen.device)
            hidden = qwen(input_ids=ids, output_hidden_states=True, return_dict=True)["hidden_states"][-1]
            clip_ids = clip_tokenizer(
                [text], max_length=CLIP_TOKENS, truncation=True, padding="max_length", return_tensors="pt"
            ).to(clip.device)
            pooled = clip(**clip_ids)["pooler_output"]
            rows.append({
                "text_embeds": hidden[0, crop:].float().cpu().numpy(),  # (L, 3584)
                "pooled_embeds": pooled[0].float().cpu().numpy(),  # (768,)
            })
        return rows

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        lengths = {len(r["text_embeds"]) for r in rows}
        if len(lengths) != 1:
            # No text mask in this transformer: padding would be attended to (REFERENCE.md). Batches are
            # grouped by token length upstream; reaching here is a bug, not a user error.
            raise ValueError(f"Kandinsky 5 batches need equal text lengths; got {sorted(lengths)}")
        return {
            "text_embeds": torch.from_numpy(np.stack([r["text_embeds"] for r in rows])).to(device),
            "pooled_embeds": torch.from_numpy(np.stack([r["pooled_embeds"] for r in rows])).to(device),
        }

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

    def lora_targets(self, include_ffn: bool) -> list[str]:
        # Qualified suffixes: a bare `out_layer` would also hit modulation, time embedding and the final layer.
        targets = [f"{block}.{proj}" for block in ("self_attention", "cross_attention")
                   for proj in ("to_query", "to_key", "to_value", "out_layer")]
        if include_ffn:
            targets += ["feed_forward.in_layer", "feed_forward.out_layer"]
        return targets

    def save_lora(
        self, state_dict: dict[str, torch.Tensor], out_dir: str | Path, adapter_config: dict | None = None
    ) -> None:
        """diffusers format (`transformer.` prefix, LoraConfig in the header): `Kandinsky5T2IPipeline.load_lora_weights` reads it."""
        Kandinsky5T2IPipeline.save_lora_weights(
            out_dir, transformer_lora_layers=state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=adapter_config,
        )

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
        pos, neg = self.collate_text([prompt], pipe.device), self.collate_text([negative], pipe.device)
        image = pipe(
            prompt_embeds_qwen=pos["text_embeds"],
            prompt_embeds_clip=pos["pooled_embeds"],
            prompt_cu_seqlens=_cu_seqlens(pos["text_embeds"]).to(pipe.device),
            negative_prompt_embeds_qwen=neg["text_embeds"],
            negative_prompt_embeds_clip=neg["pooled_embeds"],
            negative_prompt_cu_seqlens=_cu_seqlens(neg["text_embeds"]).to(pipe.device),
            height=settings.height,
            width=settings.width,
            num_inference_steps=settings.num_inference_steps,
            guidance_scale=settings.guidance,
            generator=torch.Generator().manual_seed(settings.seed),
            output_type="np",
        ).image  # (1, H, W, 3) in [0, 1]
        return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)  # (F=1, H, W, 3)


def _cu_seqlens(embeds: torch.Tensor) -> torch.Tensor:
    batch, length = embeds.shape[:2]
    return torch.arange(batch + 1, dtype=torch.int32) * length


def make_family(flavour: str | None) -> Kandinsky5Image:
    chosen = FLAVOURS[FAMILY][flavour or DEFAULT_FLAVOUR[FAMILY]]
    if chosen.task != "t2i":
        # i2i uses another template (with the source image's vision tokens), a 33-channel input and the
        # source image's latents: training it as t2i would not match its inference.
        raise NotImplementedError(
            f"model_flavour '{chosen.name}' conditions on a source image, which loraflow does not cache yet; "
            "use 't2i-lite-sft' or 't2i-lite-pretrain'"
        )
    return Kandinsky5Image(flavour=chosen)
