"""Tiny, randomly initialised checkpoints with the real diffusers/transformers architectures.

Tests and smoke runs need checkpoints that load through the real ``from_pretrained`` code paths
(configs, subfolders, tokenizers, ``model_index.json``) without any network access. Every component
here is built from a config with the smallest legal dimensions and written in the diffusers
directory layout, so ``<Pipeline>.from_pretrained(out_dir)`` works exactly as with a hub checkpoint.

Compression ratios of the VAEs are kept at their real values (8x/16x spatial, 4x temporal) so that
shape arithmetic in the training code is exercised exactly as with the real models.

This module is the parts library and the writer: each family's module assembles its tiny pipeline from these parts
(`tiny(flavour)`, next to its adapter), and `build_tiny` writes the one a family and flavour pick.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from diffusers import (
    AutoencoderKL, AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Transformer3DModel, Kandinsky5Transformer3DModel,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from tokenizers import AddedToken
from transformers import (
    ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor,
    Qwen2VLVideoProcessor, T5Config, T5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils import logging as hf_logging

from loraflow.pipelines import family_spec
from loraflow.demo.tiny_parts import IMAGE_DIM, RECIPE_KEY, index_extras

# Qwen2.5-VL special tokens that chat templates and the VL processor refer to; ids follow the 256 bytes.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# ChatML, as used by Qwen2.5-VL-Instruct for text-only conversations (string or list-of-parts content).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Byte-level tokenizers put a whole prompt template into the sequence (no merges), so the
# text encoders must accept a few thousand positions.
TEXT_MAX_POSITIONS = 4096
TEXT_DIM = 32  # hidden size of every tiny text encoder (Qwen, CLIP, ByT5); the DiTs read it from here
INIT_STD = 0.05  # std used to re-randomise zero-initialised parameters


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """The 256 GPT-2 byte-level symbols, ordered so that symbol id == byte value."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Byte-level Qwen2 tokenizer with no merges: every UTF-8 byte is one token."""
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        chat_template=CHATML_TEMPLATE,
        padding_side="right",  # the pipelines crop a template prefix from the left
        model_max_length=TEXT_MAX_POSITIONS,
    )
    # The base class registers only unk/eos/pad; the chat/vision markers must never be split into bytes.
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS], special_tokens=True)
    return tokenizer


def clip_tokenizer() -> CLIPTokenizer:
    """CLIP BPE tokenizer with a byte vocabulary (each byte with and without the ``</w>`` suffix)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    symbols = _byte_symbols()
    for suffix in ("", "</w>"):
        for sym in symbols:
            vocab[sym + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


# ----------------------------------------------------------------------------------------------
# Text encoders
# ----------------------------------------------------------------------------------------------


def _qwen_text_kwargs(tokenizer: Qwen2Tokenizer) -> dict[str, object]:
    """Three decoder layers (HunyuanVideo 1.5 reads ``hidden_states[-3]``, which must not be the
    embeddings); head_dim 16 with mrope sections 2+3+3 = head_dim/2 keeps rope legal."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_DIM,
        "intermediate_size": 2 * TEXT_DIM,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": TEXT_MAX_POSITIONS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }


def _qwen_vl_config(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL with a one-block vision tower: unused by text prompts, it encodes Kandinsky 5 i2i's source image
    (patch 14, temporal patch 2, merge 2 by default: what `qwen_vl_processor` produces)."""
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": TEXT_DIM,
              "fullatt_block_indexes": [0]}
    return Qwen2_5_VLConfig(
        text_config=_qwen_text_kwargs(tokenizer),
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
    )


def qwen_vl_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLProcessor:
    """The Qwen2-VL processor Kandinsky 5 i2i takes as its `tokenizer`, with pixel bounds 56^2..112^2 instead of
    56^2..1280 * 28^2: an image gives 4 to 16 vision tokens (a 32-128 px source, which the pipeline halves: 4).
    Patch 14, temporal patch 2 and merge 2 are the defaults, as the vision tower of `_qwen_vl_config` expects."""
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor())


def qwen_vl_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """Tiny Qwen2.5-VL (the class the Kandinsky 5 pipelines load) matching ``tokenizer``'s ids."""
    return Qwen2_5_VLForConditionalGeneration(_qwen_vl_config(tokenizer)).eval()


def qwen_vl_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLTextModel:
    """Tiny Qwen2.5-VL language model only (the class the HunyuanVideo 1.5 pipelines load)."""
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**_qwen_text_kwargs(tokenizer))).eval()


