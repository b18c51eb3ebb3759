"""Bucket sizes a NABLA checkpoint of Kandinsky 5 can train (the spec's `bucket_rule`).

diffusers' Kandinsky 5 transformer groups the visual tokens of each latent frame into blocks of 8 x 8 patches
(`fractal_flatten`, pixel_size 8), the 64-token blocks of NABLA's flex-attention BlockMask, and the pipeline's STA
mask counts H // 8 x W // 8 blocks of the patch grid (`get_sparse_params`): a patch grid that 8 does not divide fails
in a reshape, in training as in rendering. musubi-tuner resizes cached latents to fit (`--nabla_resize`); loraflow
sizes the buckets before anything is cached, so the frames are cropped once, at the size trained: both sides a
multiple of the family's (VAE x patch) times 8. No torch: planning reads only config.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraflow.pipelines.flavours import BucketBlocks, Flavour

NABLA_BLOCK = 8  # patches per block side (diffusers' fractal_flatten)
NABLA_BLOCKS = BucketBlocks(NABLA_BLOCK, "NABLA attention", f"NABLA's {NABLA_BLOCK}x{NABLA_BLOCK}-patch blocks",
                            f"NABLA's {NABLA_BLOCK}-patch blocks")


def nabla_buckets(flavour: Flavour, transformer_config: Mapping[str, Any]) -> BucketBlocks | None:
    """NABLA's blocks where the transformer, as the flavour runs it (its mode's keys over the checkpoint's config:
    Kandinsky 5 Pro SD/HD), attends with NABLA; None for flash attention."""
    return NABLA_BLOCKS if transformer_config.get("attention_type") == "nabla" else None
