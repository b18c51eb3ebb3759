"""Parts of the tiny Kandinsky 5 checkpoints that Video and Image share (each family's `tiny.py` assembles its own):
the DiT, the scheduler, the Qwen2.5-VL + CLIP text components, and the pipeline made of them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel

from loraflow.pipelines.tiny_parts import (
    TEXT_DIM,
    TinyPipeline,
    clip_text_encoder,
    clip_tokenizer,
    qwen_tokenizer,
    qwen_vl_encoder,
    qwen_vl_processor,
    rerandomise_zero_params,
)


def kandinsky5_transformer(visual_cond: bool, model_dim: int = 32) -> Kandinsky5Transformer3DModel:
    """Lite-style K5 DiT with 2 heads; head_dim = model_dim / 2 = the rope axes (4+6+6 at 32, 8+12+12 at 64).
    The demo's tiny world is 128 wide (`loraflow.demo.tiny_world.world_pipeline` says why); the others 32.

    ``visual_cond=True`` (video Lite/Pro, image-to-image) means 16 + 16 + 1 input channels; the T2I
    pipeline feeds plain 16-channel latents, so its checkpoint has ``visual_cond=False``.
    """
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=16,
        out_visual_dim=16,
        in_text_dim=TEXT_DIM,
        in_text_dim2=TEXT_DIM,
        time_dim=32,
        patch_size=(1, 2, 2),
        model_dim=model_dim,
        ff_dim=2 * model_dim,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(model_dim // 8, 3 * model_dim // 16, 3 * model_dim // 16),
        visual_cond=visual_cond,
        attention_type="regular",
    )
    rerandomise_zero_params(model, lambda name: "modulation" in name)
    return model.eval()


def kandinsky5_scheduler(shift: float) -> FlowMatchEulerDiscreteScheduler:
    """Plain flow-matching Euler with a static shift (K5 pipelines pass no mu/sigmas)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def kandinsky5_pipeline(pipeline: type, visual_cond: bool, vae: Callable[[], torch.nn.Module], shift: float,
                        vl_tokenizer: bool = False) -> TinyPipeline:
    """A tiny Kandinsky 5 pipeline: the Video, Image and Image i2i checkpoints differ only in these arguments (i2i:
    16 noisy + 16 source + 1 ones channels, and the VL processor as its tokenizer)."""
    pipe = pipeline(transformer=kandinsky5_transformer(visual_cond=visual_cond), vae=vae(),
                    scheduler=kandinsky5_scheduler(shift=shift), **kandinsky5_text_components(vl_tokenizer))
    return pipe, {}


def kandinsky5_text_components(vl_tokenizer: bool = False) -> dict[str, object]:
    """Qwen2.5-VL + CLIP encoders with their offline tokenizers, shared by all K5 pipelines; `vl_tokenizer`: the
    Qwen tokenizer inside the VL processor, as Kandinsky 5 i2i takes it."""
    tokenizer = qwen_tokenizer()
    tokenizer_2 = clip_tokenizer()
    return {
        "text_encoder": qwen_vl_encoder(tokenizer),
        "tokenizer": qwen_vl_processor(tokenizer) if vl_tokenizer else tokenizer,
        "text_encoder_2": clip_text_encoder(tokenizer_2),
        "tokenizer_2": tokenizer_2,
    }
