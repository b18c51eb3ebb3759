"""TREAD token routing: a random subset of the visual tokens skips a span of transformer blocks.

TREAD (Krause et al., 2025, "TREAD: Token Routing for Efficient Architecture-agnostic Diffusion Training"):
for each route, `selection_ratio` of the visual tokens bypass blocks [start_layer_idx, end_layer_idx] and
rejoin, unchanged, at their own positions after the last block of the span; the span's blocks see only the
kept tokens. The loss is still computed on every token. Training only: inference never routes.

Family-agnostic: `tread_routing` swaps the entries of the transformer's block ModuleList for thin wrappers
while the context is open, so the transformer's own forward (and its gradient checkpointing, and diffusers'
group-offload hooks on the blocks) runs unchanged. What a wrapper must know about a family's blocks is a
`TokenLayout`, which the family module provides:

    Kandinsky 5 (video, image):  TokenLayout("visual_transformer_blocks", rope_arg=3, rope_token_dim=1)
        block(visual_embed (B, N, D), text_embed, time_embed, rope (B, N, 1, d/2, 2, 2), sparse_params) -> x
    HunyuanVideo 1.5:            TokenLayout("transformer_blocks", rope_arg=4, rope_token_dim=0, output_index=0)
        block(hidden (B, N, D), context, temb, context_mask, (cos (N, d), sin (N, d))) -> (hidden, context)
    Kandinsky 6:                 TokenLayout("visual_transformer_blocks", rope_arg=5, rope_token_dim=0, output_index=0)
        block(visual (B, N, D), audio, text_v, text_a, times, rope, audio rope, mask) -> (visual, audio): the sound
        goes through every block whole (tests/stages/test_kandinsky6_audio.py)

One subset per span and forward, shared by the batch: HunyuanVideo's rope has no batch axis, and the
samples of a batch share one bucket (one token grid) anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class TokenLayout:
    """Where a transformer keeps its visual tokens between blocks.

    blocks: attribute name of the nn.ModuleList of blocks that carry the visual tokens; each block is called
        positionally with the tokens (B, N, D) as its first argument.
    rope_arg: positional index of the per-token rotary embedding (a tensor or a tuple of tensors); None: none.
    rope_token_dim: the token axis of the rope tensor(s).
    output_index: None when a block returns the tokens; i when it returns a tuple with the tokens at i.
    depth: the transformer config's key that counts `blocks` (`estimates.stages` traces two shallow copies of the
        transformer and extends their difference to the real depth); None: traced at its real depth.
    """

    blocks: str
    rope_arg: int | None = None
    rope_token_dim: int = 1
    output_index: int | None = None
    depth: str | None = None


class Route(Protocol):
    selection_ratio: float
    start_layer_idx: int
    end_layer_idx: int


def resolve_routes(routes: Sequence[Route], num_blocks: int) -> list[tuple[float, int, int]]:
    """(ratio, start, end) with negative indices resolved against `num_blocks`; spans checked and disjoint."""
    spans = []
    for i, route in enumerate(routes):
        name = f"tread_config.routes[{i}]"
        start = route.start_layer_idx + num_blocks if route.start_layer_idx < 0 else route.start_layer_idx
        end = route.end_layer_idx + num_blocks if route.end_layer_idx < 0 else route.end_layer_idx
        if not 0 <= start <= end < num_blocks:
            raise ValueError(
                f"{name}: blocks {route.start_layer_idx}..{route.end_layer_idx} resolve to {start}..{end}, which is "
                f"not a span of this transformer's {num_blocks} blocks (0..{num_blocks - 1}; negative counts from "
                "the end); pick start <= end inside that range")
        if not 0 <= route.selection_ratio < 1:
            raise ValueError(f"{name}: selection_ratio must be in [0, 1); got {route.selection_ratio}")
        spans.append((route.selection_ratio, start, end))
    ordered = sorted(spans, key=lambda s: s[1])
    for (_, _, end), (_, start, _) in zip(ordered, ordered[1:]):
        if start <= end:
            raise ValueError(f"tread_config.routes overlap (a span starting at block {start} begins before the one "
                             f"ending at block {end} is over); make the routes' block spans disjoint")
    return spans


class _Span:
    """The state of one route during one forward: the kept token indices and the full token tensor."""

    def __init__(self, ratio: float, generator: torch.Generator, layout: TokenLayout) -> None:
        self.ratio, self.generator, self.layout = ratio, generator, layout
        self.index: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self._rope: tuple[Any, Any] = (None, None)  # (the rope it came from, the gathered rope)

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, K, D), K = N - floor(N * ratio). Drawn once: a checkpoint recompute reuses it."""
        tokens = hidden.shape[1]
        if self.index is None:
            keep = tokens - int(tokens * self.ratio)
            order = torch.randperm(tokens, generator=self.generator) if keep < tokens else torch.arange(tokens)
            self.index = order[:keep].sort().values.to(hidden.device)  # sorted: kept tokens stay in raster order
        elif self.index.numel() > tokens:
            raise RuntimeError(f"TREAD: one routing context saw {tokens} tokens after {self.index.numel()}: "
                               "open a new tread_routing context for every forward")
        self.full = hidden
        return hidden.index_select(1, self.index)

    def leave(self, routed: torch.Tensor) -> torch.Tensor:
        """Put the span's output back among the tokens that skipped it: (B, K, D) -> (B, N, D)."""
        return self.full.index_copy(1, self.index, routed)

    def rope(self, rope: Any) -> Any:
        if rope is None:
            return None
        if self._rope[0] is not rope:  # gathered once per forward, not once per block
            dim = self.layout.rope_token_dim
            gather = lambda t: t.index_select(dim, self.index.to(t.device))  # noqa: E731
            self._rope = (rope, tuple(gather(t) for t in rope) if isinstance(rope, (tuple, list)) else gather(rope))
        return self._rope[1]


