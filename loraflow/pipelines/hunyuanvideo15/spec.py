"""HunyuanVideo 1.5's plain data: flavours and names. The family itself is `hunyuanvideo15` (torch, diffusers),
imported only when a stage needs it.

Repository ids: the hunyuanvideo-community collection (also SimpleTuner's table). The distilled flavours' shift,
guidance 1.0 and (step-distilled) mean-flow transformer are diffusers' conversion script's
(scripts/convert_hunyuan_video1_5_to_diffusers.py: SCHEDULER_CONFIGS, GUIDANCE_CONFIGS, TRANSFORMER_CONFIGS); their
steps the Tencent-Hunyuan/HunyuanVideo-1.5 README's inference table (50; 8 or 12 for step-distilled, 12 its code's
default). docs/families.md lists every release, and why the super-resolution ones are no flavour."""

from __future__ import annotations

import json

from loraflow.pipelines.flavours import QWEN_TOKENIZERS, TWO_ENCODER_PARTS, FamilySpec, Flavour
from loraflow.pipelines.sources import ModelSource

_SIGLIP_PARTS = ("image_encoder", "feature_extractor")
# The guide's environment variables; read as diffusers component folders, not the original release's
# text_encoder/llm or vision_encoder/siglip tree SimpleTuner points them at.
_GUIDE_FOLDERS = (("text_encoder", "HUNYUANVIDEO_TEXT_ENCODER_PATH"), ("image_encoder", "HUNYUANVIDEO_VISION_ENCODER_PATH"))


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
    # conditioning_frames 0 for i2v too: HunyuanVideo15ImageToVideoPipeline steps every latent frame (HVI:931)
    return Flavour(name, task, 24.0, 121, size, shift, 1.0 if distilled else 6.0, parts,
                   repo=f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{folder}",
                   folder_variables=_GUIDE_FOLDERS, steps=steps, classes=CLASSES)


def render_size(flavour: Flavour, model: ModelSource, height: int, width: int) -> tuple[int, int] | None:
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


SPEC = FamilySpec(
    name="hunyuanvideo-1.5",
    description="HunyuanVideo 1.5 at 480p and 720p, text-to-video and image-to-video, and its distilled releases",
    flavours=(_flavour("t2v-480p", 5.0), _flavour("t2v-720p", 9.0), _flavour("i2v-480p", 5.0),
              _flavour("i2v-720p", 7.0), _flavour("t2v-480p-distilled", 5.0, 50),
              _flavour("i2v-480p-distilled", 5.0, 50), _flavour("i2v-480p-step-distilled", 7.0, 12),
              # Tencent's 720p_i2v_distilled_sparse, trained for its sparse attention; diffusers runs it dense
              _flavour("i2v-720p-distilled", 7.0, 50)),
    default_flavour="t2v-480p",
    spatial_multiple=16,  # VAE 16x, patch 1
    vae_temporal_factor=4,
    module="loraflow.pipelines.hunyuanvideo15.family",
    simpletuner_names=("hunyuanvideo", "hunyuanvideo-1.5"),
    render_size=render_size,
)
