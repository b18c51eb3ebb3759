"""Kandinsky 5 i2v rendered to a given last frame (`i2v_mode: first_last`, musubi-tuner's `--i2v_mode first_last`).

diffusers' `Kandinsky5I2VPipeline` takes a first frame only. It does take prepared `latents` (B, T, h, w, C + C + 1:
the latent, the zero visual condition, the mask) and a step callback, and it steps every latent frame after the
first. So the renderer prepares the latents as the pipeline would (`prepare_latents` with the render's generator: the
same noise and first frame), puts the last frame's latent in the last frame with mask 1 there too, as training gives
it (`noisy_sample`, `velocity`), and writes that latent back after each step, which undoes exactly what the step
did to it: every call of the transformer sees the last frame clean and marked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from loraflow.pipelines.base import RenderSettings


def first_last_inputs(pipe: Any, first: Image.Image, last: np.ndarray, settings: RenderSettings,
                      generator: torch.Generator) -> dict[str, Any]:
    """The pipeline's `latents` and `callback_on_step_end` for a render from `first` to `last` (uint8 (H, W, 3) at
    the render size). `generator` is the render's: the noise and the first frame's latent are drawn from it as the
    pipeline draws them, then the last frame's latent (a sample, as the pipeline samples the first frame's)."""
    if last.shape != (settings.height, settings.width, 3) or last.dtype != np.uint8:
        raise ValueError(f"the last conditioning frame must be uint8 {(settings.height, settings.width, 3)}; "
                         f"got {last.dtype} {last.shape}")
    channels = pipe.transformer.config.in_visual_dim
    latents = pipe.prepare_latents(first, 1, channels, settings.height, settings.width, settings.num_frames,
                                   pipe.transformer.dtype, pipe._execution_device, generator)
    pixels = pipe.video_processor.preprocess(Image.fromarray(last), height=settings.height, width=settings.width)
    with torch.no_grad():
        encoded = pipe.vae.encode(pixels.to(pipe._execution_device, pipe.vae.dtype).unsqueeze(2)).latent_dist
    clean = (encoded.sample(generator=generator) * pipe.vae.config.scaling_factor).permute(0, 2, 3, 4, 1)  # 1,1,h,w,C
    latents[:, -1:, :, :, :channels] = clean
    latents[:, -1, :, :, -1] = 1  # the mask channel (visual_cond checkpoints; velocity refuses others)

    def keep_last(pipe: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors["latents"][:, -1:, :, :, :channels] = clean
        return tensors

    return {"latents": latents, "callback_on_step_end": keep_last}
