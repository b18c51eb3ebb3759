"""Kandinsky 5.0 Video's plain data: flavours and names, each number with its citation
(loraflow/pipelines/citations.py). The adapter is `family.py` beside it and the tiny checkpoint `tiny.py` (torch,
diffusers), imported only when needed.

Repository ids: SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_video/model.py), of which the kandinskylab
"Diffusers" collections list the Lite t2v and Pro sft 5s t2v/i2v repos; i2v-pro-pretrain-5s has no published
checkpoint in any layout (no default: the config must name a folder). The no-CFG and distilled Lite repos are in the
same collections (SimpleTuner skips them), their transformers the Lite sft ones' (same dit_params). The Pro distilled
repos are named by FastVideo's registry; the original repository has not published them (its README's todo list).

Pro's SD and HD modes (the original's configs/k5_pro_*_sd.yaml and *_hd.yaml, musubi-tuner's `k5-pro-*-sd` / `-hd`
tasks): the same weights, with flash attention (10 s: NABLA at P 0.9) at 512x768, or NABLA (P 0.8; 10 s: 0.7) at the
1024-class sizes. The `-sd` and `-hd` flavours (`i2v-pro-sft-5s` is HD, as the guide names it) set their mode's
attention over the checkpoint's config (`Flavour.transformer_config`). `peer_names` are musubi-tuner's `--task` names
(src/musubi_tuner/kandinsky5/configs.py)."""

from __future__ import annotations

from loraflow.pipelines.citations import (
    K5_FPS,
    K5_HD_SIZE,
    K5_OLD_STEPS,
    K5_SD_SIZE,
    K5_VIDEO_DEFAULT_SCALE,
    K5_VIDEO_TEXT,
    cite,
)
from loraflow.pipelines.flavours import CLIP_TOKENIZERS, QWEN_TOKENIZERS, TWO_ENCODER_PARTS, FamilySpec, Flavour
from loraflow.pipelines.kandinsky5.nabla_buckets import nabla_buckets

# The classes a Kandinsky 5 checkpoint's model_index.json may name (`Flavour.classes`): what diffusers'
# Kandinsky5{T2V,I2V,T2I,I2I}Pipeline annotate (tests/pipelines/test_families.py reads them); the Video VAE here,
# the Image one in image/spec.py. The tokenizer is annotated as the Qwen2-VL processor; the tiny checkpoints save the
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

TEXT_TOKENS = 256  # K5_VIDEO_TEXT: every original video config's Qwen max_length

# The attention blocks of the original Pro configs, as transformer config keys (diffusers' names)
_NABLA = {"attention_type": "nabla", "attention_method": "topcdf", "attention_add_sta": True, "attention_wT": 11,
          "attention_wW": 3, "attention_wH": 3}
_FLASH = {"attention_type": "flash", "attention_method": None, "attention_add_sta": None, "attention_P": None,
          "attention_wT": None, "attention_wW": None, "attention_wH": None}
PRO_MODES = {  # (mode, seconds) -> (attention, its citation)
    ("sd", 5): (_FLASH, "configs/k5_pro_t2v_5s_sft_sd.yaml, k5_pro_i2v_5s_sft_sd.yaml attention.type flash"),
    ("hd", 5): ({**_NABLA, "attention_P": 0.8}, "configs/k5_pro_t2v_5s_sft_hd.yaml, k5_pro_i2v_5s_sft_hd.yaml "
                "attention: nabla, P 0.8, wT 11, wW 3, wH 3, add_sta true, method topcdf"),
    ("sd", 10): ({**_NABLA, "attention_P": 0.9}, "configs/k5_pro_t2v_10s_sft_sd.yaml attention: nabla, P 0.9, "
                 "wT 11, wW 3, wH 3, add_sta true, method topcdf"),
    ("hd", 10): ({**_NABLA, "attention_P": 0.7}, "configs/k5_pro_t2v_10s_sft_hd.yaml attention: nabla, P 0.7, "
                 "wT 11, wW 3, wH 3, add_sta true, method topcdf"),
}
_PRO_TRAINING_SHIFT = cite("loraflow", "5.0, the Pro default before issue 44 (then also its render shift), kept so "
                                       "runs train as before; musubi-tuner's docs/kandinsky5.md trains "
                                       "k5-pro-t2v-5s-sd with --discrete_flow_shift 5.0")
_LITE_TRAINING_SHIFT = cite("loraflow", "the Lite default before issue 44 (then also its render shift), kept so runs "
                                        "train as before: no release or guide states a training shift for it")


def _yaml(name: str, key: str, value: object) -> str:
    return cite("kandinsky-5", f"configs/{name}.yaml {key} {value}")


