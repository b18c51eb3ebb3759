"""Kandinsky 5.0 Image's plain data: flavours and names. The family itself is `kandinsky5_image` (torch, diffusers),
imported only when a stage needs it.

Repository ids: SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_image/model.py), all four listed in the
kandinskylab "Diffusers" collection."""

from __future__ import annotations

from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour
from loraflow.pipelines.kandinsky5.video_spec import KANDINSKY5_CLASSES

IMAGE_CLASSES = {**KANDINSKY5_CLASSES, "vae": ("diffusers.AutoencoderKL",)}  # Flux's 2D VAE


def _flavour(name: str, repo: str) -> Flavour:
    # One frame; fps only matters when frames are sampled from videos. Shift 1.0 is the seed doc's default.
    return Flavour(name, name.split("-")[0], 24.0, 1, (1024, 1024), 1.0, 5.0, TWO_ENCODER_PARTS,
                   repo=f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers", classes=IMAGE_CLASSES)


SPEC = FamilySpec(
    name="kandinsky5-image",
    description="Kandinsky 5.0 Image Lite, text-to-image and image-to-image editing",
    flavours=(_flavour("t2i-lite-sft", "T2I-Lite-sft"), _flavour("t2i-lite-pretrain", "T2I-Lite-pretrain"),
              _flavour("i2i-lite-sft", "I2I-Lite-sft"), _flavour("i2i-lite-pretrain", "I2I-Lite-pretrain")),
    default_flavour="t2i-lite-sft",
    spatial_multiple=16,  # VAE 8x, patch 2x2
    vae_temporal_factor=1,  # a 2D VAE: every frame is its own image
    module="loraflow.pipelines.kandinsky5.image",
    simpletuner_names=("kandinsky5-image",),
    size_checked=("i2i-lite-sft", "i2i-lite-pretrain"),
)