def clip_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    """Tiny CLIP text tower; eos id taken from the tokenizer so ``pooler_output`` picks the eos token."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=2 * TEXT_DIM,
        projection_dim=TEXT_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def byt5_encoder(tokenizer: ByT5Tokenizer) -> T5EncoderModel:
    """Tiny Glyph-ByT5 stand-in: a T5 encoder over the ByT5 byte vocabulary (gated-gelu like ByT5)."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=2 * TEXT_DIM,
        num_layers=1,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(config).eval()


# ----------------------------------------------------------------------------------------------
# VAEs
# ----------------------------------------------------------------------------------------------


def hunyuan_video_vae() -> AutoencoderKLHunyuanVideo:
    """HunyuanVideo VAE: 4 blocks are the minimum for 8x spatial + 4x temporal compression."""
    return AutoencoderKLHunyuanVideo(
        latent_channels=16,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()


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


def flux_vae() -> AutoencoderKL:
    """Flux-style 2D VAE: 16 latent channels, 4 blocks (3 downsamples = 8x).

    Scaling/shift are Flux's real values; the K5 image pipelines divide by scaling only.
    """
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


# ----------------------------------------------------------------------------------------------
# Transformers
# ----------------------------------------------------------------------------------------------


def rerandomise_zero_params(
    model: torch.nn.Module, name_filter: Callable[[str], bool], std: float = INIT_STD
) -> list[str]:
    """Draw ``normal(0, std)`` into every all-zero parameter whose name passes ``name_filter``.

    Zero-initialised modulation/gates make every block an identity at init, so gradients into the
    attention layers (and their LoRA adapters) vanish and a test would prove nothing.
    """
    touched = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name_filter(name) and param.is_floating_point() and not param.any():
                param.normal_(0.0, std)
                touched.append(name)
    return touched


def kandinsky5_transformer(visual_cond: bool, model_dim: int = 32) -> Kandinsky5Transformer3DModel:
    """Lite-style K5 DiT with 2 heads; head_dim = model_dim / 2 = the rope axes (4+6+6 at 32, 8+12+12 at 64).
    The tiny world's checkpoint is 128 wide (`kandinsky5_video._world_pipeline` says why); the others 32.

    ``visual_cond=True`` (video Lite/Pro, image-to-image) means 16 + 16 + 1 input channels; the T2I
    pipeline feeds plain 16-channel latents, so its checkpoint has ``visual_cond=False``.
    """
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=16,
        out_visual_dim=16,
        in_text_dim=TEXT_DIM,
        in_text_dim2=TEXT_DIM,
        time_dim=32,
        patch_size=(1, 2, 2),
        model_dim=model_dim,
        ff_dim=2 * model_dim,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(model_dim // 8, 3 * model_dim // 16, 3 * model_dim // 16),
        visual_cond=visual_cond,
        attention_type="regular",
    )
    rerandomise_zero_params(model, lambda name: "modulation" in name)
    return model.eval()


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


def kandinsky5_scheduler(shift: float) -> FlowMatchEulerDiscreteScheduler:
    """Plain flow-matching Euler with a static shift (K5 pipelines pass no mu/sigmas)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


# ----------------------------------------------------------------------------------------------
# Parts shared by families
# ----------------------------------------------------------------------------------------------


class _Saveable(Protocol):
    """Anything written with ``save_pretrained`` and read back with ``from_pretrained``."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> object: ...


# What a family's tiny builder returns (its module's `tiny(flavour)`): a pipeline plus extra components written
# as additional subfolders, listed in model_index.json too.
TinyPipeline = tuple[DiffusionPipeline, dict[str, _Saveable]]


def kandinsky5_pipeline(pipeline: type, visual_cond: bool, vae: Callable[[], torch.nn.Module], shift: float,
                        vl_tokenizer: bool = False) -> TinyPipeline:
    """A tiny Kandinsky 5 pipeline: the Video, Image and Image i2i checkpoints differ only in these arguments (i2i:
    16 noisy + 16 source + 1 ones channels, and the VL processor as its tokenizer)."""
    pipe = pipeline(transformer=kandinsky5_transformer(visual_cond=visual_cond), vae=vae(),
                    scheduler=kandinsky5_scheduler(shift=shift), **kandinsky5_text_components(vl_tokenizer))
    return pipe, {}


def kandinsky5_text_components(vl_tokenizer: bool = False) -> dict[str, object]:
    """Qwen2.5-VL + CLIP encoders with their offline tokenizers, shared by all K5 pipelines; `vl_tokenizer`: the
    Qwen tokenizer inside the VL processor, as Kandinsky 5 i2i takes it."""
    tokenizer = qwen_tokenizer()
    tokenizer_2 = clip_tokenizer()
    return {
        "text_encoder": qwen_vl_encoder(tokenizer),
        "tokenizer": qwen_vl_processor(tokenizer) if vl_tokenizer else tokenizer,
        "text_encoder_2": clip_text_encoder(tokenizer_2),
        "tokenizer_2": tokenizer_2,
    }


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' per-save "Writing model shards" bars; restore the caller's setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _publish(staging: Path, out_dir: Path, entries: Iterable[str]) -> None:
    """Move staged entries into ``out_dir``; ``model_index.json`` last, so it marks completion."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(entries, key=lambda n: n == "model_index.json"):
        target = out_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging / name, target)


def recipe_name(family: str, variant: str, version: int) -> str:
    """What a family's `tiny(flavour)` names its builder by in model_index.json: words, not the builder's module path,
    so moving code keeps built folders valid; a family bumps `version` when what the builder makes changes, and the
    folders built before are refused."""
    return f"{family} {variant} v{version}"


def build_tiny(family: str, out_dir: str | Path, seed: int = 0, flavour: str | None = None,
               world: bool = False) -> Path:
    """Write a tiny diffusers-layout checkpoint for `family` into out_dir, with the builder its module's
    `tiny(flavour)` picks and names (`recipe_name`) (None: the default flavour's; Kandinsky 5 Image i2i has its own). `world`: the module's
    `tiny_world(flavour)` where it has one (Kandinsky 5 Video: the demo's pre-trained tiny world), else `tiny`.

    Idempotent: if out_dir/model_index.json exists, return immediately, after checking that it holds the pipeline
    the flavour needs and was built by the same recipe (builder and seed, marked in model_index.json): another
    recipe, or a folder without the mark, is refused, never silently reused (`world=True` over an old random
    checkpoint kept the random one). Components are built in a staging directory next to ``out_dir`` and moved in
    with ``model_index.json`` last, so an interrupted build never leaves a directory that looks complete.
    Weights are fp32 and depend only on ``seed`` (the global torch RNG state is left untouched).
    """
    out_dir = Path(out_dir)
    spec = family_spec(family)
    module = importlib.import_module(spec.module)
    pick = module.tiny_world if world and hasattr(module, "tiny_world") else module.tiny
    pipeline, name, builder = pick(spec.flavour(flavour))
    recipe = {"builder": name, "seed": seed}
    if (out_dir / "model_index.json").exists():
        index = json.loads((out_dir / "model_index.json").read_text())
        built = index["_class_name"]
        if built != pipeline.__name__:
            wanted = f"{family} flavour {flavour!r}" if flavour else family
            raise ValueError(f"{out_dir} holds a tiny {built} checkpoint, but {wanted} needs a {pipeline.__name__}: "
                             "build it into another folder")
        _check_recipe(out_dir, index.get(RECIPE_KEY), recipe)
        return out_dir
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe, extras = builder()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        with _no_progress_bars():
            pipe.save_pretrained(staging, safe_serialization=True)
            for subfolder, component in extras.items():
                component.save_pretrained(staging / subfolder)
            index_extras(staging, extras, recipe)
        _publish(staging, out_dir, os.listdir(staging))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_recipe(out_dir: Path, held: dict[str, object] | None, recipe: dict[str, object]) -> None:
    """Refuse a built folder whose mark (`held`) names another recipe, or that has none (built before the mark
    existed, or not by build_tiny): its weights are not what this call would build."""
    if held == recipe:
        return
    what = (f"was built by {held['builder']} (seed {held['seed']})" if held else
            "has no build_tiny recipe in its model_index.json, so what it holds is unknown (built by an older "
            "loraflow, or not by build_tiny)")
    raise ValueError(f"{out_dir} {what}, but this build is {recipe['builder']} (seed {recipe['seed']}): delete the "
                     "folder to build it again, or build into another folder")
