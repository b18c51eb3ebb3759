"""Kandinsky 5.0 Video's plain data: flavours and names. The family itself is `kandinsky5_video` (torch, diffusers),
imported only when a stage needs it.

Repository ids: SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_video/model.py), of which the kandinskylab
"Diffusers" collections list the Lite t2v and Pro sft 5s t2v/i2v repos; i2v-pro-pretrain-5s has no published
checkpoint in any layout (no default: the config must name a folder)."""

from __future__ import annotations

from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour


def _flavour(name: str, seconds: int, shift: float, repo: str | None) -> Flavour:
    task = name.split("-")[0]
    # i2v: the image's latent replaces latent frame 0 (Kandinsky5I2VPipeline.prepare_latents), one clean frame
    return Flavour(name, task, 24.0, 24 * seconds + 1, (512, 768), shift, 5.0, TWO_ENCODER_PARTS, int(task == "i2v"),
                   repo and f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers")


SPEC = FamilySpec(
    name="kandinsky5-video",
    description="Kandinsky 5.0 Video Lite and Pro, text-to-video and image-to-video",
    flavours=(
        _flavour("t2v-lite-sft-5s", 5, 10.0, "T2V-Lite-sft-5s"),
        _flavour("t2v-lite-sft-10s", 10, 10.0, "T2V-Lite-sft-10s"),
        _flavour("t2v-lite-pretrain-5s", 5, 10.0, "T2V-Lite-pretrain-5s"),
        _flavour("t2v-lite-pretrain-10s", 10, 10.0, "T2V-Lite-pretrain-10s"),
        _flavour("t2v-pro-sft-5s-hd", 5, 5.0, "T2V-Pro-sft-5s"),
        _flavour("t2v-pro-sft-10s-hd", 10, 5.0, "T2V-Pro-sft-10s"),
        _flavour("t2v-pro-pretrain-5s-hd", 5, 5.0, "T2V-Pro-pretrain-5s"),
        _flavour("t2v-pro-pretrain-10s-hd", 10, 5.0, "T2V-Pro-pretrain-10s"),
        _flavour("i2v-lite-5s", 5, 5.0, "I2V-Lite-5s"),
        _flavour("i2v-pro-sft-5s", 5, 5.0, "I2V-Pro-sft-5s"),
        _flavour("i2v-pro-pretrain-5s", 5, 5.0, None),
    ),
    default_flavour="t2v-lite-sft-5s",
    spatial_multiple=16,  # VAE 8x, patch 2x2
    vae_temporal_factor=4,
    module="loraflow.pipelines.kandinsky5.video",
    simpletuner_names=("kandinsky5-video",),
)
