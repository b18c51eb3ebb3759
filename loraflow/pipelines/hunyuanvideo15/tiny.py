"""HunyuanVideo 1.5's tiny checkpoints (`tiny(flavour)`, for `loraflow.demo.tiny.build_tiny`): the t2v pipeline with
SigLIP beside it (so the i2v pipeline loads the same folder), and the step-distilled one's mean-flow transformer."""

from __future__ import annotations

from collections.abc import Callable

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import ByT5Tokenizer, SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.hunyuanvideo15.spec import SPEC
from loraflow.pipelines.tiny_parts import (
    TEXT_DIM,
    TinyPipeline,
    byt5_encoder,
    qwen_tokenizer,
    qwen_vl_text_encoder,
    recipe_name,
)

IMAGE_DIM = 32  # hidden size of the tiny SigLIP vision tower


def hunyuan_video15_vae() -> AutoencoderKLHunyuanVideo15:
    """HunyuanVideo 1.5 DC-AE style VAE: 32 latent channels, 16x spatial / 4x temporal.

    Five blocks are needed for 16x. Legality constraints that set the widths: the last width must be
    a multiple of 2 * 32 (the encoder's channel-averaging shortcut), the temporal pixel-shuffle
    shortcuts average/repeat groups of ``8 * c_in / c_out`` that must be even (so 16 before 64), and
    the mid blocks at width 64 dominate the size (~5 MB).
    """
    return AutoencoderKLHunyuanVideo15(
        latent_channels=32,
        block_out_channels=(8, 8, 8, 16, 64),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()


def hunyuan_video15_transformer(use_meanflow: bool = False) -> HunyuanVideo15Transformer3DModel:
    """HV1.5 DiT: 2 heads x 16 (rope axes 4+6+6), input 32 latent + 32 cond + 1 mask channels.

    ``target_size`` (pixels) drives the pipelines' default/i2v resolution buckets; 64 keeps them tiny.
    Note ``context_embedder_2`` has a hard-coded 2048-wide MLP (~4.3M params) whatever the config.
    """
    model = HunyuanVideo15Transformer3DModel(
        in_channels=65,
        out_channels=32,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=TEXT_DIM,
        image_embed_dim=IMAGE_DIM,
        rope_axes_dim=(4, 6, 6),
        target_size=64,
        use_meanflow=use_meanflow,  # step-distilled: a second timestep embedder (for the interval's end)
    )
    # Unlike K5 nothing here is zero-initialised (AdaLayerNormZero/AdaNorm linears use the default
    # init), so there is nothing to re-randomise; only LayerNorm biases start at zero.
    return model.eval()


def siglip_image_encoder() -> tuple[SiglipVisionModel, SiglipImageProcessorPil]:
    """SigLIP so400m/14-384 geometry (384 px, patch 14 -> 27 x 27 = 729 tokens, the count the
    HunyuanVideo 1.5 t2v pipeline hard-codes for its all-zero image embeds) at width 32."""
    config = SiglipVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=2 * IMAGE_DIM,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=384,
        patch_size=14,
    )
    # The PIL backend: the default SiglipImageProcessor needs torchvision and otherwise falls back
    # to this class with a warning.
    processor = SiglipImageProcessorPil(
        size={"height": 384, "width": 384}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    return SiglipVisionModel(config).eval(), processor


def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    """Every flavour but step-distilled loads one tiny checkpoint: the t2v pipeline's, with SigLIP as extra
    components so the i2v pipeline loads the same folder. Step-distilled's transformer config differs (mean flow:
    released/hv15-480p-i2v-step-distilled), so it has its own."""
    if flavour.name.endswith("step-distilled"):
        return HunyuanVideo15Pipeline, recipe_name(SPEC.name, "meanflow", 1), _tiny_meanflow_pipeline
    return HunyuanVideo15Pipeline, recipe_name(SPEC.name, "t2v", 1), _tiny_pipeline


def _tiny_pipeline() -> TinyPipeline:
    return _tiny(use_meanflow=False, shift=5.0)


def _tiny_meanflow_pipeline() -> TinyPipeline:
    return _tiny(use_meanflow=True, shift=7.0)  # the step-distilled release's scheduler shift


def _tiny(use_meanflow: bool, shift: float) -> TinyPipeline:
    tokenizer = qwen_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=qwen_vl_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=hunyuan_video15_transformer(use_meanflow),
        vae=hunyuan_video15_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        text_encoder_2=byt5_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    image_encoder, feature_extractor = siglip_image_encoder()
    return pipe, {"image_encoder": image_encoder, "feature_extractor": feature_extractor}
