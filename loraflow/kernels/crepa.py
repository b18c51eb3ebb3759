"""CREPA (cross-frame representation alignment): block N's visual tokens, projected, are pulled towards a frozen
image encoder's patch features of their own frame and of its neighbours, against flicker between frames.

Semantics of SimpleTuner's options (documentation/experimental/VIDEO_CREPA.md, helpers/training/crepa.py; the
paper's Eq. 6), our own code. With p = projected tokens and t = teacher features, both L2-normalised per token:
    sim(f, g)  = mean over patches of <p[f], t[g]>                      frame f's tokens against frame g's features
    total(f)   = sim(f, f) + sum over k in K of exp(-k / tau) (sim(f, f + k) + sim(f, f - k))   (frames that exist)
    K          = {d} (`crepa_adjacent_distance` d; 0: per-frame REPA), or {1..d} with `crepa_cumulative_neighbors`;
                 d is capped at frames - 1; tau = `crepa_adjacent_tau`
    loss       = -mean over the batch of (sum over f of total(f)), divided by the frame count with
                 `crepa_normalize_by_frames`; the caller weights it by `crepa_lambda`.
Where the tokens come from: the output of visual block `crepa_block_index` (a forward hook on the real diffusers
block, `capture_block`), whose tokens are in (frame, row, column) order, one per latent patch (`token_grid`).
The teacher's features arrive cached per latent frame (`loraflow.stages.teacher.teacher_features`) on its own square
patch grid.
`crepa_spatial_align` resamples them bilinearly onto the transformer's (rows, columns) grid; off, both sides are
averaged over a frame's patches (one token per frame). SimpleTuner instead resamples both to the smaller token
count, in 1-D where a grid is not square; the 2-D resampling keeps each patch over the same part of the frame.
Not here (yet): SimpleTuner's lambda schedules and cut-offs, backbone teachers, iREPA.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loraflow.kernels.tread import TokenLayout

PROJECTOR_FILE = "crepa_projector.safetensors"  # beside the adapter: training-only, no renderer reads it


@dataclass
class BlockCapture:
    """The visual tokens (B, N, D) block `index` returned in the latest forward (None before one)."""

    index: int
    hidden: torch.Tensor | None = None


@contextmanager
def capture_block(transformer: torch.nn.Module, layout: TokenLayout, index: int) -> Iterator[BlockCapture]:
    """Record block `index`'s visual tokens at every forward while open (read them after the forward, before the
    backward: a gradient-checkpointing recompute records them again)."""
    blocks = getattr(transformer, layout.blocks)
    if not 0 <= index < len(blocks):
        raise ValueError(f"crepa_block_index {index}: this transformer has {len(blocks)} visual blocks; use one of "
                         f"0..{len(blocks) - 1}")
    capture = BlockCapture(index)

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        capture.hidden = output if layout.output_index is None else output[layout.output_index]

    handle = blocks[index].register_forward_hook(record)
    try:
        yield capture
    finally:
        handle.remove()


def token_grid(transformer_config: Any, latent_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(frames, rows, columns) of visual tokens for latents (T, h, w): Kandinsky 5 configs name a 3-tuple
    `patch_size`, HunyuanVideo 1.5 an int `patch_size` and `patch_size_t`."""
    patch = transformer_config["patch_size"]
    if isinstance(patch, (list, tuple)):
        pt, ph, pw = patch
    else:
        pt, ph, pw = transformer_config.get("patch_size_t", 1), patch, patch
    frames, height, width = latent_shape
    return frames // pt, height // ph, width // pw


