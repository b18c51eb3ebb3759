"""Kandinsky 5.0 Video's tiny checkpoint (`tiny(flavour)`, for `loraflow.demo.tiny.build_tiny`): every flavour loads
the t2v pipeline's, with HunyuanVideo's VAE, as the released checkpoints have. The demo's pre-trained tiny world of the
same layout is `loraflow.demo.tiny_world`."""

from __future__ import annotations

import functools
from collections.abc import Callable

from diffusers import AutoencoderKLHunyuanVideo, Kandinsky5T2VPipeline

from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_pipeline
from loraflow.pipelines.kandinsky5.video.spec import SPEC
from loraflow.pipelines.tiny_parts import TinyPipeline, recipe_name


def hunyuan_video_vae() -> AutoencoderKLHunyuanVideo:
    """HunyuanVideo VAE: 4 blocks are the minimum for 8x spatial + 4x temporal compression."""
    return AutoencoderKLHunyuanVideo(
        latent_channels=16,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()


def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    """Every flavour loads one tiny checkpoint: the t2v pipeline's."""
    build = functools.partial(kandinsky5_pipeline, Kandinsky5T2VPipeline, visual_cond=True, vae=hunyuan_video_vae,
                              shift=10.0)
    return Kandinsky5T2VPipeline, recipe_name(SPEC.name, "t2v", 1), build