def _flavour(name: str, seconds: int, shift: float, repo: str | None, musubi: str = "", steps: int = 30,
             guidance: float = 5.0, *, yaml: str, shift_from: str, training_shift: float, training_from: str,
             mode: str = "", steps_from: str = K5_OLD_STEPS) -> Flavour:
    """One release; `yaml` names its original config (configs/<yaml>.yaml), `mode` Pro's "sd" or "hd"."""
    task = name.split("-")[0]
    attention, attention_from = PRO_MODES[(mode, seconds)] if mode else ({}, "")
    sources = {
        "fps": K5_FPS,
        "num_frames": cite("derived", f"{seconds} s at 24 fps + the first frame: {24 * seconds + 1}"),
        "size": K5_HD_SIZE if mode == "hd" else K5_SD_SIZE,
        "flow_shift": shift_from, "training_shift": training_from,
        "guidance": _yaml(yaml, "model.guidance_weight", guidance), "steps": steps_from,
        "text_tokens": K5_VIDEO_TEXT,
        # i2v: the image's latent replaces latent frame 0 (Kandinsky5I2VPipeline.prepare_latents), one clean frame
        "conditioning_frames": cite("diffusers 0.42.1", "pipeline_kandinsky_i2v.py: the image latent is frame 0, "
                                                        "frames 1.. are stepped") if task == "i2v" else
        cite("derived", "t2v: no frame is given"),
        **({"attention": cite("kandinsky-5", attention_from)} if mode else {}),
    }
    return Flavour(name, task, 24.0, 24 * seconds + 1, (768, 1280) if mode == "hd" else (512, 768), shift, guidance,
                   TWO_ENCODER_PARTS, int(task == "i2v"), repo and f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers",
                   steps=steps, peer_names=(f"k5-{musubi}",) if musubi else (), training_shift=training_shift,
                   text_tokens=TEXT_TOKENS, transformer_config=tuple(attention.items()),
                   sources=tuple(sources.items()), classes=VIDEO_CLASSES)


def _lite(name: str, seconds: int, repo: str, musubi: str, yaml: str, scale: float | None) -> Flavour:
    """A Lite t2v/i2v release at its yaml's scheduler_scale (None: the yaml gives none, the pipeline's 10)."""
    shift_from = K5_VIDEO_DEFAULT_SCALE if scale is None else _yaml(yaml, "metrics.scheduler_scale", scale)
    return _flavour(name, seconds, scale or 10.0, repo, musubi, yaml=yaml, shift_from=shift_from,
                    training_shift=5.0 if name.startswith("i2v") else 10.0, training_from=_LITE_TRAINING_SHIFT)


def _distilled(kind: str, seconds: int, steps: int, scale: float | None) -> Flavour:
    """A Lite t2v release with guidance distilled in (no CFG); `kind` names it in its repository id."""
    musubi = f"lite-t2v-{seconds}s-{'nocfg' if kind == 'nocfg' else 'distil'}-sd"
    yaml = f"k5_lite_t2v_{seconds}s_{'nocfg' if kind == 'nocfg' else 'distil'}_sd"
    if scale is None:
        shift_from = K5_VIDEO_DEFAULT_SCALE
    elif kind != "nocfg" and seconds == 5:  # the one yaml whose scale differs from the pipeline's default
        shift_from = cite("kandinsky-5", f"configs/{yaml}.yaml metrics.scheduler_scale 5 (and musubi-tuner's "
                                         "k5-lite-t2v-5s-distil-sd 5.0), chosen over t2v_pipeline.py's default 10.0: "
                                         "the value written for this checkpoint, not one shared by all")
    else:
        shift_from = _yaml(yaml, "metrics.scheduler_scale", scale)
    return _flavour(f"t2v-lite-{kind}-{seconds}s", seconds, scale or 10.0, f"T2V-Lite-{kind}-{seconds}s", musubi,
                    steps, 1.0, yaml=yaml, shift_from=shift_from, training_shift=10.0,
                    training_from=_LITE_TRAINING_SHIFT, steps_from=_yaml(yaml, "model.num_steps", steps))


def _pro(name: str, seconds: int, repo: str | None, mode: str, musubi: str = "") -> Flavour:
    """A Pro release in its SD or HD mode; i2v HD renders at scale 5 (its yaml), the others at the default 10."""
    task = name.split("-")[0]
    yaml = f"k5_pro_{task}_{seconds}s_sft_{mode}"
    i2v_scale = {"hd": 5.0, "sd": 10.0}[mode] if task == "i2v" else None
    shift_from = _yaml(yaml, "metrics.scheduler_scale", i2v_scale) if i2v_scale else K5_VIDEO_DEFAULT_SCALE
    return _flavour(name, seconds, i2v_scale or 10.0, repo, musubi, yaml=yaml, shift_from=shift_from,
                    training_shift=5.0, training_from=_PRO_TRAINING_SHIFT, mode=mode)


