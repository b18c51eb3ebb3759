"""Kandinsky 5.0 Video (Lite/Pro, t2v and i2v): prompt template, scaling, transformer call, LoRA targets, render.

Mirrors diffusers' `Kandinsky5T2VPipeline` (pipelines/kandinsky5/pipeline_kandinsky.py) and
`Kandinsky5I2VPipeline` (pipeline_kandinsky_i2v.py: the same template, crop, text encoders and checkpoint
layout); the parity tests hold this file to their numbers. i2v differs only in the latents: the image's latent
replaces frame 0 of x_t, the mask channel marks frame 0, `visual_cond` stays zero, and only frames 1.. are
stepped; so training gives frame 0 clean and leaves it out of the loss (`flavour.conditioning_frames`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5I2VPipeline, Kandinsky5T2VPipeline
from PIL import Image

from loraflow.pipelines.base import (
    RenderSettings,
    TextRow,
    first_frame,
    load_pipeline,
    set_flavour_config,
    set_lora_scale,
)
from loraflow.pipelines.kandinsky5 import common as kandinsky5
from loraflow.pipelines.kandinsky5.common import Kandinsky5Shared
from loraflow.pipelines.kandinsky5.video.first_last import first_last_inputs
from loraflow.pipelines.kandinsky5.video.spec import SPEC
from loraflow.pipelines.sources import ModelSource

if TYPE_CHECKING:
    from loraflow.pipelines.render_memory import RenderPlan

# diffusers 0.42.1's system prompt (Kandinsky5T2VPipeline/I2VPipeline `prompt_template`); we crop the hidden
# states after its prefix (128 tokens with the real Qwen2.5 tokenizer, its prompt_template_encode_start_idx).
DIFFUSERS_TEMPLATE = "\n".join(
    [
        "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
        "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
        "Describe the location of the video, main characters or objects and their action.",
        "Describe the dynamism of the video and presented actions.",
        "Name the visual style of the video: whether it is a professional footage, user generated content, some "
        "kind of animation, video game or scren content.",
        "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
        "Pay attention to the order of key actions shown in the scene.<|im_end|>",
        "<|im_start|>user\n{}<|im_end|>",
    ]
)
# The original repository's "video" template (kandinskylab/kandinsky-5 kandinsky/models/text_embedders.py, used for
# t2v and i2v alike), "promt" as it spells it: what the checkpoints were trained with (crop 129 there, its prefix).
ORIGINAL_TEMPLATE = DIFFUSERS_TEMPLATE.replace("You are a prompt engineer", "You are a promt engineer")
NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards"
)
# Kandinsky5I2VPipeline.normalize_first_frame takes its reference statistics from latent frames 4..: with fewer
# than 5 latent frames (17 video frames) they are empty and the whole video is NaN.
I2V_MIN_FRAMES = 17


def template_crop(tokenizer: Any, template: str = "original") -> int:
    """Tokens in the template before the user text; 129 (diffusers': 128) for the real Qwen2.5 tokenizer."""
    return kandinsky5.template_crop(tokenizer, Kandinsky5Video.prompt_templates[template])


@dataclass(frozen=True)
class Kandinsky5Video(Kandinsky5Shared):
    prompt_templates: ClassVar[dict[str, str]] = {"original": ORIGINAL_TEMPLATE, "diffusers": DIFFUSERS_TEMPLATE}
    # flavour, template, text_components, tread_layout, comfyui_names, musubi_names, image_condition_*:
    # Kandinsky5Shared's
    name: str = SPEC.name
    spatial_multiple: int = SPEC.spatial_multiple
    vae_temporal_factor: int = SPEC.vae_temporal_factor
    default_negative_prompt: str = NEGATIVE_PROMPT
    # text_signature, max_text_tokens: Kandinsky5Shared (the template, the flavour's 256 tokens)

    # 1. text: Kandinsky5Shared (encode_text, collate_text) ----------------------------------------

    # 2. latents ----------------------------------------------------------------------------------
    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        return kandinsky5.encode_video(vae, frames, sampling)

    # 3. transformer --------------------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        text: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        hidden = noisy.permute(0, 2, 3, 4, 1)  # (B, T, h, w, C): channels-last DiT layout
        given = self.flavour.conditioning_frames  # i2v: frame 0 of `noisy` is the clean image latent
        if given and not transformer.config.visual_cond:
            raise ValueError(f"flavour '{self.flavour.name}' conditions on a first frame, but this transformer has "
                             "visual_cond=False (no mask channel): point at an i2v checkpoint")
        if transformer.config.visual_cond:  # zero condition latents (t2v and i2v alike), mask = the given frames
            cond = torch.zeros_like(hidden)
            mask = torch.zeros(*hidden.shape[:-1], 1, dtype=hidden.dtype, device=hidden.device)
            mask[:, :given] = 1
            if self.flavour.last_frame_given:  # i2v_mode first_last: the clean last frame is marked as the first
                mask[:, -1] = 1
            hidden = torch.cat([hidden, cond, mask], dim=-1)  # (B, T, h, w, 16 + 16 + 1)
        sparse = kandinsky5.nabla_params(self.pipeline_class, transformer, hidden)
        return kandinsky5.denoise(transformer, hidden, sigma, text, _rope_scale(height * 8, width * 8), sparse)

    # lora_targets, save_lora: Kandinsky5Shared

    # 4. render ---------------------------------------------------------------------------------------
    def load_renderer(
        self, model: ModelSource | str, lora_path: str | None, device: torch.device,
        transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None,
    ) -> Kandinsky5T2VPipeline:
        """The t2v or i2v pipeline (one checkpoint layout: the class differs only in how it prepares latents), its
        transformer in the flavour's mode (Pro SD or HD attention: `set_flavour_config`)."""
        pipe = load_pipeline(self.pipeline_class, model, lora_path, device, transformer, plan,
                             self.tread_layout.blocks)
        set_flavour_config(pipe.transformer, self.flavour)
        if kandinsky5.uses_nabla(pipe.transformer):  # the pipeline builds NABLA's mask itself; it needs flex to run
            kandinsky5.use_flex_attention(pipe.transformer)
        return pipe

    @property
    def pipeline_class(self) -> type:
        return Kandinsky5I2VPipeline if self.flavour.conditioning_frames else Kandinsky5T2VPipeline

    @torch.no_grad()
    def render(
        self, pipe: Kandinsky5T2VPipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
        lora_scale: float | None = 1.0, image: np.ndarray | None = None, last_image: np.ndarray | None = None,
    ) -> np.ndarray:
        """t2v, or i2v from `image` (uint8 (H, W, 3) at the render size) as the first frame, and with
        `i2v_mode: first_last` to `last_image` (same layout) as the last (`first_last_inputs`)."""
        inputs = self._image_input(image, settings)
        generator = torch.Generator().manual_seed(settings.seed)
        if self.flavour.last_frame_given != (last_image is not None):
            needs = "first_last needs" if self.flavour.last_frame_given else "first takes no"
            raise ValueError(f"flavour '{self.flavour.name}' with i2v_mode {needs} `last_image`")
        if last_image is not None:
            inputs.update(first_last_inputs(pipe, inputs["image"], last_image, settings, generator))
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
        set_lora_scale(pipe.transformer, lora_scale)
        video = pipe(
            **inputs,
            **self.prompt_embeds(prompt, negative, pipe._execution_device),
            height=settings.height,
            width=settings.width,
            num_frames=settings.num_frames,
            num_inference_steps=settings.num_inference_steps,
            guidance_scale=settings.guidance,
            generator=generator,
            output_type="np",
        ).frames[0]
        return (np.clip(video, 0, 1) * 255).round().astype(np.uint8)  # (F, H, W, 3)

    def _image_input(self, image: np.ndarray | None, settings: RenderSettings) -> dict[str, Image.Image]:
        """{"image": PIL} for i2v (checked: size, frame count), {} for t2v (which takes no image)."""
        picture = first_frame(self.flavour, image, settings)
        if picture is None:
            return {}
        if settings.num_frames < I2V_MIN_FRAMES:
            raise ValueError(f"`validation_num_video_frames` {settings.num_frames}: Kandinsky 5 i2v needs at least "
                             f"{I2V_MIN_FRAMES} frames (5 latent frames; fewer render NaN); use {I2V_MIN_FRAMES}")
        return {"image": picture}


def _rope_scale(height: int, width: int) -> tuple[float, float, float]:
    """The pipeline's resolution-dependent RoPE scale, so training sees what inference sees."""
    return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)


def make_family(flavour: str | None) -> Kandinsky5Video:
    """t2v and i2v flavours; i2v trains with latent frame 0 clean (the clip's first frame) and renders from an image."""
    return Kandinsky5Video(flavour=SPEC.flavour(flavour))
