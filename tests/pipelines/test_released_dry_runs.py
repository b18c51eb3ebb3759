"""Real-size dry runs: the released configs (loraflow/pipelines/released), built with their real classes on fake
tensors (no memory, no weights), run at the flavour's real validation size through loraflow's own code.

Training, one micro-step: `prepare_transformer` (bf16 storage, peft LoRA, gradient checkpointing), `step_draws`
(noise, sigmas), `routing` (TREAD) and `flow_terms` (i2v/i2i conditioning, bf16 autocast, CREPA's block hook and
term, the family's `velocity`), then backward. Latents: `vae_encode` of a real-size clip, with and without patch
conv. Text: `prompt_tensors` on the released Qwen2.5-VL and CLIP-L. A shape or config mistake at released size fails
here in seconds. Fake tensors cost Python time per op, not FLOPs: the transformers keep DEPTH of their visual
blocks (every other dimension is the released one; tests/pipelines/test_released.py checks the full depth's size).

HunyuanVideo 1.5's forward asks values (are the image tokens all zero, which text tokens are valid): `known_values`
answers them from the real batch. NABLA, fp8-layerwise and the validation render have their own dry runs
(tests/pipelines/test_released_render.py)."""

from __future__ import annotations

import re

import pytest
import torch

from loraflow.config import LoraflowConfig
from loraflow.contracts.teacher_features import latent_frame_indices
from loraflow.estimates.fake_tensors import fake_mode, known_values, released_model
from loraflow.kernels.crepa import CrepaProjector, hidden_width
from loraflow.kernels.patch_conv import enable_patch_conv
from loraflow.pipelines import get_family
from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15
from loraflow.pipelines.kandinsky5 import common as kandinsky5
from loraflow.pipelines.released import released_config
from loraflow.stages.teacher.teacher_features import patch_features
from loraflow.training.batches import MicroBatch
from loraflow.training.options.crepa_training import Crepa
from loraflow.training.step import flow_terms, routing, uses_autocast
from tests.factory import (
    DEPTH,
    Case,
    as_loaded,
    dry_config,
    latent_shape,
    released_batch,
    released_transformer,
)

pytestmark = pytest.mark.released

# HV1.5's forward drops the text tokens after its last block: the LoRA there gets no gradient (in a real run too)
DEAD = tuple(f"transformer_blocks.{DEPTH - 1}.{name}." for name in hunyuanvideo15.DEAD_IN_LAST_BLOCK)

CASES = [
    Case("kandinsky5-video", "t2v-lite-sft-5s", "tread", ("t2v-lite-pretrain-5s",)),
    Case("kandinsky5-video", "i2v-lite-5s", "crepa"),
    # Pro in its SD mode (flash attention): the HD mode's NABLA takes neither TREAD nor a CPU backward
    # (tests/pipelines/test_released_render.py runs NABLA)
    Case("kandinsky5-video", "t2v-pro-sft-5s-sd", "tread", ("t2v-pro-pretrain-5s-sd", "t2v-pro-distilled-5s")),
    Case("kandinsky5-video", "i2v-pro-sft-5s-sd", "crepa", ("i2v-pro-distilled-5s",)),
    Case("kandinsky5-image", "t2i-lite-sft", "crepa", ("t2i-lite-pretrain",)),
    Case("kandinsky5-image", "i2i-lite-sft", "tread", ("i2i-lite-pretrain",)),
    Case("hunyuanvideo-1.5", "t2v-480p", "tread"),
    Case("hunyuanvideo-1.5", "i2v-480p", "crepa"),
    Case("hunyuanvideo-1.5", "t2v-720p", ""),
    Case("hunyuanvideo-1.5", "i2v-720p", ""),
    # Kandinsky 6: one transformer file per size and head (pretrain is sft's); i2v's tail frame, the π-Flow head
    Case("kandinsky6", "lite-t2v", "tread", ("lite-pretrain-t2v",)),
    Case("kandinsky6", "lite-distill-i2v", "crepa", ("lite-distill-t2v",)),
    Case("kandinsky6", "pro-i2v", "tread", ("pro-t2v", "pro-pretrain-t2v", "pro-pretrain-i2v")),
    Case("kandinsky6", "pro-distill-t2v", "crepa", ("pro-distill-i2v",)),
]


