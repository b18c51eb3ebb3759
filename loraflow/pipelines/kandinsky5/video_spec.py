"""Kandinsky 5.0 Video's plain data: flavours and names. The family itself is `kandinsky5_video` (torch, diffusers),
imported only when a stage needs it.

Repository ids: SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_video/model.py), of which the kandinskylab
"Diffusers" collections list the Lite t2v and Pro sft 5s t2v/i2v repos; i2v-pro-pretrain-5s has no published
checkpoint in any layout (no default: the config must name a folder). The no-CFG and distilled Lite repos are in the
same collections (SimpleTuner skips them); their steps and guidance are the original repository's configs
(ai-forever/Kandinsky-5 configs/config_{5s,10s}_{nocfg,distil}.yaml: num_steps 50 / 16, guidance_weight 1.0), their
transformers the Lite sft ones' (same dit_params). `peer_names` are musubi-tuner's `--task` names
(src/musubi_tuner/kandinsky5/configs.py)."""

from __future__ import annotations

from loraflow.pipelines.flavours import CLIP_TOKENIZERS, QWEN_TOKENIZERS, TWO_ENCODER_PARTS, FamilySpec, Flavour

# The classes a Kandinsky 5 checkpoint's model_index.json may name (`Flavour.classes`): what diffusers'
# Kandinsky5{T2V,I2V,T2I,I2I}Pipeline annotate (tests/pipelines/test_families.py reads them); the Video VAE here,
# the Image one in image_spec. The tokenizer is annotated as the Qwen2-VL processor; the tiny checkpoints save the
# plain tokenizer the processor wraps (REFERENCE.md: the processor needs torchvision).
KANDINSKY5_CLASSES = {
    "transformer": ("diffusers.Kandinsky5Transformer3DModel",),
    "text_encoder": ("transformers.Qwen2_5_VLForConditionalGeneration",),
    "tokenizer": ("transformers.Qwen2VLProcessor", *QWEN_TOKENIZERS),
    "text_encoder_2": ("transformers.CLIPTextModel",),
    "tokenizer_2": CLIP_TOKENIZERS,
    "scheduler": ("diffusers.FlowMatchEulerDiscreteScheduler",),
}
VIDEO_CLASSES = {**KANDINSKY5_CLASSES, "vae": ("diffusers.AutoencoderKLHunyuanVideo",)}


def _flavour(name: str, seconds: int, shift: float, repo: str | None, musubi: str = "", steps: int = 30,
             guidance: float = 5.0) -> Flavour:
    task = name.split("-")[0]
    # i2v: the image's latent replaces latent frame 0 (Kandinsky5I2VPipeline.prepare_latents), one clean frame
    return Flavour(name, task, 24.0, 24 * seconds + 1, (512, 768), shift, guidance, TWO_ENCODER_PARTS,
                   int(task == "i2v"), repo and f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers", steps=steps,
                   peer_names=(f"k5-{musubi}",) if musubi else (), classes=VIDEO_CLASSES)


def _distilled(kind: str, seconds: int, steps: int) -> Flavour:
    """A Lite t2v release with guidance distilled in (no CFG); `kind` names it in its repository id."""
    musubi = f"lite-t2v-{seconds}s-{'nocfg' if kind == 'nocfg' else 'distil'}-sd"
    return _flavour(f"t2v-lite-{kind}-{seconds}s", seconds, 10.0, f"T2V-Lite-{kind}-{seconds}s", musubi, steps, 1.0)


SPEC = FamilySpec(
    name="kandinsky5-video",
    description="Kandinsky 5.0 Video Lite and Pro, text-to-video and image-to-video, and the distilled Lite",
    flavours=(
        _flavour("t2v-lite-sft-5s", 5, 10.0, "T2V-Lite-sft-5s", "lite-t2v-5s-sd"),
        _flavour("t2v-lite-sft-10s", 10, 10.0, "T2V-Lite-sft-10s", "lite-t2v-10s-sd"),
        _flavour("t2v-lite-pretrain-5s", 5, 10.0, "T2V-Lite-pretrain-5s", "lite-t2v-5s-pretrain-sd"),
        _flavour("t2v-lite-pretrain-10s", 10, 10.0, "T2V-Lite-pretrain-10s", "lite-t2v-10s-pretrain-sd"),
        _flavour("t2v-pro-sft-5s-hd", 5, 5.0, "T2V-Pro-sft-5s"),
        _flavour("t2v-pro-sft-10s-hd", 10, 5.0, "T2V-Pro-sft-10s"),
        _flavour("t2v-pro-pretrain-5s-hd", 5, 5.0, "T2V-Pro-pretrain-5s"),
        _flavour("t2v-pro-pretrain-10s-hd", 10, 5.0, "T2V-Pro-pretrain-10s"),
        _flavour("i2v-lite-5s", 5, 5.0, "I2V-Lite-5s", "lite-i2v-5s-sd"),
        _flavour("i2v-pro-sft-5s", 5, 5.0, "I2V-Pro-sft-5s"),
        _flavour("i2v-pro-pretrain-5s", 5, 5.0, None),
        _distilled("nocfg", 5, 50),
        _distilled("nocfg", 10, 50),
        _distilled("distilled16steps", 5, 16),
        _distilled("distilled16steps", 10, 16),
    ),
    default_flavour="t2v-lite-sft-5s",
    spatial_multiple=16,  # VAE 8x, patch 2x2
    vae_temporal_factor=4,
    module="loraflow.pipelines.kandinsky5.video",
    simpletuner_names=("kandinsky5-video",),
)
