"""Kandinsky 6.0's plain data: flavours, repository ids and released-config names, each number with its citation
(loraflow/pipelines/citations.py). The family itself is `kandinsky6.family` (torch, diffusers), imported only when a
stage needs it.

Releases: Lite (3B) and Pro (29B), each as pretrain, sft and a π-Flow distilled checkpoint, 5 s of 24 fps video with
44.1 kHz sound, one checkpoint for text-to-video and image-to-video (kandinsky-6 README.md; diffusers' model table).
Repository ids: the original's checkpoint catalog (kandinsky-6 fork kandinsky/runtime/weights.py, `CHECKPOINTS`:
pro, pro-distill, pro-pretrain, lite, lite-distill, lite-pretrain), which diffusers@d641013's table lists too; the sft
checkpoints carry no stage in their id (Kandinsky-6.0-Pro-5s-Diffusers). Flavours are named by that catalog and the
task (lite-t2v, pro-distill-i2v).

Tasks (`visual_cond_scheme`, the original's name, kandinsky-6 fork kandinsky/pipeline/config.py GenerationConfig):
t2v gives the transformer no image (zero condition channels and mask); i2v is `tail_cond_first_frame`, the only
image scheme diffusers' Kandinsky6TI2VAPipeline runs: the image's latent is appended as one extra clean latent frame
after the generated ones, masked, with token type 1 and the rotary position of frame 0. Every generated frame is
noised and stepped, frame 0 included: no frame is given (`conditioning_frames` 0), and an i2v run can train batches
as t2v (`i2v_prob`). The original's other schemes ("pretrain": the image in the condition channels of frame 0,
"i2v": the image as frame 0) are not released through diffusers and are no flavour here.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from loraflow.pipelines.citations import cite
from loraflow.pipelines.flavours import CLIP_TOKENIZERS, QWEN_TOKENIZERS, TWO_ENCODER_PARTS, FamilySpec, Flavour

# Beside Kandinsky 5's parts: the audio VAE and its vocoder (`Kandinsky6TI2VAPipeline` optional components), which
# the audio stage and the renders with sound load
PARTS = (*TWO_ENCODER_PARTS, "audio_vae", "vocoder")
TEXT_TOKENS = 1024
# The classes a Kandinsky 6 checkpoint's model_index.json may name (`Flavour.classes`): what diffusers 0.42.1's
# Kandinsky6TI2VAPipeline annotates (tests/pipelines/test_sources.py reads them), the scheduler by stage: the π-Flow
# distilled checkpoints PiflowScheduler, the others FlowMatchEulerDiscreteScheduler (FastVideo K6's Models table). The
# tokenizer is annotated as the Qwen2.5-VL processor; the tiny checkpoint saves the plain tokenizer it wraps, as
# Kandinsky 5's does (and a folder converted for Kandinsky 5 names Kandinsky 5's processor).
CLASSES = {
    "transformer": ("diffusers.Kandinsky6Transformer3DModel",),
    "vae": ("diffusers.AutoencoderKLHunyuanVideo",),
    "text_encoder": ("transformers.Qwen2_5_VLForConditionalGeneration",),
    "tokenizer": ("transformers.Qwen2_5_VLProcessor", "transformers.Qwen2VLProcessor", *QWEN_TOKENIZERS),
    "text_encoder_2": ("transformers.CLIPTextModel",),
    "tokenizer_2": CLIP_TOKENIZERS,
    "audio_vae": ("diffusers.MMAudioVAE",),
    "vocoder": ("diffusers.MMAudioVocoder",),
}
SCHEDULERS = {"flow": ("diffusers.FlowMatchEulerDiscreteScheduler",), "piflow": ("diffusers.PiflowScheduler",)}
SIZES = {"lite": "Lite", "pro": "Pro"}
STAGES = ("sft", "pretrain", "distill")

_TABLE = "docs/source/en/api/pipelines/kandinsky6.md \"Available models\""
SOURCES = {
    "fps": cite("diffusers 0.42.1", "pipeline_kandinsky6_ti2va.py __call__ frame_rate=24.0 (the kandinsky-6 fork's "
                                    "pipeline/pipeline.py Kandinsky6Pipeline fps=24.0)"),
    "num_frames": cite("diffusers 0.42.1", "pipeline_kandinsky6_ti2va.py __call__ num_frames=121: 5 s at 24 fps and "
                                           "the first frame (kandinsky-6 README.md: 5-second clips)"),
    "size": cite("kandinsky-6", "comfyui/kandinsky6/register.py:11-13 @8195e72: Lite's sizes are those of the "
                                "original's preset k6_lite_121_480_864 (121 frames, 480x864), the release's render "
                                "size in every example (the model card's \"native 480x864\", as issue 58 quotes it); "
                                "diffusers 0.42.1 pipeline_kandinsky6_ti2va.py:651-652 __call__ height=512, "
                                "width=768 and the fork's pipeline/config.py:125-126 GenerationConfig are code "
                                "defaults no example uses"),
    "text_tokens": cite("kandinsky-6", "comfyui/kandinsky6/nodes.py _tokenize_k6: \"Canonical K6 admits at most 1024 "
                                       "caption tokens after its 129-token prompt prefix\" (diffusers 0.42.1 "
                                       "__call__ max_sequence_length=1024; the fork's TextEmbedderConfig max_length "
                                       "1024)"),
    "conditioning_frames": cite("diffusers 0.42.1", "pipeline_kandinsky6_ti2va.py __call__ step 6: the image is an "
                                                    "appended tail frame (`tail_cond`); every generated latent frame "
                                                    "is noised and stepped"),
    "training_shift": cite("loraflow", "the render shift, the checkpoint's scheduler_config.json once on disk "
                                       "(training_shift_from_checkpoint): no release states a training shift (the "
                                       "original repository ships no trainer; KozlovKY/kandinsky-6@60c4ff6 "
                                       "kandinsky/pipeline/config.py:131 GenerationConfig scheduler_scale 10.0 is "
                                       "its sampler's default, which a checkpoint's scheduler config overrides)"),
}


def repo(size: str, stage: str) -> str:
    """The diffusers-format repository of a release; sft's id names no stage."""
    return f"kandinskylab/Kandinsky-6.0-{SIZES[size]}{'' if stage == 'sft' else f'-{stage}'}-5s-Diffusers"


