"""HunyuanVideo 1.5's joint attention with its text mask as a key mask: the memory of the mask grows with the tokens,
not with their square.

diffusers 0.42.1's `HunyuanVideo15AttnProcessor2_0` (models/transformers/transformer_hunyuan_video15.py) builds from
the (B, L_text) mask a (B, 1, L, L) boolean mask, L = every video and text token: query i may see key j when both
are valid. Two L x L tensors are alive while it is built (a repeat, then the `&`), and SDPA on CUDA turns a boolean
mask into an additive one of the same shape: 2-3 bytes per token pair in every block. At 720p x 121 frames
(111,600 video tokens) that is 25-38 GiB, the largest part of a render (a released-size estimate: 51 GiB of
activations in one denoise call of which 12.6 GiB per mask tensor). The transformer puts the valid text tokens first
and pads after them (`HunyuanVideo15Transformer3DModel.forward`, "valid tokens first, then padding"), so every valid
query's row of that mask is the key mask itself; the rows of the padded (invalid) queries are all false.

`KeyMaskProcessor` runs the same steps as diffusers' processor (projections, QK norm, rotary embedding of the video
tokens, the text stream's projections and norm, attention through diffusers' `dispatch_attention_fn`, output
projections) with the mask passed as (B, 1, 1, L): broadcast over the queries, L bytes. A valid query's row is the
same, so its output is the same kernel's on the same numbers; a padded query now sees the valid keys instead of
nothing, and its output, as before, reaches nothing: the padded tokens are masked as keys in every block and
dropped after the last (tests/pipelines/test_hv_attention.py: the video tokens' output and the LoRA gradients equal
diffusers' processor's, bit for bit, on the tiny model with padded text).

No mask where none is needed. When every sample of the batch has the same number of valid text tokens (always at
batch 1), the valid ones are the first `n` of the text stream in every row, and the rest (the text's padding, and a
t2v sample's 729 all-zero image tokens, which the transformer masks and moves behind the valid text) reach no valid
token. The processor then computes only the video tokens and those `n`: no mask (so SDPA may take its flash or cuDNN
kernel, which a boolean mask rules out on CUDA), and none of the padded queries and keys (at 720p with a short prompt
the padded text and image tokens are ~7% of the attention's work). The padded tokens' attention output is zero; as
before it reaches nothing. A valid token's output is the same softmax over the same keys, summed without the masked
zeros: equal to the masked call's up to the order of the reductions (tests/pipelines/test_hv_attention.py derives
the bound). A batch whose rows differ in length keeps the key mask.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb

from loraflow.kernels.attention_backend import MASKLESS


class KeyMaskProcessor:
    """A drop-in for the main blocks' `HunyuanVideo15AttnProcessor2_0` (`set_attention_backend` sets its backend)."""

    _attention_backend = None
    _parallel_config = None
    valid_text: ValidText  # set by `key_mask_attention`, shared by the model's blocks

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # (B, N, heads, head_dim)

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:  # the video tokens only
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_tokens = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        valid = self.valid_text.of(attention_mask) if attention_mask is not None else None
        if valid is not None:  # every row's first `valid` text tokens are its valid ones: no mask, no padding
            encoder_hidden_states, attention_mask = encoder_hidden_states[:, :valid], None
        if encoder_hidden_states is not None:
            text_query = heads(attn.add_q_proj(encoder_hidden_states))
            text_key = heads(attn.add_k_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=1)
            key = torch.cat([key, text_key], dim=1)
            value = torch.cat([value, heads(attn.add_v_proj(encoder_hidden_states))], dim=1)
        batch, tokens = query.shape[:2]
        mask = None
        if attention_mask is not None:  # (B, L_text) -> every video token valid, then the text's: (B, 1, 1, L)
            keys = torch.nn.functional.pad(attention_mask, (tokens - attention_mask.shape[1], 0), value=True)
            mask = keys.bool().view(batch, 1, 1, tokens)
        backend = self._attention_backend
        if mask is not None and backend is not None and str(getattr(backend, "value", backend)) in MASKLESS:
            backend = None  # flash takes no mask: this call runs diffusers' default (torch's SDPA chooses)
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                    backend=backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        video_tokens = hidden_states.shape[1]
        video, text = out[:, :video_tokens], out[:, video_tokens:]
        kept = text.shape[1]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        if kept < text_tokens:  # the padded tokens' output: zero (it reaches no valid token)
            text = torch.nn.functional.pad(text, (0, 0, 0, text_tokens - kept))
        return video, text


class ValidText:
    """The number of valid text tokens of a joint mask (B, L_text) when every row has the same (else None), asked
    once per forward: every block of one forward (and its checkpoint recompute) gets the same mask tensor, so the
    answer is kept beside a weak reference to it. Reading the count is one host sync per forward, as diffusers'
    forward makes several (`torch.all(image_embeds == 0)`, the boolean indexing of the text)."""

    def __init__(self) -> None:
        self.mask: weakref.ref | None = None
        self.valid: int | None = None

    def of(self, attention_mask: torch.Tensor) -> int | None:
        if self.mask is None or self.mask() is not attention_mask:
            counts = attention_mask.bool().sum(dim=1).tolist()  # (B,)
            self.valid = counts[0] if len(set(counts)) == 1 else None
            self.mask = weakref.ref(attention_mask)
        return self.valid


def key_mask_attention(transformer: torch.nn.Module) -> None:
    """Every main block's attention runs `KeyMaskProcessor` (once per model: the mark is the model's)."""
    if transformer.__dict__.get("_loraflow_key_mask"):
        return
    valid_text = ValidText()  # one per model: its blocks share the count
    for block in transformer.transformer_blocks:
        block = getattr(block, "block", block)  # a block TREAD routes is wrapped (kernels/tread.py `_RoutedBlock`)
        processor = KeyMaskProcessor()
        processor.valid_text = valid_text
        processor._attention_backend = block.attn.processor._attention_backend  # a backend set before stays
        block.attn.set_processor(processor)
    transformer.__dict__["_loraflow_key_mask"] = True
