"""Parts of the tiny checkpoints (`loraflow.demo.tiny`) kept apart to hold tiny.py under 500 lines: the SigLIP
image encoder of HunyuanVideo 1.5 i2v, CREPA's DINOv2 teacher, and listing extra components (and the recipe) in
model_index.json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

IMAGE_DIM = 32  # hidden size of the tiny SigLIP vision tower
RECIPE_KEY = "_loraflow_tiny_recipe"  # model_index.json: what build_tiny built the folder by (builder, seed)


def siglip_image_encoder() -> tuple[SiglipVisionModel, SiglipImageProcessorPil]:
    """SigLIP so400m/14-384 geometry (384 px, patch 14 -> 27 x 27 = 729 tokens, the count the
    HunyuanVideo 1.5 t2v pipeline hard-codes for its all-zero image embeds) at width 32."""
    config = SiglipVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=2 * IMAGE_DIM,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=384,
        patch_size=14,
    )
    # The PIL backend: the default SiglipImageProcessor needs torchvision and otherwise falls back
    # to this class with a warning.
    processor = SiglipImageProcessorPil(
        size={"height": 384, "width": 384}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    return SiglipVisionModel(config).eval(), processor


def index_extras(folder: Path, extras: Mapping[str, object], recipe: Mapping[str, object]) -> None:
    """List extra components in folder/model_index.json as a hub checkpoint lists them (library, class), so the
    pipeline that takes them loads the folder alone (HunyuanVideo15ImageToVideoPipeline.from_pretrained(d)); a
    pipeline that does not take them ignores them with a warning, as it would on the hub checkpoint. Mark the recipe
    `build_tiny` built the folder by under RECIPE_KEY (diffusers' loaders skip keys that start with "_")."""
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, component in extras.items():
        index[name] = [type(component).__module__.split(".")[0], type(component).__name__]
    index[RECIPE_KEY] = dict(recipe)
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def tiny_dinov2(out_dir: str | Path, seed: int = 0) -> Path:
    """A DINOv2 image encoder (CREPA's teacher) at width 16, patch 4, saved with save_pretrained: a folder
    `crepa_encoder_path` can name, loaded with the real from_pretrained."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    config = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          patch_size=4, image_size=16)
    Dinov2Model(config).eval().save_pretrained(out_dir)
    return Path(out_dir)
