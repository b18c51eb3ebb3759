"""HunyuanVideo 1.5's key-mask attention (loraflow/pipelines/hunyuanvideo15/attention.py) against diffusers' own
processor, on the tiny real transformer: the same forward output and the same gradients, bit for bit, with text
padded differently per sample (batch 2) and the t2v image tokens masked, as `velocity` and renders call it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from loraflow.pipelines.base import load_component
from loraflow.pipelines.hunyuanvideo15.attention import KeyMaskProcessor, key_mask_attention


@pytest.fixture(scope="module")
def tiny_hv15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.tiny import build_tiny

    return build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("models") / "hunyuanvideo-1.5")


def forward_and_grads(transformer: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    config, generator = transformer.config, torch.Generator().manual_seed(0)
    text_mask, glyph_mask = torch.ones(2, 7), torch.ones(2, 5)
    text_mask[1, 4:], glyph_mask[0, 3:] = 0, 0  # padded text: the second sample's, the first's glyphs
    out = transformer(
        hidden_states=torch.randn(2, config.in_channels, 3, 4, 6, generator=generator),
        image_embeds=torch.zeros(2, 729, config.image_embed_dim),  # t2v: the image tokens are masked
        timestep=torch.tensor([500.0, 300.0]),
        encoder_hidden_states=torch.randn(2, 7, config.text_embed_dim, generator=generator),
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=torch.randn(2, 5, config.text_embed_2_dim, generator=generator),
        encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}


def test_key_mask_attention_equals_diffusers_bit_for_bit(tiny_hv15: Path) -> None:
    theirs = load_component(tiny_hv15, "transformer").requires_grad_(True)
    ours = copy.deepcopy(theirs)
    key_mask_attention(ours)
    assert all(isinstance(b.attn.processor, KeyMaskProcessor) for b in ours.transformer_blocks)
    assert not any(isinstance(b.attn.processor, KeyMaskProcessor) for b in theirs.transformer_blocks)
    (out, grads), (expected, expected_grads) = forward_and_grads(ours), forward_and_grads(theirs)
    assert torch.equal(out, expected)
    assert grads.keys() == expected_grads.keys() and len(grads) > 100
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)
    assert any(grads[n].abs().sum() > 0 for n in grads if "attn.add_k_proj" in n)  # the text stream is in play
