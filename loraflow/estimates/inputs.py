"""What an estimate is computed from before any weights: each component's config.json (`component_configs`, or
loraflow's copies of a released model's, `released_configs`) and the bucket (`configured_buckets`: what the datasets
ask for before there are clips; `largest_bucket`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.pipelines import FamilyPlanning
    from loraflow.pipelines.sources import ModelSource


def component_configs(folders: Mapping[str, Path]) -> dict[str, dict]:
    """Each model component's config.json (tokenizers and schedulers have none), read from its folder."""
    files = {name: Path(folder) / "config.json" for name, folder in folders.items()}
    return {name: json.loads(f.read_text()) for name, f in files.items() if f.is_file()}


def released_configs(config: LoraflowConfig) -> dict[str, str] | None:
    """{component: file in loraflow/pipelines/released/} for a config whose model is its flavour's own released
    repository (the default source), for estimates before it is downloaded; None for any other model."""
    from loraflow.pipelines import released

    flavour = config.flavour
    if config.pretrained_model_name_or_path != flavour.repo or flavour.name not in released.FLAVOURS:
        return None
    return {c: released.file_name(flavour.name, c) for c in flavour.components if c in released.FLAVOURS[flavour.name]}


def configured_buckets(config: LoraflowConfig, family: FamilyPlanning,
                       model: ModelSource | str) -> list[str]:
    """The bucket label each training dataset asks for before it has clips: a square source at its `resolution`
    (bucketed as `stages.clips.clips.plan_clips` buckets one: in multiples of 128 px for a NABLA transformer) and its
    `video.num_frames` (1 for an image dataset)."""
    from loraflow.pipelines import bucket_multiple
    from loraflow.stages.clips.buckets import bucket_label, bucket_size

    labels = []
    multiple = bucket_multiple(family, model)
    for d in config.training_datasets:
        height, width = bucket_size(d.resolution, d.resolution, d.resolution, multiple,
                                    d.resolution_type, d.crop_aspect, d.crop_aspect_buckets)
        labels.append(bucket_label(height, width, 1 if d.dataset_type == "image" else d.video.num_frames))
    return labels


def largest_bucket(labels: Iterable[str]) -> tuple[int, int, int]:
    """(frames, height, width) of the largest of these bucket labels (WIDTHxHEIGHT@FRAMES, `stages.clips.buckets`)."""
    sizes = [tuple(int(n) for n in label.replace("@", "x").split("x")) for label in labels]
    width, height, frames = max(sizes, key=lambda s: s[0] * s[1] * s[2])
    return frames, height, width
