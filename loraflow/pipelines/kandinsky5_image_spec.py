"""Kandinsky 5.0 Image's plain data: flavours and names. The family itself is `kandinsky5_image` (torch, diffusers),
imported only when a stage needs it."""

from __future__ import annotations

from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour


def _flavour(name: str) -> Flavour:
    # One frame; fps only matters when frames are sampled from videos. Shift 1.0 is the seed doc's default.
    return Flavour(name, name.split("-")[0], 24.0, 1, (1024, 1024), 1.0, 5.0, TWO_ENCODER_PARTS)


SPEC = FamilySpec(
    name="kandinsky5-image",
    description="Kandinsky 5.0 Image Lite, text-to-image and image-to-image editing",
    flavours=tuple(map(_flavour, ["t2i-lite-sft", "t2i-lite-pretrain", "i2i-lite-sft", "i2i-lite-pretrain"])),
    default_flavour="t2i-lite-sft",
    module="loraflow.pipelines.kandinsky5_image",
    simpletuner_names=("kandinsky5-image",),
)