def hidden_width(transformer_config: Any) -> int:
    """The width of a visual block's tokens: Kandinsky 5 names it `model_dim`, HunyuanVideo 1.5 has heads x dim."""
    if "model_dim" in transformer_config:
        return int(transformer_config["model_dim"])
    return int(transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"])


def frame_tokens(hidden: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """(B, N, D) tokens in (frame, row, column) order -> (B, frames, rows * columns, D). Whole frames after the latent
    grid's are inputs, not generated (Kandinsky 6 i2v's clean image frame, appended last): left out."""
    frames, rows, columns = grid
    extra = hidden.shape[1] - frames * rows * columns
    if extra > 0 and extra % (rows * columns) == 0:
        hidden = hidden[:, : frames * rows * columns]
    if hidden.shape[1] != frames * rows * columns:
        raise ValueError(f"block output has {hidden.shape[1]} visual tokens, not the {frames}x{rows}x{columns} of its "
                         "latent grid: CREPA needs every token (is TREAD routing this block?)")
    return hidden.reshape(hidden.shape[0], frames, rows * columns, hidden.shape[-1])


class CrepaProjector(torch.nn.Module):
    """LayerNorm + Linear from the transformer's width to the teacher's (SimpleTuner's head); trained, fp32."""

    def __init__(self, hidden_size: int, teacher_size: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size)
        self.linear = torch.nn.Linear(hidden_size, teacher_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(hidden_states.float()))


def save_projector(projector: CrepaProjector, path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in projector.state_dict().items()}, str(path))


def load_projector(path: str | Path) -> CrepaProjector:
    from safetensors.torch import load_file

    state = load_file(str(path))
    projector = CrepaProjector(state["norm.weight"].shape[0], state["linear.weight"].shape[0])
    projector.load_state_dict(state)
    return projector


def align_teacher(teacher: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Teacher features (B, T, g * g, E) on a square g x g patch grid -> (B, T, rows * columns, E), bilinear."""
    b, t, q, e = teacher.shape
    g = math.isqrt(q)
    if g * g != q:
        raise ValueError(f"teacher features have {q} patches per frame, not a square grid")
    if (g, g) == (rows, columns):
        return teacher
    grid = teacher.reshape(b * t, g, g, e).permute(0, 3, 1, 2)  # (BT, E, g, g)
    resized = F.interpolate(grid, size=(rows, columns), mode="bilinear", align_corners=False)
    return resized.permute(0, 2, 3, 1).reshape(b, t, rows * columns, e)


@dataclass(frozen=True)
class CrepaTerms:
    loss: torch.Tensor  # scalar, differentiable; weight it by crepa_lambda
    alignment: torch.Tensor  # mean total(f), detached (SimpleTuner's crepa_alignment_score)
    self_similarity: torch.Tensor  # mean sim(f, f), detached (crepa_similarity_self)


def crepa_loss(projected: torch.Tensor, teacher: torch.Tensor, grid: tuple[int, int, int], distance: int = 1,
               tau: float = 1.0, cumulative: bool = False, normalize_by_frames: bool = True,
               spatial_align: bool = True) -> CrepaTerms:
    """The CREPA loss of projected tokens (B, frames, rows * columns, E) against teacher features (B, frames, g * g,
    E) cached for the same latent frames; see the module doc for the formula."""
    if distance < 0:
        raise ValueError(f"crepa_adjacent_distance must be >= 0; got {distance}")
    if tau <= 0:
        raise ValueError(f"crepa_adjacent_tau must be > 0; got {tau}")
    frames, rows, columns = grid
    if teacher.shape[1] != frames:
        raise ValueError(f"teacher features cover {teacher.shape[1]} frames, the tokens {frames}: cache them for "
                         "these latents (`teacher_features`)")
    if spatial_align:
        teacher = align_teacher(teacher, rows, columns)
    else:
        projected, teacher = projected.mean(dim=2, keepdim=True), teacher.mean(dim=2, keepdim=True)
    dtype = torch.promote_types(projected.dtype, torch.float32)  # fp32 at least (bf16 under autocast); float64 stays
    p, t = F.normalize(projected.to(dtype), dim=-1), F.normalize(teacher.to(dtype), dim=-1)
    sim = torch.einsum("bfpe,bgpe->bfg", p, t) / p.shape[2]  # (B, T, T): frame f's tokens vs frame g's features
    weights = neighbour_weights(frames, distance, tau, cumulative).to(sim)
    total = (sim * weights).sum(dim=2)  # (B, T)
    per_video = total.sum(dim=1) / (frames if normalize_by_frames else 1)
    self_similarity = torch.diagonal(sim, dim1=1, dim2=2)
    return CrepaTerms(-per_video.mean(), total.mean().detach(), self_similarity.mean().detach())


def neighbour_weights(frames: int, distance: int, tau: float, cumulative: bool) -> torch.Tensor:
    """(T, T): 1 on the diagonal, exp(-k / tau) where |f - g| = k is in K, 0 elsewhere."""
    d = min(distance, frames - 1)
    offsets = range(1, d + 1) if cumulative else ([d] if d > 0 else [])
    gap = (torch.arange(frames)[:, None] - torch.arange(frames)[None, :]).abs()
    weights = (gap == 0).double()
    for k in offsets:
        weights = weights + (gap == k).double() * math.exp(-k / tau)
    return weights
