"""TREAD routing on the real tiny Kandinsky 5 and HunyuanVideo 1.5 transformers, called directly.

The layouts are written out here (tests may know families); the K5 one must equal the family's hook.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel, Kandinsky5Transformer3DModel

from loraflow.kernels.tread import TokenLayout, resolve_routes, tread_routing

K5 = TokenLayout("visual_transformer_blocks", rope_arg=3, rope_token_dim=1, depth="num_visual_blocks")
HV15 = TokenLayout("transformer_blocks", rope_arg=4, rope_token_dim=0, output_index=0, depth="num_layers")


def route(ratio: float, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(selection_ratio=ratio, start_layer_idx=start, end_layer_idx=end)


@pytest.fixture(scope="module")
def k5(tiny_k5: Path) -> Kandinsky5Transformer3DModel:
    return Kandinsky5Transformer3DModel.from_pretrained(tiny_k5 / "transformer").requires_grad_(False)


@pytest.fixture(scope="module")
def hv15(tmp_path_factory: pytest.TempPathFactory) -> HunyuanVideo15Transformer3DModel:
    from loraflow.demo.tiny import build_tiny

    path = build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("models") / "hv15")
    return HunyuanVideo15Transformer3DModel.from_pretrained(path / "transformer").requires_grad_(False)


def k5_inputs(model: Kandinsky5Transformer3DModel, batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    frames, h, w, text = 3, 8, 12, 6
    return dict(
        hidden_states=torch.randn(batch, frames, h, w, 2 * model.config.in_visual_dim + 1, generator=g),
        encoder_hidden_states=torch.randn(batch, text, model.config.in_text_dim, generator=g),
        pooled_projections=torch.randn(batch, model.config.in_text_dim2, generator=g),
        timestep=torch.tensor([300.0, 700.0][:batch]),
        visual_rope_pos=[torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
        text_rope_pos=torch.arange(text), scale_factor=(1, 2, 2), sparse_params=None, return_dict=False)


def hv15_inputs(model: HunyuanVideo15Transformer3DModel, batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    config = model.config
    mask = torch.ones(batch, 7)
    mask[1, 5:] = 0
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, 2, 4, 6, generator=g),
        timestep=torch.tensor([300.0, 700.0][:batch]),
        encoder_hidden_states=torch.randn(batch, 7, config.text_embed_dim, generator=g), encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(batch, 4, config.text_embed_2_dim, generator=g),
        encoder_attention_mask_2=torch.ones(batch, 4),
        image_embeds=torch.zeros(batch, 729, config.image_embed_dim), return_dict=False)


def out_and_grads(model: torch.nn.Module, inputs: dict, layout: TokenLayout | None = None, routes=(),
                  seed: int = 0, checkpointing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and the gradient of mean(out^2) w.r.t. every block's first linear weight."""
    blocks = getattr(model, model_blocks(model))
    weights = [next(b.parameters()) for b in blocks]
    for w in weights:
        w.requires_grad_(True)
        w.grad = None
    if checkpointing:
        model.enable_gradient_checkpointing()
    try:
        if layout is None:
            out = model(**inputs)[0]
            out.square().mean().backward()
        else:
            with tread_routing(model, layout, routes, torch.Generator().manual_seed(seed)):
                out = model(**inputs)[0]
                out.square().mean().backward()
    finally:
        model.disable_gradient_checkpointing()
        for w in weights:
            w.requires_grad_(False)
    return out.detach(), torch.cat([w.grad.flatten() for w in weights])


def model_blocks(model: torch.nn.Module) -> str:
    return K5.blocks if isinstance(model, Kandinsky5Transformer3DModel) else HV15.blocks