def teacher_features(config: LoraflowConfig, family: ModelFamily, frames: int) -> tuple[torch.Tensor, int]:
    """CREPA's cached features of a real-size clip: the released DINOv2 teacher through `patch_features`."""
    teacher = as_loaded(released_model(family.flavour.name, "crepa_encoder", num_hidden_layers=2), torch.float32)
    pixels = family.flavour.num_frames
    indices = latent_frame_indices(pixels, family.vae_temporal_factor) if pixels > 1 else [0]
    assert len(indices) == frames
    clip = torch.zeros(len(indices), *family.flavour.size, 3, dtype=torch.uint8)
    features = patch_features(teacher, clip, config.crepa_encoder_image_size)
    return features[None], teacher.config.hidden_size


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.flavour}")
def test_training_step_at_released_size(case: Case) -> None:
    config = dry_config(case)
    family = get_family(config)
    # the batch is real, as `load_micro_batch` makes it on the CPU; the model and everything it computes are fake
    shape, text, draws, x0 = released_batch(config, family)
    with fake_mode():
        transformer, params = released_transformer(case, config, family)
        crepa, teacher = None, None
        if config.crepa_enabled:
            teacher, width = teacher_features(config, family, shape[2])
            crepa = Crepa(config, family, CrepaProjector(hidden_width(transformer.config), width))
            params += list(crepa.projector.parameters())
        batch = MicroBatch([], x0, text, draws, teacher)
        transformer.train()
        # the values HV1.5's forward asks (are the image tokens all zero, which text tokens are valid) are the batch's
        with known_values(), routing(transformer, family, config, batch.draws.seed):
            terms = flow_terms(transformer, family, batch, torch.device("cpu"), uses_autocast(
                config, torch.device("cpu")), crepa)
            loss, term = terms.flow, terms.crepa
            (loss if term is None else loss + term).backward()
        assert loss.shape == () and loss.dtype == torch.float32
        assert (term is not None) == config.crepa_enabled
        dead = {id(p) for n, p in transformer.named_parameters() if n.startswith(DEAD)}
        if config.train_audio:  # a π-Flow Kandinsky 6 trains its sound (issue 58); this batch is the picture's alone
            dead |= {id(p) for n, p in transformer.named_parameters() if re.search(r"audio_|av_cross|va_cross", n)}
        assert all(p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == torch.float32
                   for p in params if id(p) not in dead)


@pytest.mark.parametrize(("flavour", "patch_conv"), [("t2v-lite-sft-5s", False), ("t2v-lite-sft-5s", True),
                                                     ("t2i-lite-sft", False), ("t2v-480p", False)])
def test_vae_encode_at_released_size(flavour: str, patch_conv: bool) -> None:
    """A real-size clip (the flavour's validation frames and size) through the released VAE as the latents stage
    encodes it (`family.vae_encode`, with `enable_patch_conv` for `vae_enable_patch_conv`): the latent the training
    dry run above feeds the transformer. (HunyuanVideo 1.5's mid-block mask, built one token row at a time by
    diffusers, took minutes on fake tensors: `setup_vae` has `hunyuanvideo15.frame_causal_mask` build it one frame at a
    time.)"""
    case = next(c for c in CASES if c.flavour == flavour)
    family = get_family(dry_config(case))
    clip = torch.zeros(1, family.flavour.num_frames, *family.flavour.size, 3, dtype=torch.uint8)
    with fake_mode(), torch.no_grad():
        vae = as_loaded(released_model(flavour, "vae"), torch.float32)  # the latents stage loads it in fp32
        family.setup_vae(vae)
        if patch_conv:
            assert enable_patch_conv(vae) > 0
        latent = family.vae_encode(vae, clip, "mode")
    assert tuple(latent.shape) == latent_shape(family)


@pytest.mark.parametrize("flavour", ["t2v-lite-sft-5s", "t2i-lite-sft", "lite-t2v"])
def test_text_encoders_at_released_size(flavour: str) -> None:
    """A prompt longer than the tokens Kandinsky 5 and 6 keep (256 video, 512 image; Kandinsky 6 1024), through the
    released Qwen2.5-VL and CLIP-L as `encode_text` runs them (`prompt_tensors`; the offline byte-level tokenizers:
    one token per byte): the row is as wide as the released transformer takes (in_text_dim, in_text_dim2)."""
    from loraflow.pipelines.tiny_parts import clip_tokenizer, qwen_tokenizer

    case = next(c for c in CASES if c.flavour == flavour)
    family = get_family(dry_config(case))
    transformer = released_config(flavour, "transformer")
    tokenizer = qwen_tokenizer()
    crop = kandinsky5.template_crop(tokenizer, family.prompt_template)
    with fake_mode(), torch.no_grad():
        components = {"tokenizer": tokenizer, "tokenizer_2": clip_tokenizer(),
                      **{c: as_loaded(released_model(flavour, c), torch.bfloat16)
                         for c in ("text_encoder", "text_encoder_2")}}
        row = family.prompt_tensors(components, "a cat " * 200, crop)
    assert tuple(row["text_embeds"].shape) == (family.max_text_tokens, transformer["in_text_dim"])
    assert tuple(row["pooled_embeds"].shape) == (transformer["in_text_dim2"],)
    assert row["truncated"]
