"""HunyuanVideo 1.5's key-mask attention (loraflow/pipelines/hunyuanvideo15/attention.py) against diffusers' own
processor, on the tiny real transformer: the same forward output and the same gradients, bit for bit, with text
padded differently per sample (batch 2) and the t2v image tokens masked, as `velocity` and renders call it; and where
every sample has the same number of valid text tokens (batch 1, or a batch padded alike), the unmasked call over the
valid tokens only, equal to diffusers' masked one up to the order of its sums."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from loraflow.pipelines.base import load_component
from loraflow.pipelines.hunyuanvideo15.attention import KeyMaskProcessor, key_mask_attention
from tests.numerics import FLOAT64_AGREEMENT, assert_float64_close


def forward_and_grads(transformer: torch.nn.Module, batch: int = 2, alike: bool = False, t2v: bool = True,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward. Padded text: by default the second sample's text and the first's glyphs (rows of
    other lengths: the key mask); `alike`: every sample's text and glyphs padded the same (no mask)."""
    config, generator = transformer.config, torch.Generator().manual_seed(0)
    dtype = transformer.dtype
    text_mask, glyph_mask = torch.ones(batch, 7, dtype=dtype), torch.ones(batch, 5, dtype=dtype)
    if alike:
        text_mask[:, 4:], glyph_mask[:, 3:] = 0, 0
    else:
        text_mask[1, 4:], glyph_mask[0, 3:] = 0, 0
    image = (torch.zeros(batch, 729, config.image_embed_dim, dtype=dtype) if t2v  # t2v: the image tokens are masked
             else torch.randn(batch, 729, config.image_embed_dim, generator=generator, dtype=dtype))
    transformer.zero_grad(set_to_none=True)
    out = transformer(
        hidden_states=torch.randn(batch, config.in_channels, 3, 4, 6, generator=generator, dtype=dtype),
        image_embeds=image,
        timestep=torch.tensor([500.0, 300.0][:batch], dtype=dtype),
        encoder_hidden_states=torch.randn(batch, 7, config.text_embed_dim, generator=generator, dtype=dtype),
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=torch.randn(batch, 5, config.text_embed_2_dim, generator=generator, dtype=dtype),
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


@pytest.mark.parametrize(("batch", "t2v"), [(1, True), (1, False), (2, True)])
def test_unmasked_attention_over_the_valid_tokens_equals_diffusers_masked_one(tiny_hv15: Path, batch: int,
                                                                               t2v: bool) -> None:
    """Every sample's text padded alike (batch 1 always): the processor drops the padding (and a t2v sample's 729
    image tokens) and passes no mask. A valid query's softmax then sums over the same keys less the masked zeros, in
    another order: in float64 the two agree to FLOAT64_AGREEMENT (tests/numerics.py) of each tensor's magnitude. A
    gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of every key) is rounding noise on
    both sides, so each gradient is held to the largest of its module's (weight and bias) magnitudes."""
    theirs = load_component(tiny_hv15, "transformer").double().requires_grad_(True)
    ours = copy.deepcopy(theirs)
    key_mask_attention(ours)
    calls = []  # each main-block attention call: the valid text count it used, its text output's magnitudes
    for block in ours.transformer_blocks:
        block.attn.register_forward_hook(lambda attn, args, out: calls.append(
            (attn.processor.valid_text.valid, out[1].abs().sum(-1))))
    (out, grads), (expected, expected_grads) = (forward_and_grads(m, batch, alike=True, t2v=t2v)
                                                for m in (ours, theirs))
    valid = 4 + 3 + (0 if t2v else 729)  # text, glyphs, and i2v's image tokens
    assert [c[0] for c in calls] == [valid] * len(ours.transformer_blocks)
    assert all((c[1][:, valid:] == 0).all() for c in calls)  # the padded tokens were not computed
    assert_float64_close(out, expected)
    assert grads.keys() == expected_grads.keys() and len(grads) > 100
    scale: dict[str, float] = {}
    for name, grad in expected_grads.items():
        module = name.rsplit(".", 1)[0]
        scale[module] = max(scale.get(module, 0.0), grad.abs().max().item())
    worst = max(((grads[n] - expected_grads[n]).abs().max() / (FLOAT64_AGREEMENT * scale[n.rsplit(".", 1)[0]]))
                .item() for n in grads if scale[n.rsplit(".", 1)[0]] > 0)
    assert worst <= 1, f"a gradient differs by {worst:.3g} x the tolerance"