@pytest.mark.parametrize("name", ["k5", "hv15"])
def test_ratio_zero_is_exactly_no_routing(name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(name)
    layout, inputs = (K5, k5_inputs(model)) if name == "k5" else (HV15, hv15_inputs(model))
    plain, plain_grads = out_and_grads(model, inputs)
    routed, routed_grads = out_and_grads(model, inputs, layout, [route(0.0, 0, -1)])
    # bit for bit by construction: ratio 0 keeps every token in order (a gather and a scatter of all of them are
    # copies), so every block runs the same ops on the same shapes
    assert torch.equal(plain, routed) and torch.equal(plain_grads, routed_grads)
    assert plain_grads.abs().max() > 0


@pytest.mark.parametrize("name", ["k5", "hv15"])
def test_routed_blocks_see_half_the_tokens(name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(name)
    layout, inputs = (K5, k5_inputs(model)) if name == "k5" else (HV15, hv15_inputs(model))
    blocks = getattr(model, layout.blocks)
    seen: dict[int, list[int]] = {i: [] for i in range(len(blocks))}
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].shape[1])) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            full = model(**inputs)[0]
            with tread_routing(model, layout, [route(0.5, -1, -1)], torch.Generator().manual_seed(0)):
                routed = model(**inputs)[0]
    finally:
        for hook in hooks:
            hook.remove()
    tokens = seen[0][0]
    assert seen[0] == [tokens, tokens] and seen[1] == [tokens, tokens // 2]  # block 0 unrouted, block 1 routed
    assert routed.shape == full.shape and not torch.equal(routed, full)
    assert all(type(b).__name__.endswith("Block") for b in blocks)  # the original blocks are back


def test_skipped_tokens_pass_the_span_unchanged(k5: Kandinsky5Transformer3DModel) -> None:
    blocks, captured = k5.visual_transformer_blocks, {}
    hooks = [k5.visual_embeddings.register_forward_hook(lambda m, a, out: captured.update(entering=out)),  # None:
             blocks[-1].register_forward_hook(lambda m, a, out: captured.update(kept=out)),  # they change nothing
             k5.out_layer.register_forward_pre_hook(lambda m, a: captured.update(leaving=a[0]))]
    try:
        with torch.no_grad(), tread_routing(k5, K5, [route(0.5, 0, -1)], torch.Generator().manual_seed(3)):
            k5(**k5_inputs(k5))
    finally:
        for hook in hooks:
            hook.remove()
    before, after = (captured[k].flatten(1, 3) for k in ("entering", "leaving"))  # (B, N, D) into / out of the span
    changed = (after != before).any(-1).any(0)  # (N,) the tokens the span processed
    assert changed.sum() == captured["kept"].shape[1] == before.shape[1] // 2


def test_checkpointing_recompute_reuses_the_token_subset(k5: Kandinsky5Transformer3DModel) -> None:
    inputs = k5_inputs(k5)
    out, grads = out_and_grads(k5, inputs, K5, [route(0.5, 0, 0)], seed=5)
    # bit for bit: the recompute routes the same subset through the same ops on the same shapes
    again, again_grads = out_and_grads(k5, inputs, K5, [route(0.5, 0, 0)], seed=5, checkpointing=True)
    other, _ = out_and_grads(k5, inputs, K5, [route(0.5, 0, 0)], seed=6)
    assert torch.equal(out, again) and torch.equal(grads, again_grads)
    assert not torch.equal(out, other)  # the seed picks the subset


def test_routes_resolve_negative_indices_and_refuse_bad_spans() -> None:
    assert resolve_routes([route(0.5, 2, -2)], 32) == [(0.5, 2, 30)]
    assert resolve_routes([route(0.25, 0, 3), route(0.5, -4, -1)], 8) == [(0.25, 0, 3), (0.5, 4, 7)]
    with pytest.raises(ValueError, match=r"routes\[0\].*resolve to 2\.\.0"):
        resolve_routes([route(0.5, 2, -2)], 2)
    with pytest.raises(ValueError, match="overlap"):
        resolve_routes([route(0.5, 0, 4), route(0.5, 4, 6)], 8)
    with pytest.raises(ValueError, match=r"selection_ratio must be in \[0, 1\)"):
        resolve_routes([route(1.0, 0, 1)], 8)


def test_each_family_declares_the_layout_tested_here() -> None:
    from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15
    from loraflow.pipelines.kandinsky5.image import family as kandinsky5_image
    from loraflow.pipelines.kandinsky5.video import family as kandinsky5_video

    assert kandinsky5_video.make_family(None).tread_layout == K5
    assert kandinsky5_image.make_family(None).tread_layout == K5
    assert hunyuanvideo15.make_family(None).tread_layout == HV15
