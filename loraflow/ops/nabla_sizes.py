"""Bucket sizes a NABLA checkpoint can train (Kandinsky 5's 10 s video transformers: `attention_type: nabla`).

diffusers' Kandinsky 5 transformer groups the visual tokens of each latent frame into blocks of 8 x 8 patches
(`fractal_flatten`, pixel_size 8), the 64-token blocks of NABLA's flex-attention BlockMask, and the pipeline's STA
mask counts H // 8 x W // 8 blocks of the patch grid (`get_sparse_params`): a patch grid that 8 does not divide fails
in a reshape, in training as in rendering. musubi-tuner resizes cached latents to fit (`--nabla_resize`); loraflow
sizes the buckets before anything is cached, so the frames are cropped once, at the size trained: both sides a
multiple of the family's (VAE x patch) times 8. No torch: planning reads only config.json.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.pipelines.sources import ModelSource, as_source

if TYPE_CHECKING:
    from loraflow.pipelines import FamilyPlan
    from loraflow.pipelines.base import ModelFamily

NABLA_BLOCK = 8  # patches per block side (diffusers' fractal_flatten)


@cache
def uses_nabla(model: ModelSource | str | Path, flavour: str) -> bool:
    """Whether the checkpoint's transformer attends with NABLA: its config.json on disk, else (not downloaded yet)
    the flavour's released config, which the download will bring."""
    path = as_source(model).folder("transformer") / "config.json"
    if path.is_file():
        return json.loads(path.read_text()).get("attention_type") == "nabla"
    from loraflow.pipelines.released import FLAVOURS, released_config

    return flavour in FLAVOURS and released_config(flavour, "transformer").get("attention_type") == "nabla"


def bucket_multiple(family: FamilyPlan | ModelFamily, model: ModelSource | str | Path) -> int:
    """The pixel multiple of bucket sides: the family's, times NABLA's block side for a NABLA checkpoint."""
    return family.spatial_multiple * (NABLA_BLOCK if uses_nabla(model, family.flavour.name) else 1)


def nabla_note(family: FamilyPlan | ModelFamily, model: ModelSource | str | Path) -> str:
    """`loraflow check`'s line on why the buckets are sized as they are ("" for a checkpoint without NABLA)."""
    multiple = bucket_multiple(family, model)
    if multiple == family.spatial_multiple:
        return ""
    return (f"NABLA attention (this checkpoint's transformer): bucket sides are multiples of {multiple} px, "
            f"{family.spatial_multiple} (VAE x patch) x {NABLA_BLOCK} (NABLA's {NABLA_BLOCK}x{NABLA_BLOCK}-patch "
            f"blocks); a `resolution` off it is rounded to the nearest")