def _pro_distilled(task: str) -> Flavour:
    """Kandinsky-5.0-{T2V,I2V}-Pro-distilled-5s-Diffusers: 16 steps without CFG in FastVideo's presets; the original
    repository has not released them (README: "distil 16 steps" unchecked for Pro), so no original config confirms
    these numbers, and their transformer config (mode) is the checkpoint's own: before download, the Pro 5 s file."""
    preset = f"fastvideo/pipelines/basic/kandinsky5/presets.py KANDINSKY5_{task.upper()}_PRO_DISTILLED_5S"
    sources = {"fps": cite("FastVideo", f"{preset} fps 24"),
               "num_frames": cite("FastVideo", f"{preset} num_frames 121"),
               "size": cite("FastVideo", f"{preset} height 512, width 768"),
               "flow_shift": cite("FastVideo", "fastvideo/configs/pipelines/kandinsky5.py Kandinsky5T2VConfig "
                                               "flow_shift 5.0 (the checkpoint's scheduler_config.json wins when "
                                               "downloaded)"),
               "training_shift": _PRO_TRAINING_SHIFT,
               "guidance": cite("FastVideo", f"{preset} guidance_scale 1.0"),
               "steps": cite("FastVideo", f"{preset} num_inference_steps 16"), "text_tokens": K5_VIDEO_TEXT,
               "conditioning_frames": cite("diffusers 0.42.1", "pipeline_kandinsky_i2v.py: the image latent is "
                                                               "frame 0") if task == "i2v" else
               cite("derived", "t2v: no frame is given")}
    return Flavour(f"{task}-pro-distilled-5s", task, 24.0, 121, (512, 768), 5.0, 1.0, TWO_ENCODER_PARTS,
                   int(task == "i2v"), f"kandinskylab/Kandinsky-5.0-{task.upper()}-Pro-distilled-5s-Diffusers",
                   steps=16, training_shift=5.0, text_tokens=TEXT_TOKENS, sources=tuple(sources.items()),
                   classes=VIDEO_CLASSES)


SPEC = FamilySpec(
    name="kandinsky5-video",
    description="Kandinsky 5.0 Video Lite and Pro (SD and HD modes), text-to-video and image-to-video, and the "
                "distilled releases",
    flavours=(
        _lite("t2v-lite-sft-5s", 5, "T2V-Lite-sft-5s", "lite-t2v-5s-sd", "k5_lite_t2v_5s_sft_sd", None),
        _lite("t2v-lite-sft-10s", 10, "T2V-Lite-sft-10s", "lite-t2v-10s-sd", "k5_lite_t2v_10s_sft_sd", 10.0),
        _lite("t2v-lite-pretrain-5s", 5, "T2V-Lite-pretrain-5s", "lite-t2v-5s-pretrain-sd",
              "k5_lite_t2v_5s_pretrain_sd", None),
        _lite("t2v-lite-pretrain-10s", 10, "T2V-Lite-pretrain-10s", "lite-t2v-10s-pretrain-sd",
              "k5_lite_t2v_10s_pretrain_sd", 10.0),
        _lite("i2v-lite-5s", 5, "I2V-Lite-5s", "lite-i2v-5s-sd", "k5_lite_i2v_5s_sft_sd", 10.0),
        _pro("t2v-pro-sft-5s-hd", 5, "T2V-Pro-sft-5s", "hd", "pro-t2v-5s-hd"),
        _pro("t2v-pro-sft-10s-hd", 10, "T2V-Pro-sft-10s", "hd", "pro-t2v-10s-hd"),
        _pro("t2v-pro-pretrain-5s-hd", 5, "T2V-Pro-pretrain-5s", "hd"),
        _pro("t2v-pro-pretrain-10s-hd", 10, "T2V-Pro-pretrain-10s", "hd"),
        _pro("t2v-pro-sft-5s-sd", 5, "T2V-Pro-sft-5s", "sd", "pro-t2v-5s-sd"),
        _pro("t2v-pro-sft-10s-sd", 10, "T2V-Pro-sft-10s", "sd", "pro-t2v-10s-sd"),
        _pro("t2v-pro-pretrain-5s-sd", 5, "T2V-Pro-pretrain-5s", "sd"),
        _pro("t2v-pro-pretrain-10s-sd", 10, "T2V-Pro-pretrain-10s", "sd"),
        _pro("i2v-pro-sft-5s", 5, "I2V-Pro-sft-5s", "hd", "pro-i2v-5s-hd"),
        _pro("i2v-pro-sft-5s-sd", 5, "I2V-Pro-sft-5s", "sd", "pro-i2v-5s-sd"),
        _pro("i2v-pro-pretrain-5s", 5, None, "hd"),
        _distilled("nocfg", 5, 50, None),
        _distilled("nocfg", 10, 50, 10.0),
        _distilled("distilled16steps", 5, 16, 5.0),
        _distilled("distilled16steps", 10, 16, 10.0),
        _pro_distilled("t2v"),
        _pro_distilled("i2v"),
    ),
    default_flavour="t2v-lite-sft-5s",
    spatial_multiple=16,  # VAE 8x, patch 2x2
    vae_temporal_factor=4,
    prompt_templates=("original", "diffusers"),  # kandinsky5/common.py: the original's, diffusers 0.42.1's
    module="loraflow.pipelines.kandinsky5.video.family",
    tiny_module="loraflow.pipelines.kandinsky5.video.tiny",
    simpletuner_names=("kandinsky5-video", "kandinsky5_video"),
    ffn_classes=("Kandinsky5FeedForward",),  # diffusers transformer_kandinsky.py
    bucket_rule=nabla_buckets,  # the transformer's NABLA blocks, where its config attends so
)
