"""Kandinsky 5.0 Image's tiny checkpoints (`tiny(flavour)`, for `loraflow.demo.tiny.build_tiny`): the t2i pipeline's,
and i2i's own (16 + 16 + 1 input channels, the Qwen2-VL processor as its tokenizer), both with Flux's 2D VAE."""

from __future__ import annotations

import functools
from collections.abc import Callable

from diffusers import AutoencoderKL, Kandinsky5I2IPipeline, Kandinsky5T2IPipeline

from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.kandinsky5.image.spec import SPEC
from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_pipeline
from loraflow.pipelines.tiny_parts import TinyPipeline, recipe_name


def flux_vae() -> AutoencoderKL:
    """Flux-style 2D VAE: 16 latent channels, 4 blocks (3 downsamples = 8x).

    Scaling/shift are Flux's real values; the K5 image pipelines divide by scaling only.
    """
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    """The tiny checkpoint a flavour loads: i2i has its own."""
    pipeline, variant = (Kandinsky5I2IPipeline, "i2i") if flavour.edits_image else (Kandinsky5T2IPipeline, "t2i")
    build = functools.partial(kandinsky5_pipeline, pipeline, visual_cond=flavour.edits_image, vae=flux_vae, shift=1.0,
                              vl_tokenizer=flavour.edits_image)
    return pipeline, recipe_name(SPEC.name, variant, 1), build
