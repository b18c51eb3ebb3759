"""Kandinsky 5.0 Video's plain data: flavours and names. The family itself is `kandinsky5_video` (torch, diffusers),
imported only when a stage needs it."""

from __future__ import annotations

from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour


def _flavour(name: str, seconds: int, shift: float) -> Flavour:
    task = name.split("-")[0]
    # i2v: the image's latent replaces latent frame 0 (Kandinsky5I2VPipeline.prepare_latents), one clean frame
    return Flavour(name, task, 24.0, 24 * seconds + 1, (512, 768), shift, 5.0, TWO_ENCODER_PARTS, int(task == "i2v"))


SPEC = FamilySpec(
    name="kandinsky5-video",
    description="Kandinsky 5.0 Video Lite and Pro, text-to-video and image-to-video",
    flavours=(
        _flavour("t2v-lite-sft-5s", 5, 10.0),
        _flavour("t2v-lite-sft-10s", 10, 10.0),
        _flavour("t2v-lite-pretrain-5s", 5, 10.0),
        _flavour("t2v-lite-pretrain-10s", 10, 10.0),
        _flavour("t2v-pro-sft-5s-hd", 5, 5.0),
        _flavour("t2v-pro-sft-10s-hd", 10, 5.0),
        _flavour("t2v-pro-pretrain-5s-hd", 5, 5.0),
        _flavour("t2v-pro-pretrain-10s-hd", 10, 5.0),
        _flavour("i2v-lite-5s", 5, 5.0),
        _flavour("i2v-pro-sft-5s", 5, 5.0),
        _flavour("i2v-pro-pretrain-5s", 5, 5.0),
    ),
    default_flavour="t2v-lite-sft-5s",
    module="loraflow.pipelines.kandinsky5_video",
    simpletuner_names=("kandinsky5-video",),
)
