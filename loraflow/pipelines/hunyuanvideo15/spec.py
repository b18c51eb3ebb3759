"""HunyuanVideo 1.5's plain data: flavours and names, each number with its citation (loraflow/pipelines/citations.py).
The adapter is `family.py` beside it and the tiny checkpoint `tiny.py` (torch, diffusers), imported only when needed.

Repository ids: the hunyuanvideo-community collection (also SimpleTuner's table). Shifts, guidance and the
step-distilled steps are Tencent-Hunyuan/HunyuanVideo-1.5's (hyvideo/commons/__init__.py PIPELINE_CONFIGS, its README
inference table), which diffusers' conversion script repeats (scripts/convert_hunyuan_video1_5_to_diffusers.py:
SCHEDULER_CONFIGS, GUIDANCE_CONFIGS; TRANSFORMER_CONFIGS gives the step-distilled mean-flow transformer).
The diffusers `720p_i2v_distilled` repository converts Tencent's `transformer/720p_i2v_distilled` (the script's
TRANSFORMER_CONFIGS key is the folder it downloads), not `720p_i2v_distilled_sparse`, a separate checkpoint for
Tencent's sparse attention (PIPELINE_CONFIGS and the README list both; `get_transformer_version` adds "_sparse" only
with --sparse_attn). docs/families.md lists every release, and why the super-resolution ones are no flavour."""

from __future__ import annotations

import json

from loraflow.pipelines.citations import cite
from loraflow.pipelines.flavours import QWEN_TOKENIZERS, TWO_ENCODER_PARTS, ComponentFolders, FamilySpec, Flavour

_SIGLIP_PARTS = ("image_encoder", "feature_extractor")
# The guide's environment variables; read as diffusers component folders, not the original release's
# text_encoder/llm or vision_encoder/siglip tree SimpleTuner points them at.
_GUIDE_FOLDERS = (
    ("text_encoder", "HUNYUANVIDEO_TEXT_ENCODER_PATH"), ("image_encoder", "HUNYUANVIDEO_VISION_ENCODER_PATH"),
)
TEXT_TOKENS = 1000  # the pipelines' tokenizer_max_length, after the template's crop
GLYPH_TOKENS = 256  # the pipeline's tokenizer_2_max_length (ByT5)
IMAGE_TOKENS = 729  # SigLIP so400m/14-384 tokens; all zero for t2v (the DiT then masks them out)
_CONVERT = "scripts/convert_hunyuan_video1_5_to_diffusers.py"


# The classes a HunyuanVideo 1.5 checkpoint's model_index.json may name (`Flavour.classes`): what diffusers'
# HunyuanVideo15Pipeline and HunyuanVideo15ImageToVideoPipeline annotate (tests/pipelines/test_families.py reads
# them), and the SigLIP processor's other backends (Pil: what the tiny checkpoints save; Fast: torchvision's).
CLASSES = {
    "transformer": ("diffusers.HunyuanVideo15Transformer3DModel",),
    "vae": ("diffusers.AutoencoderKLHunyuanVideo15",),
    "text_encoder": ("transformers.Qwen2_5_VLTextModel",),
    "tokenizer": QWEN_TOKENIZERS,
    "text_encoder_2": ("transformers.T5EncoderModel",),
    "tokenizer_2": ("transformers.ByT5Tokenizer",),
    "scheduler": ("diffusers.FlowMatchEulerDiscreteScheduler",),
    "guider": ("diffusers.ClassifierFreeGuidance",),
    "image_encoder": ("transformers.SiglipVisionModel",),
    "feature_extractor": tuple(f"transformers.SiglipImageProcessor{kind}" for kind in ("", "Pil", "Fast")),
}


def _flavour(name: str, shift: float, steps: int = 30) -> Flavour:
    """`name` is task-resolution[-distillation], SimpleTuner's names; its repository the same words with `_`."""
    task, resolution, *distilled = name.split("-", 2)
    size = {"480p": (480, 848), "720p": (720, 1280)}[resolution]
    parts = (*TWO_ENCODER_PARTS, "guider") + (_SIGLIP_PARTS if task == "i2v" else ())
    folder = "_".join([resolution, task, *distilled]).replace("-", "_")
    guidance = 1.0 if distilled else 6.0
    sources = {
        "fps": cite("HunyuanVideo-1.5", "generate.py writes its videos at fps=24"),
        "num_frames": cite("HunyuanVideo-1.5", "generate.py --video_length default 121"),
        "size": cite("diffusers 0.42.1", f"pipeline_hunyuan_video1_5.py with no size renders the 16:9 "
                                         f"(default_aspect_ratio) bucket of target_size: {size[1]}x{size[0]}; "
                                         "HunyuanVideo-1.5 generate.py --aspect_ratio 16:9"),
        "flow_shift": cite("HunyuanVideo-1.5", f"hyvideo/commons/__init__.py PIPELINE_CONFIGS['{folder}'] flow_shift "
                                               f"{shift} (diffusers@58eb52c {_CONVERT} SCHEDULER_CONFIGS agrees)"),
        "training_shift": cite("loraflow", f"{shift}, the render shift, loraflow's default before issue 44, kept so "
                                           "runs train as before; Tencent's train.py trains with "
                                           "--train_timestep_shift 3.0 (set flow_schedule_shift: 3.0 for it)"),
        "guidance": cite("HunyuanVideo-1.5", f"hyvideo/commons/__init__.py PIPELINE_CONFIGS['{folder}'] guidance_scale "
                                             f"{guidance} (diffusers@58eb52c {_CONVERT} GUIDANCE_CONFIGS agrees)"),
        "steps": cite("HunyuanVideo-1.5", "hyvideo/commons/__init__.py PIPELINE_CONFIGS['480p_i2v_step_distilled'] "
                                          "num_inference_steps 12 (README: 8 or 12 recommended)" if steps == 12 else
                      "README inference table: 50 steps (hyvideo/pipelines/hunyuan_video_pipeline.py default 50)")
        if distilled
        else cite("loraflow", "30, the config default before issue 33, kept so validation keys stay; the release "
                              "samples with 50 (HunyuanVideo-1.5 README inference table)"),
        "text_tokens": cite("diffusers 0.42.1", "pipeline_hunyuan_video1_5.py tokenizer_max_length 1000"),
        # 0 for i2v too: HunyuanVideo15ImageToVideoPipeline steps every latent frame (HVI:931)
        "conditioning_frames": cite("diffusers 0.42.1", "pipeline_hunyuan_video1_5_image2video.py steps every "
                                                        "latent frame; the image enters through condition channels"),
    }
    return Flavour(name, task, 24.0, 121, size, shift, guidance, parts,
                   repo=f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{folder}",
                   folder_variables=_GUIDE_FOLDERS, steps=steps, text_tokens=TEXT_TOKENS,
                   sources=tuple(sources.items()), classes=CLASSES)


