"""Parts of the tiny checkpoints every family builds from: randomly initialised, with the real diffusers/transformers
architectures.

Tests and smoke runs need checkpoints that load through the real ``from_pretrained`` code paths (configs, subfolders,
tokenizers, ``model_index.json``) without any network access. Every component is built from a config with the
smallest legal dimensions; a family's `tiny.py` (`tiny(flavour)`) assembles its pipeline from these parts and its own
(the transformer, the VAE: compression ratios kept at their real values, 8x/16x spatial and 4x temporal, so the shape
arithmetic of training runs as with the real models), and `loraflow.demo.tiny.build_tiny` writes it in the diffusers
directory layout, so ``<Pipeline>.from_pretrained(out_dir)`` works exactly as with a hub checkpoint.

Here: the byte-level tokenizers, the text encoders (Qwen2.5-VL, CLIP, ByT5), `rerandomise_zero_params`, what a
builder returns (`TinyPipeline`) and names itself by (`recipe_name`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from tokenizers import AddedToken
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    T5Config,
    T5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

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
# Weights
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


# ----------------------------------------------------------------------------------------------
# What a family's tiny builder returns
# ----------------------------------------------------------------------------------------------


class _Saveable(Protocol):
    """Anything written with ``save_pretrained`` and read back with ``from_pretrained``."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> object: ...


# What a family's tiny builder returns (its module's `tiny(flavour)`): a pipeline plus extra components written
# as additional subfolders, listed in model_index.json too.
TinyPipeline = tuple[DiffusionPipeline, dict[str, _Saveable]]


def recipe_name(family: str, variant: str, version: int) -> str:
    """What a family's `tiny(flavour)` names its builder by in model_index.json: words, not the builder's module path,
    so moving code keeps built folders valid; a family bumps `version` when what the builder makes changes, and the
    folders built before are refused."""
    return f"{family} {variant} v{version}"
