"""Kandinsky 5.0 Image's plain data: flavours and names, each number with its citation
(loraflow/pipelines/citations.py). The adapter is `family.py` beside it and the tiny checkpoint `tiny.py` (torch,
diffusers), imported only when needed.

Repository ids: SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_image/model.py), all four listed in the
kandinskylab "Diffusers" collection. Sampling: the original's configs/k5_lite_{t2i,i2i}_sft_hd.yaml (50 steps, guidance
3.5) and its pipelines' scheduler_scale 3.0, which musubi-tuner's k5-lite-t2i-hd / -i2i-hd tasks and diffusers' docs
(50 steps, guidance 3.5) follow; training draws with the seed guide's shift 1.0, not the render's 3.0."""

from __future__ import annotations

from loraflow.pipelines.citations import K5_IMAGE_SCALE, K5_IMAGE_TEXT, cite
from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour
from loraflow.pipelines.kandinsky5.nabla_buckets import nabla_buckets
from loraflow.pipelines.kandinsky5.video.spec import KANDINSKY5_CLASSES

IMAGE_CLASSES = {**KANDINSKY5_CLASSES, "vae": ("diffusers.AutoencoderKL",)}  # Flux's 2D VAE

TEXT_TOKENS = 512  # K5_IMAGE_TEXT
I2I_TEXT_TOKENS = 1024  # the I2I pipeline's max_sequence_length (vision tokens included)


def _flavour(name: str, repo: str, musubi: str = "") -> Flavour:
    task = name.split("-")[0]
    yaml = f"configs/k5_lite_{task}_sft_hd.yaml"
    text = K5_IMAGE_TEXT if task == "t2i" else cite(
        "diffusers 0.42.1", "pipeline_kandinsky_i2i.py max_sequence_length=1024 after the crop, vision tokens "
                            "included (the original truncates nothing when there is an image: kandinsky-5 "
                            "kandinsky/models/text_embedders.py max_length=None)")
    sources = {
        "fps": cite("loraflow", "24: only used when frames are sampled from videos (one frame a sample)"),
        "num_frames": cite("derived", "an image is one frame"),
        "size": cite("kandinsky-5", "kandinsky/t2i_pipeline.py __call__ width=1024, height=1024 (diffusers' docs "
                                    "render 1024x1024)"),
        "flow_shift": K5_IMAGE_SCALE,
        "training_shift": cite("seed guide", "Kandinsky 5.0 Image quickstart (seeds/002): flow_schedule_shift 1.0 "
                                             "\"es el valor predeterminado\""),
        "guidance": cite("kandinsky-5", f"{yaml} model.guidance_weight 3.5 (diffusers@58eb52c "
                                        "docs/source/en/api/pipelines/kandinsky5_image.md guidance_scale=3.5)"),
        "steps": cite("kandinsky-5", f"{yaml} model.num_steps 50 (diffusers' docs num_inference_steps=50)"),
        "text_tokens": text,
        "conditioning_frames": cite("derived", "i2i's source image is extra channels, not a frame (K5I2I:548)"),
    }
    # One frame; fps only matters when frames are sampled from videos.
    return Flavour(name, task, 24.0, 1, (1024, 1024), 3.0, 3.5, TWO_ENCODER_PARTS,
                   repo=f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers", steps=50,
                   peer_names=(musubi,) if musubi else (), training_shift=1.0,
                   text_tokens=TEXT_TOKENS if task == "t2i" else I2I_TEXT_TOKENS, sources=tuple(sources.items()),
                   classes=IMAGE_CLASSES)


SPEC = FamilySpec(
    name="kandinsky5-image",
    description="Kandinsky 5.0 Image Lite, text-to-image and image-to-image editing",
    flavours=(_flavour("t2i-lite-sft", "T2I-Lite-sft", "k5-lite-t2i-hd"),
              _flavour("t2i-lite-pretrain", "T2I-Lite-pretrain"),
              _flavour("i2i-lite-sft", "I2I-Lite-sft", "k5-lite-i2i-hd"),
              _flavour("i2i-lite-pretrain", "I2I-Lite-pretrain")),
    default_flavour="t2i-lite-sft",
    spatial_multiple=16,  # VAE 8x, patch 2x2
    vae_temporal_factor=1,  # a 2D VAE: every frame is its own image
    prompt_templates=("original", "diffusers"),  # kandinsky5/common.py: the original's, diffusers 0.42.1's
    module="loraflow.pipelines.kandinsky5.image.family",
    tiny_module="loraflow.pipelines.kandinsky5.image.tiny",
    simpletuner_names=("kandinsky5-image", "kandinsky5_image"),
    ffn_classes=("Kandinsky5FeedForward",),  # diffusers transformer_kandinsky.py
    size_checked=("i2i-lite-sft", "i2i-lite-pretrain"),
    bucket_rule=nabla_buckets,  # the transformer's NABLA blocks, where its config attends so
)