def name(task: str, size: str, stage: str) -> str:
    """The original's checkpoint catalog name (lite, lite-distill, pro-pretrain, ...; sft is the bare size), then the
    task: lite-t2v, pro-distill-i2v."""
    return f"{size}{'' if stage == 'sft' else f'-{stage}'}-{task}"


def _flavour(task: str, size: str, stage: str) -> Flavour:
    distilled = stage == "distill"
    steps, guidance = (10, 1.0) if distilled else (50, 5.0)
    scheduler = "PiflowScheduler (n_grid 10, shift 5.0)" if distilled else "FlowMatchEulerDiscreteScheduler (shift 5.0)"
    sources = {
        **SOURCES,
        "flow_shift": cite("FastVideo K6", f"Models table, {repo(size, stage).split('/')[1]}: {scheduler} (the "
                                           "checkpoint's scheduler_config.json wins once downloaded)"),
        "guidance": cite("diffusers@d641013", f"{_TABLE}: guidance_scale={guidance}"),
        "steps": cite("diffusers@d641013", f"{_TABLE}: {steps} steps (FastVideo K6's preset agrees; diffusers "
                                           "0.42.1's example docstring says 16)" if distilled else
                      f"{_TABLE}: {steps} steps"),
    }
    classes = {**CLASSES, "scheduler": SCHEDULERS["piflow" if distilled else "flow"]}
    return Flavour(name(task, size, stage), task, 24.0, 121, (480, 864), 5.0, guidance, PARTS,
                   repo=repo(size, stage), steps=steps, text_tokens=TEXT_TOKENS, sources=tuple(sources.items()),
                   classes=classes, training_shift_from_checkpoint=True,
                   sound_required=_sound_required(task, size) if distilled else "",
                   transformer_problem=partial(_i2v_token_types, name(task, size, stage)) if task == "i2v" else None)


