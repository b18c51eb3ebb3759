"""Exact, memory-bounded forwards for the Hunyuan video VAEs (`vae_enable_patch_conv`).

`enable_patch_conv(vae)` replaces, per module instance, the `forward` of

* every causal conv wrapper (`HunyuanVideoCausalConv3d`, `HunyuanVideo15CausalConv3d`). The stock
  forward makes a fully padded copy of its input (`F.pad(..., "replicate")`) and runs one huge
  conv3d (plus backend workspace). The patched one convolves one slab at a time: output rows
  [o0, o1) read padded rows [o0*s, (o1-1)*s + d*(k-1) + 1); the slab is a view of the input, padded
  with the module's own mode only where it overlaps the pad region (replicate == edge copies, the
  causal front pad == k-1 copies of frame 0), and its result goes into a preallocated output.
* the mid-block attention. The stock code builds an L x L additive mask (L = T*H*W latent tokens;
  ~4.9 GB bf16 for HV1.5 at 480p x 121 frames, and HV1.5 fills it in a Python loop over L). The mask
  is block-causal by latent frame, so the patched attention runs SDPA per query frame on the key
  prefix with no mask. Masked logits are -inf and exp(-inf) == 0: the same softmax.
* the HV1.5 encoder (and its temporal downsamplers). Everything before its mid block is causal in
  time and frame-local otherwise (RMS norm is per voxel, convs are causal, downsampling packs frame
  pairs), so under no_grad the clip is pushed through conv_in + down blocks a few frames at a time,
  each causal conv keeping its last k-1 padded input frames as the next chunk's front padding.
  Peak memory then no longer grows with the clip length. Layer-wise slabbing alone cannot reach
  720p x 121 frames in 24 GB: one full-res activation (128 ch) is already 28.5 GB in bf16.
  The HV (v1) encoder uses GroupNorm over the whole clip, so it cannot be streamed exactly.

Norms are never split (GroupNorm stays global). Only `forward` attributes are set on instances, so parameters,
`state_dict()` and `from_pretrained()` are unaffected; `disable_patch_conv` removes them.
"""

from __future__ import annotations

import contextvars
import types

import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_loraflow_patch_conv"  # instance attribute holding the budget in bytes
# While the HV1.5 encoder streams: {"first": bool, id(conv): cached front frames}.
_STREAM: contextvars.ContextVar[dict | None] = contextvars.ContextVar("loraflow_vae_stream", default=None)


def _conv_out_len(n_padded: int, k: int, s: int, d: int) -> int:
    return (n_padded - d * (k - 1) - 1) // s + 1


def _source_range(p0: int, p1: int, lo: int, n: int) -> tuple[int, int, int, int]:
    """Padded rows [p0, p1) of an axis of length n with `lo` rows of front padding, as an
    unpadded source range [s, e) plus (front, back) rows of padding to re-create around it."""
    s, e = max(p0 - lo, 0), min(p1 - lo, n)
    return s, e, s - (p0 - lo), (p1 - lo) - e