def render_size(flavour: Flavour, model: ComponentFolders, height: int, width: int) -> tuple[int, int] | None:
    """(height, width) the flavour's pipeline renders at when validation asks for (height, width); None: unknown
    until the checkpoint's configs are here. t2v renders as asked. i2v takes no size: it crop-resizes the image to
    the size bucket of transformer `target_size` (patches of the VAE's spatial factor) closest to the image's aspect
    on its side of square (HVI:756-759, `HunyuanVideo15ImageProcessor.calculate_default_height_width`, whose
    `generate_crop_size_list` and `get_closest_ratio` this follows step for step: torch stays unimported)."""
    transformer, vae = model.folder("transformer") / "config.json", model.folder("vae") / "config.json"
    if not flavour.image_is_first_frame:
        return height, width
    if not (transformer.is_file() and vae.is_file()):
        return None
    target = json.loads(transformer.read_text()).get("target_size", 640)  # the pipeline's defaults
    patch = json.loads(vae.read_text()).get("spatial_compression_ratio", 16)
    patches, tall, wide, buckets = round((target / patch) ** 2), round((target / patch) ** 2), 1, []
    while tall > 0:  # (height, width) in patches, every one of at most `patches` patches, aspect up to 4
        if max(tall, wide) / min(tall, wide) <= 4.0:
            buckets.append((tall * patch, wide * patch))
        if (wide + 1) * tall <= patches:
            wide += 1
        else:
            tall -= 1
    aspect = height / width
    offsets = [round(h / w, 5) - aspect for h, w in buckets]
    same_side = [(abs(d), i) for i, d in enumerate(offsets) if (d <= 0 if aspect >= 1 else d >= 0)]
    return buckets[min(same_side)[1]]


def attention_note(flavour: Flavour, transformer_config: dict, bucket: tuple[int, int, int], text_tokens: int) -> str:
    """`loraflow check`'s line on the joint attention's work a step at batch 1 leaves out (attention.py: no mask, no
    padded tokens): t2v's 729 zero image tokens, against the masked call over every token (the estimate's caption
    and glyphs are all valid tokens). 4 * L^2 * heads * head_dim FLOPs per block forward (QK^T and PV), twice that
    backward."""
    frames, height, width = bucket
    video = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)  # VAE 4x in time, 16x in space, patch 1
    kept = video + text_tokens + GLYPH_TOKENS
    line = "attention: no mask at batch 1 (every text token valid), so SDPA may take its flash or cuDNN kernel"
    if flavour.image_is_first_frame:
        return f"{line}; i2v's 729 image tokens are valid and stay"
    per_pair = 3 * 4 * transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"] \
        * transformer_config["num_layers"]
    saved = per_pair * ((kept + IMAGE_TOKENS) ** 2 - kept ** 2)
    share = 1 - kept ** 2 / (kept + IMAGE_TOKENS) ** 2
    return (f"{line}; t2v's 729 zero image tokens are left out: {saved / 1e12:.4g} TFLOP of attention a step "
            f"saved ({100 * share:.1f}% of it; {video} video + {text_tokens + GLYPH_TOKENS} text tokens)")


SPEC = FamilySpec(
    name="hunyuanvideo-1.5",
    description="HunyuanVideo 1.5 at 480p and 720p, text-to-video and image-to-video, and its distilled releases",
    flavours=(_flavour("t2v-480p", 5.0), _flavour("t2v-720p", 9.0), _flavour("i2v-480p", 5.0),
              _flavour("i2v-720p", 7.0), _flavour("t2v-480p-distilled", 5.0, 50),
              _flavour("i2v-480p-distilled", 5.0, 50), _flavour("i2v-480p-step-distilled", 7.0, 12),
              # Tencent's 720p_i2v_distilled (not its separate 720p_i2v_distilled_sparse): see the docstring
              _flavour("i2v-720p-distilled", 7.0, 50)),
    default_flavour="t2v-480p",
    spatial_multiple=16,  # VAE 16x, patch 1
    vae_temporal_factor=4,
    module="loraflow.pipelines.hunyuanvideo15.family",
    tiny_module="loraflow.pipelines.hunyuanvideo15.tiny",
    simpletuner_names=("hunyuanvideo", "hunyuanvideo-1.5"),
    ffn_classes=("FeedForward",),  # diffusers attention.FeedForward (transformer_hunyuan_video15.py ff, ff_context)
    render_size=render_size,
    attention_note=attention_note,
)
