"""Exactness of loraflow.kernels.patch_conv against the stock diffusers Hunyuan VAE forwards.

Tiny random VAEs (few channels) with the real compression factors (HV: 8x spatial / 4x temporal,
HV1.5: 16x / 4x), on CPU. The patched forwards compute the stock ones' math in other pieces: a slab is a
smaller conv3d, which the backend may block or sum in another order; the block-causal attention leaves out
the keys the stock mask weights by exp(-inf) = 0; the encoder streams frames. So they differ by rounding only,
and the tests bound that rounding, not a number seen on one machine (tests/numerics.py):
* one conv, in float32 (the latents stage's dtype): each output sums n = C_in * k^3 products and the bias, and any
  order errs by at most gamma_n * sum|w x| (Higham): patched and stock differ by at most twice that, per element.
* whole encoders and decoders, attention, gradients: in float64, within FLOAT64_AGREEMENT of the largest output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

from loraflow.kernels import patch_conv as pc
from tests.numerics import U32, assert_float64_close, gamma


def _hv() -> AutoencoderKLHunyuanVideo:
    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(
        block_out_channels=(8, 16, 32, 32), norm_num_groups=4, latent_channels=4, layers_per_block=1
    ).eval()


def _hv15() -> AutoencoderKLHunyuanVideo15:
    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo15(block_out_channels=(8, 16, 32, 64, 64), latent_channels=4,
                                       layers_per_block=1).eval()


@pytest.fixture(scope="module")
def vaes() -> dict[str, torch.nn.Module]:
    """In float64 (see the module docstring)."""
    return {"hv": _hv().double(), "hv15": _hv15().double()}


def _causal_convs(vae: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in vae.modules() if hasattr(m, "time_causal_padding")]


def _distinct_convs(vaes: dict[str, torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    seen, out = set(), []
    for name, vae in vaes.items():
        for m in _causal_convs(vae):
            c = m.conv
            key = (c.in_channels, c.out_channels, c.kernel_size, c.stride, c.dilation, c.padding,
                   m.time_causal_padding, m.pad_mode)
            if key not in seen:
                seen.add(key)
                out.append((f"{name}:{key}", m))
    return out


def _stock(module: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, *args)


def _rounding_bound(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per output element, the most two float32 evaluations of the causal conv can differ by, in whatever order
    each adds its n = C_in / groups * k^3 products and the bias: 2 gamma_n (sum|w x| + |b|), the absolute terms
    summed in float64 (so that the bound itself does not round down)."""
    conv = module.conv
    n = conv.in_channels // conv.groups * conv.weight[0, 0].numel() + 1
    padded = F.pad(x, module.time_causal_padding, mode=module.pad_mode).abs().double()
    bias = conv.bias.abs().double() if conv.bias is not None else None
    terms = F.conv3d(padded, conv.weight.abs().double(), bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    return 2 * gamma(n, U32) * terms


def test_every_distinct_conv_matches_with_many_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    convs = _distinct_convs({"hv": _hv(), "hv15": _hv15()})  # float32: one conv's rounding is bounded exactly
    kinds = {(m.conv.kernel_size, m.conv.stride) for _, m in convs}
    assert ((3, 3, 3), (1, 1, 1)) in kinds and ((1, 1, 1), (1, 1, 1)) in kinds and ((3, 3, 3), (2, 2, 2)) in kinds
    calls = []
    real_conv3d = F.conv3d
    monkeypatch.setattr(F, "conv3d", lambda *a, **k: calls.append(1) or real_conv3d(*a, **k))
    torch.manual_seed(1)
    for label, m in convs:
        for shape in [(2, m.conv.in_channels, 5, 9, 7), (1, m.conv.in_channels, 1, 6, 10),
                      (1, m.conv.in_channels, 6, 4, 4)]:
            x = torch.randn(shape)
            with torch.no_grad():
                ref = _stock(m, x)
                bound = _rounding_bound(m, x)
                off_by_one_row = _stock(m, x.roll(1, dims=3))  # what a slab reading the wrong rows would see
                assert ((off_by_one_row - ref).abs() > bound).any(), label  # the bound has teeth
                T_out, H_out = ref.shape[2], ref.shape[3]
                for budget, expect_calls in [(1, T_out * H_out), (None, None)]:
                    if budget is None:  # a budget that fits ~2 output frames: temporal split only
                        budget = 2 * (ref[:, :, :1].numel() + x[:, :, :3].numel() * 2) * x.element_size()
                    setattr(m, pc._ATTR, budget)
                    calls.clear()
                    try:
                        got = pc._conv_forward(m, x)
                    finally:
                        delattr(m, pc._ATTR)
                    assert got.shape == ref.shape, label
                    worst = ((got - ref).abs() / bound).max().item()
                    assert worst <= 1, (label, shape, budget, worst)
                    if expect_calls is not None:
                        assert len(calls) == expect_calls, (label, shape)  # one conv3d per (T, H) slab


@pytest.mark.parametrize("name", ["hv", "hv15"])
@pytest.mark.parametrize("frames,height,width", [(1, 32, 48), (5, 48, 32), (9, 32, 64), (17, 16, 32)])
@pytest.mark.parametrize("budget", [1, 256 * 2**20])
def test_whole_encode_matches(vaes: dict[str, torch.nn.Module], name: str, frames: int, height: int, width: int,
                              budget: int) -> None:
    vae = vaes[name]
    torch.manual_seed(frames * height + width)
    x = (torch.rand(1, 3, frames, height, width) * 2 - 1).double()
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        n = pc.enable_patch_conv(vae, max_slab_bytes=budget)
        try:
            got = vae.encode(x).latent_dist
        finally:
            pc.disable_patch_conv(vae)
    assert n > len(_causal_convs(vae)) - 1
    for a, b in [(ref.mode(), got.mode()), (ref.mean, got.mean), (ref.std, got.std)]:
        assert a.shape == b.shape
        assert_float64_close(b, a)


def test_hv15_encoder_streams_in_chunks(vaes: dict[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    # With a tiny budget the 17-frame clip must go through conv_in in 4 chunks (5 + 4 + 4 + 4 frames).
    vae = vaes["hv15"]
    seen: list[int] = []
    handle = vae.encoder.conv_in.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[2]))
    x = torch.randn(1, 3, 17, 32, 32, dtype=torch.float64)
    try:
        with torch.no_grad():
            ref = vae.encode(x).latent_dist.mode()
            seen.clear()
            pc.enable_patch_conv(vae, max_slab_bytes=1)
            got = vae.encode(x).latent_dist.mode()
        assert seen == [5, 4, 4, 4]
        assert_float64_close(got, ref)
        seen.clear()
        with torch.enable_grad():  # autograd: no streaming (caches would fight recomputation)
            got_grad = vae.encode(x).latent_dist.mode()
        assert seen == [17]
        assert_float64_close(got_grad.detach(), ref)
    finally:
        handle.remove()
        pc.disable_patch_conv(vae)


def test_hv_batch_and_framewise(vaes: dict[str, torch.nn.Module]) -> None:
    vae = vaes["hv"]
    x = torch.randn(2, 3, 9, 24, 40, dtype=torch.float64)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mode()
        pc.enable_patch_conv(vae, max_slab_bytes=2048)
        try:
            got = vae.encode(x).latent_dist.mode()
        finally:
            pc.disable_patch_conv(vae)
    assert_float64_close(got, ref)


def test_hv15_batch_of_two_matches_per_sample_stock(vaes: dict[str, torch.nn.Module]) -> None:
    # The stock HV1.5 mid-block mask breaks for batch > 1; the patched attention has no mask.
    vae = vaes["hv15"]
    x = torch.randn(2, 3, 9, 32, 16, dtype=torch.float64)
    with torch.no_grad():
        ref = torch.cat([vae.encode(x[i : i + 1]).latent_dist.mode() for i in range(2)])
        pc.enable_patch_conv(vae, max_slab_bytes=1)
        try:
            got = vae.encode(x).latent_dist.mode()
        finally:
            pc.disable_patch_conv(vae)
    assert_float64_close(got, ref)


@pytest.mark.parametrize("heads,frames,hw,budget", [(1, 3, 6, 1), (2, 4, 5, 10_000), (3, 1, 7, 2**30)])
def test_block_causal_sdpa_matches_masked_sdpa(heads: int, frames: int, hw: int, budget: int) -> None:
    torch.manual_seed(heads)
    q, k, v = (torch.randn(2, heads, frames * hw, 8, dtype=torch.float64) for _ in range(3))
    mask = prepare_causal_attention_mask(frames, hw, q.dtype, q.device)  # stock (L, L) additive mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = pc.block_causal_sdpa(q, k, v, hw, budget)
    assert_float64_close(got, ref)
    if frames > 1:  # the mask matters: attention over every key is another result
        assert (F.scaled_dot_product_attention(q, k, v) - ref).abs().max() > 1e-3


def test_attention_modules_match(vaes: dict[str, torch.nn.Module]) -> None:
    torch.manual_seed(3)
    for vae in vaes.values():
        for mid in (vae.encoder.mid_block, vae.decoder.mid_block):
            C = mid.resnets[0].conv1.conv.in_channels
            x = torch.randn(1, C, 3, 4, 5, dtype=torch.float64)  # (B, C, T, H, W) at latent resolution
            with torch.no_grad():
                ref = _stock(mid, x)
                n = pc.enable_patch_conv(mid, max_slab_bytes=64)  # forces query-row chunking
                try:
                    got = mid(x)
                finally:
                    pc.disable_patch_conv(mid)
            assert n >= 5
            assert_float64_close(got, ref)


@pytest.mark.parametrize("name", ["hv", "hv15"])
def test_decode_matches(vaes: dict[str, torch.nn.Module], name: str) -> None:
    vae = vaes[name]
    z = torch.randn(1, vae.config.latent_channels, 3, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = vae.decode(z).sample
        pc.enable_patch_conv(vae, max_slab_bytes=4096)
        try:
            got = vae.decode(z).sample
        finally:
            pc.disable_patch_conv(vae)
    assert_float64_close(got, ref)


def test_conv_gradients_match(vaes: dict[str, torch.nn.Module]) -> None:
    m = vaes["hv15"].encoder.down_blocks[1].resnets[0].conv1
    x = torch.randn(1, m.conv.in_channels, 4, 6, 5, dtype=torch.float64, requires_grad=True)
    ref = _stock(m, x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    pc.enable_patch_conv(m, max_slab_bytes=1)
    try:
        got = m(x)
        (g_got,) = torch.autograd.grad(got.square().sum(), x)
    finally:
        pc.disable_patch_conv(m)
    assert_float64_close(got.detach(), ref.detach())
    assert_float64_close(g_got, g_ref)


def test_idempotent_state_dict_and_disable() -> None:
    vae = _hv15()
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    n1 = pc.enable_patch_conv(vae, max_slab_bytes=1024)
    n2 = pc.enable_patch_conv(vae, max_slab_bytes=2048)
    assert n1 == n2 > 0
    convs = _causal_convs(vae)
    assert all(pc.is_patched(m) and getattr(m, pc._ATTR) == 2048 for m in convs)
    after = vae.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert sum(1 for _ in vae.parameters()) == sum(1 for _ in _hv15().parameters())  # no copied weights
    assert pc.disable_patch_conv(vae) == n1
    assert pc.disable_patch_conv(vae) == 0
    assert not any("forward" in m.__dict__ or pc.is_patched(m) for m in vae.modules())
    with pytest.raises(ValueError):
        pc.enable_patch_conv(vae, max_slab_bytes=0)