def _slab_conv(self: nn.Module, x: torch.Tensor, t_lo: int) -> torch.Tensor:
    # x: (B, C_in, T, H, W); F.pad's tuple is (W_lo, W_hi, H_lo, H_hi, T_lo, T_hi).
    conv: nn.Conv3d = self.conv
    budget: int = getattr(self, _ATTR)
    w_lo, w_hi, h_lo, h_hi, _, t_hi = self.time_causal_padding
    B, C, T, H, W = x.shape
    (kt, kh, kw), (st, sh, sw), (dt, dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    Tp, Hp, Wp = T + t_lo + t_hi, H + h_lo + h_hi, W + w_lo + w_hi
    To, Ho, Wo = _conv_out_len(Tp, kt, st, dt), _conv_out_len(Hp, kh, sh, dh), _conv_out_len(Wp, kw, sw, dw)
    elt = x.element_size()

    def cost(nt: int, nh: int) -> int:  # bytes of one padded input slab + its output slab
        in_t, in_h = (nt - 1) * st + dt * (kt - 1) + 1, (nh - 1) * sh + dh * (kh - 1) + 1
        return B * elt * (C * in_t * in_h * Wp + conv.out_channels * nt * nh * Wo)

    # Largest T slab in budget; if a single output frame is still too big, split H as well.
    nt = max((n for n in range(1, To + 1) if cost(n, Ho) <= budget), default=1)
    nh = Ho if cost(nt, Ho) <= budget else max((n for n in range(1, Ho + 1) if cost(1, n) <= budget), default=1)
    if nt == To and nh == Ho:  # one slab: exactly the stock computation
        return conv(F.pad(x, (w_lo, w_hi, h_lo, h_hi, t_lo, t_hi), mode=self.pad_mode))

    out = x.new_empty(B, conv.out_channels, To, Ho, Wo)  # (B, C_out, T_out, H_out, W_out)
    for o_t in range(0, To, nt):
        e_t = min(o_t + nt, To)
        ts, te, tf, tb = _source_range(o_t * st, (e_t - 1) * st + dt * (kt - 1) + 1, t_lo, T)
        for o_h in range(0, Ho, nh):
            e_h = min(o_h + nh, Ho)
            hs, he, hf, hb = _source_range(o_h * sh, (e_h - 1) * sh + dh * (kh - 1) + 1, h_lo, H)
            # The slice is a view; F.pad re-creates only the padding this slab overlaps, so the
            # slab itself is the only copy made.
            slab = F.pad(x[:, :, ts:te, hs:he], (w_lo, w_hi, hf, hb, tf, tb), mode=self.pad_mode)
            out[:, :, o_t:e_t, o_h:e_h] = F.conv3d(
                slab, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups
            )
            del slab
    return out


def _conv_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pad = t_lo = self.time_causal_padding[4]  # causal front pad: k-1 frames
    stream = _STREAM.get()
    if stream is None or pad == 0:
        return _slab_conv(self, x, t_lo)
    prev = stream.get(id(self))
    if prev is not None:  # later chunk: the previous chunk's last k-1 frames replace the causal pad
        x, t_lo = torch.cat([prev, x], dim=2), 0
    # Keep the last `pad` frames of the time-padded input for the next chunk (clamped index ==
    # replicate pad, which matters when the first chunk is shorter than the pad).
    T = x.shape[2]
    tail = torch.arange(T + t_lo - pad, T + t_lo, device=x.device) - t_lo
    stream[id(self)] = x.index_select(2, tail.clamp_(0, T - 1))
    return _slab_conv(self, x, t_lo)


def block_causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens_per_frame: int, max_block_bytes: int
) -> torch.Tensor:
    """SDPA under the VAE's block-causal frame mask, without building the mask.

    q, k, v: (B, heads, L, D), L = frames * tokens_per_frame, frame-major. Queries of frame f see
    keys [0, (f + 1) * tokens_per_frame). Query rows are chunked so that one fp32 score block
    (rows x keys, what the math/CPU kernels materialise) stays under max_block_bytes."""
    B, n_heads, L, _ = q.shape
    out = q.new_empty(B, n_heads, L, v.shape[-1])
    for f in range(L // tokens_per_frame):
        q0, keys = f * tokens_per_frame, (f + 1) * tokens_per_frame
        rows = max(1, min(tokens_per_frame, max_block_bytes // (4 * B * n_heads * keys)))
        for r in range(q0, keys, rows):
            r1 = min(r + rows, keys)
            out[:, :, r:r1] = F.scaled_dot_product_attention(q[:, :, r:r1], k[:, :, :keys], v[:, :, :keys])
    return out


def _hv15_attn_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Mirrors HunyuanVideo15AttnBlock.forward; x: (B, C, T, H, W), one head of dim C.
    identity = x
    x = self.norm(x)
    q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
    B, C, T, H, W = q.shape
    q, k, v = (t.reshape(B, C, T * H * W).permute(0, 2, 1).unsqueeze(1).contiguous() for t in (q, k, v))  # (B, 1, L, C)
    x = block_causal_sdpa(q, k, v, H * W, getattr(self, _ATTR))
    x = x.squeeze(1).reshape(B, T, H, W, C).permute(0, 4, 1, 2, 3)  # back to (B, C, T, H, W)
    return self.proj_out(x) + identity


def _hv_attention(attn: nn.Module, hs: torch.Tensor, tokens_per_frame: int, budget: int) -> torch.Tensor:
    # Mirrors diffusers' AttnProcessor2_0 for self-attention; hs: (B, L, C), frame-major.
    residual = hs
    if attn.group_norm is not None:
        hs = attn.group_norm(hs.transpose(1, 2)).transpose(1, 2)
    q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
    B, head_dim = hs.shape[0], k.shape[-1] // attn.heads
    q, k, v = (t.view(B, -1, attn.heads, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, heads, L, D)
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    hs = block_causal_sdpa(q, k, v, tokens_per_frame, budget)
    hs = hs.transpose(1, 2).reshape(B, -1, attn.heads * head_dim).to(q.dtype)
    hs = attn.to_out[1](attn.to_out[0](hs))
    if attn.residual_connection:
        hs = hs + residual
    return hs / attn.rescale_output_factor


def _hv_mid_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # Mirrors HunyuanVideoMidBlock3D.forward minus the L x L mask; hidden_states: (B, C, T, H, W).
    ckpt = torch.is_grad_enabled() and self.gradient_checkpointing
    run = (lambda m, h: self._gradient_checkpointing_func(m, h)) if ckpt else (lambda m, h: m(h))
    hidden_states = run(self.resnets[0], hidden_states)
    for attn, resnet in zip(self.attentions, self.resnets[1:]):
        if attn is not None:
            _, _, T, H, W = hidden_states.shape
            hs = hidden_states.permute(0, 2, 3, 4, 1).flatten(1, 3)  # (B, T*H*W, C)
            hs = _hv_attention(attn, hs, H * W, getattr(self, _ATTR))
            hidden_states = hs.unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)
        hidden_states = run(resnet, hidden_states)
    return hidden_states


def _hv15_downsample_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    stream = _STREAM.get()
    if stream is None or stream["first"] or not self.add_temporal_downsample:
        return type(self).forward(self, x)
    # A later chunk starts on a frame pair of the full clip: every frame is a "next" frame, i.e. the
    # stock x[:, :, 1:] branch applied to the whole chunk. x: (B, C, T, H, W), T even.
    h = self._dcae_downsample_rearrange(self.conv(x), r1=2, r2=2, r3=2)
    s = self._dcae_downsample_rearrange(x, r1=2, r2=2, r3=2)
    B, _, T, H, W = s.shape
    return h + s.view(B, h.shape[1], self.group_size, T, H, W).mean(dim=2)


def _hv15_encoder_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x: (B, C, T, H, W) with T = 1 + r*n. Chunks: [0, 1 + step), then `step` frames each (a
    # multiple of r), so every chunk's temporal downsampling pairs the same frames as the full clip.
    r = 2 ** sum(d.add_temporal_downsample for b in self.down_blocks for d in (b.downsamplers or []))
    B, _, T, H, W = x.shape
    per_frame = B * self.conv_in.conv.out_channels * H * W * x.element_size()  # level-0 activation
    step = max(r, getattr(self, _ATTR) // per_frame // r * r)
    if torch.is_grad_enabled() or (T - 1) % r or T <= 1 + step:
        return type(self).forward(self, x)  # streaming would fight autograd / checkpointing
    bounds = [0, *range(1 + step, T, step), T]
    token = _STREAM.set(state := {"first": True})
    try:
        feats = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            state["first"] = i == 0
            h = self.conv_in(x[:, :, a:b])
            for down_block in self.down_blocks:
                h = down_block(h)
            feats.append(h)
            del h
    finally:
        _STREAM.reset(token)
    hidden_states = torch.cat(feats, dim=2)
    del feats
    # The rest mirrors HunyuanVideo15Encoder3D.forward (all at latent resolution).
    hidden_states = self.mid_block(hidden_states)
    batch_size, _, frame, height, width = hidden_states.shape
    short_cut = hidden_states.view(batch_size, -1, self.group_size, frame, height, width).mean(dim=2)
    hidden_states = self.conv_out(self.conv_act(self.norm_out(hidden_states)))
    hidden_states += short_cut
    return hidden_states


def _targets(vae: nn.Module) -> list[tuple[nn.Module, types.FunctionType]]:
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hv
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv15

    found: list[tuple[nn.Module, types.FunctionType]] = []
    for m in vae.modules():
        if isinstance(m, (hv.HunyuanVideoCausalConv3d, hv15.HunyuanVideo15CausalConv3d)):
            if tuple(m.conv.padding) == (0, 0, 0) and m.pad_mode in ("replicate", "constant"):
                found.append((m, _conv_forward))
        elif isinstance(m, hv15.HunyuanVideo15AttnBlock):
            found.append((m, _hv15_attn_forward))
        elif isinstance(m, hv.HunyuanVideoMidBlock3D) and all(
            a is None or (type(a.processor) is AttnProcessor2_0 and a.spatial_norm is None) for a in m.attentions
        ):  # a custom attention processor keeps the stock (masked) path
            found.append((m, _hv_mid_block_forward))
        elif isinstance(m, hv15.HunyuanVideo15Downsample):
            found.append((m, _hv15_downsample_forward))
        elif isinstance(m, hv15.HunyuanVideo15Encoder3D) and _streamable(m):
            found.append((m, _hv15_encoder_forward))
    return found


def _streamable(encoder: nn.Module) -> bool:
    # Exact chunking needs causal, unstrided, replicate-padded time axes in every conv before the mid block.
    convs = [c for c in encoder.modules() if hasattr(c, "time_causal_padding")]
    return all(
        c.time_causal_padding[5] == 0 and c.conv.stride[0] == c.conv.dilation[0] == 1 and c.pad_mode == "replicate"
        for c in convs
    )


def enable_patch_conv(vae: nn.Module, max_slab_bytes: int = 256 * 2**20) -> int:
    """Patch every causal Conv3d of an AutoencoderKLHunyuanVideo / AutoencoderKLHunyuanVideo15 in
    place so it runs slab by slab (split along T and, when needed, H) with numerically identical
    output; also the mid-block attention (no L x L mask) and, for HV1.5, the encoder (streamed in
    time under no_grad). `max_slab_bytes` bounds one conv slab (input + output), one attention
    score block, and sets the HV1.5 encoder chunk (~ frames whose first-level activation fits).

    Returns how many modules are patched. Idempotent: calling again only updates the budget and
    returns the same count."""
    if max_slab_bytes <= 0:
        raise ValueError(f"max_slab_bytes must be positive, got {max_slab_bytes}")
    targets = _targets(vae)
    for module, fn in targets:
        setattr(module, _ATTR, int(max_slab_bytes))
        module.forward = types.MethodType(fn, module)
    return len(targets)


def disable_patch_conv(vae: nn.Module) -> int:
    """Undo `enable_patch_conv`; returns how many modules were restored."""
    restored = 0
    for m in vae.modules():
        if hasattr(m, _ATTR):
            delattr(m, _ATTR)
            m.__dict__.pop("forward", None)
            restored += 1
    return restored


def is_patched(module: nn.Module) -> bool:
    """True if `module` currently runs a patched forward."""
    return hasattr(module, _ATTR)