class _RoutedBlock(torch.nn.Module):
    """One block of a span: gathers at the span's first block, scatters after its last."""

    def __init__(self, block: torch.nn.Module, span: _Span, first: bool, last: bool) -> None:
        super().__init__()
        self.block, self.span, self.first, self.last = block, span, first, last

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layout, args = self.span.layout, list(args)
        if self.first:
            hidden = self.span.enter(hidden)
        if layout.rope_arg is not None:
            if layout.rope_arg - 1 >= len(args):
                raise TypeError(f"TREAD: {type(self.block).__name__} was called without a positional rope argument "
                                f"{layout.rope_arg}; the family's tread_layout does not match its transformer")
            args[layout.rope_arg - 1] = self.span.rope(args[layout.rope_arg - 1])
        out = self.block(hidden, *args, **kwargs)
        if not self.last:
            return out
        if layout.output_index is None:
            return self.span.leave(out)
        out = list(out)
        out[layout.output_index] = self.span.leave(out[layout.output_index])
        return tuple(out)


@contextmanager
def tread_routing(
    transformer: torch.nn.Module, layout: TokenLayout, routes: Sequence[Route], generator: torch.Generator,
) -> Iterator[list[tuple[float, int, int]]]:
    """Route tokens in every forward inside the context; yields the resolved spans.

    Open one context per forward (and its backward: a gradient-checkpoint recompute reuses the subset). The
    subset is drawn from `generator` (a CPU generator), so a seeded step routes the same tokens on resume.
    """
    blocks = getattr(transformer, layout.blocks)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(f"TREAD: {type(transformer).__name__}.{layout.blocks} is not a ModuleList of blocks; "
                        "the family's tread_layout names the wrong attribute")
    spans = resolve_routes(routes, len(blocks))
    originals = list(blocks)
    try:
        for ratio, start, end in spans:
            span = _Span(ratio, generator, layout)
            for i in range(start, end + 1):
                blocks[i] = _RoutedBlock(originals[i], span, first=i == start, last=i == end)
        yield spans
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