def _i2v_token_types(flavour: str, transformer_config: Mapping[str, Any]) -> str:
    """i2v marks the image's tail frame as visual token type 1 (diffusers 0.42.1 pipeline_kandinsky6_ti2va.py
    `visual_token_type_ids`), which a transformer without the token-type embedding refuses at its first call
    (transformer_kandinsky6.py:782-783: "`visual_token_type_ids` requires `visual_token_type_num_embeddings > 0`")."""
    count = int(transformer_config.get("visual_token_type_num_embeddings") or 0)
    if count >= 2:
        return ""
    t2v = flavour.removesuffix("-i2v") + "-t2v"
    return (f"flavour '{flavour}' conditions on the image as visual token type 1, but this transformer's config.json "
            f"has visual_token_type_num_embeddings {count}: a text-to-video checkpoint without the I2VA token types "
            "(kandinskylab/kandinsky-6@8195e72 comfyui/kandinsky6/register.py:29-30: \"The T2VA Lite ships without the "
            f"I2VA token types\"). Use flavour '{t2v}' with this checkpoint, or an image-to-video checkpoint with them "
            "(pro-i2v, pro-distill-i2v, lite-distill-i2v: 2 in their released configs)")


def _sound_required(task: str, size: str) -> str:
    """Why a π-Flow distilled flavour trains and renders its sound always, and what to fine-tune for video alone."""
    others = " or ".join(f"'{name(task, size, stage)}' ({repo(size, stage)})" for stage in ("sft", "pretrain"))
    return (f"is π-Flow distilled, which the original samples with both streams or not at all (KozlovKY/kandinsky-6"
            f"@60c4ff6 kandinsky/core/algo/piflow_sampler.py:70 \"base-model PiFlow requires both video and audio "
            f"latents\"; kandinsky/pipeline/pipeline.py Kandinsky6Pipeline.__call__: \"piflow.enabled requires "
            f"sample_audio=True\"): set train_audio: true (its renders then carry the sound), or fine-tune {others} "
            f"for the picture alone")


def compose_prompt(caption: str, audio_caption: str, speech: tuple[str, ...] = ()) -> str:
    """The release's canonical prompt of a clip: the video caption, each spoken line inside `<S>…<E>` after it, then
    the audio caption inside `<AUDCAP>…<ENDAUDCAP>`; a part left empty is left out (no audio caption: the caption and
    its speech alone, as the node encodes a prompt without one).

    Sources: the release's ComfyUI node kandinskylab/kandinsky-6@9d2ffe1 comfyui/kandinsky6/nodes.py
    `Kandinsky6TextEncode.encode` (`f"{video_caption} <AUDCAP>{audio_caption}<ENDAUDCAP>"` when the audio caption is
    not blank, else the video caption alone); its `video_caption` input: "Spoken lines go here too, wrapped in
    <S>...<E>", and its `audio_caption`: "Not for spoken lines". The order of speech and sound: the original's t2va
    beautifier examples (KozlovKY/kandinsky-6@60c4ff6 kandinsky/core/components/beautifier/qwen25.py
    `_t2va_instruction`, example 2: the description, then `<S>I'm glad we've found common ground.<E>` and the other
    lines, then `<AUDCAP> Soft instrumental music …<ENDAUDCAP>` last); diffusers 0.42.1
    pipeline_kandinsky6_ti2va.py:84-86 (`_T2VA_EXPANSION_INSTRUCTION`: direct speech between <S> and <E>, general
    audio descriptions between <AUDCAP> and <ENDAUDCAP>)."""
    text = " ".join([caption, *(f"<S>{line}<E>" for line in speech if line)]).strip()
    if audio_caption.strip():
        text = f"{text} <AUDCAP>{audio_caption}<ENDAUDCAP>".strip()
    return text


def is_distilled(flavour: Flavour) -> bool:
    """A π-Flow checkpoint: `PiflowScheduler`, guidance 1.0, `n_grid` velocities per latent channel."""
    return "-distill-" in flavour.name


SPEC = FamilySpec(
    name="kandinsky6",
    description="Kandinsky 6.0 Lite and Pro (pretrain, sft, π-Flow distilled), text-to-video and image-to-video, "
                "with its sound or without",
    flavours=tuple(_flavour(task, size, stage) for task in ("t2v", "i2v") for size in SIZES for stage in STAGES),
    default_flavour="lite-t2v",
    spatial_multiple=16,  # VAE 8x (AutoencoderKLHunyuanVideo), patch 2x2
    vae_temporal_factor=4,
    module="loraflow.pipelines.kandinsky6.family",
    tiny_module="loraflow.pipelines.kandinsky6.tiny",
    compose_prompt=compose_prompt,
)
