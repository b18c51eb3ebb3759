"""CREPA inside training: the cached teacher features each sample reads, the projector trained with the LoRA, and
the weighted term of one micro-step (the maths is kernels/crepa.py; stages/teacher/teacher_features.py computes the
features, contracts/teacher_features.py finds and reads them).

The projector is optimised with the LoRA (same AdamW, same clipping), saved in every checkpoint for exact resume
and beside the adapter when the run is done (PROJECTOR_FILE); no renderer reads it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from loraflow.config import LoraflowConfig
from loraflow.contracts.teacher_features import STAGE, teacher_keys
from loraflow.kernels.crepa import (
    PROJECTOR_FILE,
    BlockCapture,
    CrepaProjector,
    capture_block,
    crepa_loss,
    frame_tokens,
    hidden_width,
    token_grid,
)
from loraflow.keys import hash_seed
from loraflow.pipelines.base import ModelFamily
from loraflow.store import Store


@dataclass
class Crepa:
    """The projector and the settings of one run's CREPA term."""

    config: LoraflowConfig
    family: ModelFamily
    projector: CrepaProjector

    def capture(self, transformer: torch.nn.Module) -> AbstractContextManager[BlockCapture]:
        return capture_block(transformer, self.family.tread_layout, self.config.crepa_block_index)

    def term(self, transformer: torch.nn.Module, capture: BlockCapture, teacher: torch.Tensor,
             latent_shape: tuple[int, int, int]) -> torch.Tensor:
        """crepa_lambda x the CREPA loss of the captured block against the batch's teacher features."""
        c = self.config
        grid = token_grid(transformer.config, latent_shape)
        projected = self.projector(frame_tokens(capture.hidden, grid))
        terms = crepa_loss(projected, teacher.to(projected.device), grid, c.crepa_adjacent_distance,
                           c.crepa_adjacent_tau, c.crepa_cumulative_neighbors, c.crepa_normalize_by_frames,
                           c.crepa_spatial_align)
        return c.crepa_lambda * terms.loss


def make_crepa(config: LoraflowConfig, family: ModelFamily, transformer: torch.nn.Module, store: Store,
               checkpoint: Path | None, device: torch.device) -> Crepa | None:
    """The run's CREPA (None when off): a seeded projector, or the checkpoint's."""
    if not config.crepa_enabled:
        return None
    if transformer.config.get("attention_type") == "nabla":
        raise ValueError("crepa_enabled: this transformer uses NABLA attention (Kandinsky 5's 10 s checkpoints), "
                         "whose blocks do not keep the (frame, row, column) token order CREPA aligns; set "
                         "crepa_enabled: false for this checkpoint")
    key = next(iter(teacher_keys(config, family, store).values()))
    width = store.get(STAGE, [key])[key]["features"].shape[-1]
    generator_seed = hash_seed(seed=config.seed, purpose="crepa_projector")
    with torch.random.fork_rng(devices=[]):  # the projector's init leaves the global RNG as it was
        torch.manual_seed(generator_seed)
        projector = CrepaProjector(hidden_width(transformer.config), width)
    if checkpoint is not None:
        projector.load_state_dict(_load(checkpoint / PROJECTOR_FILE))
    return Crepa(config, family, projector.to(device))


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def projector_state(crepa: Crepa | None) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: tensors} a checkpoint holds for CREPA (nothing when off)."""
    if crepa is None:
        return {}
    return {PROJECTOR_FILE: {k: v.detach().cpu().contiguous() for k, v in crepa.projector.state_dict().items()}}


def capturing(crepa: Crepa | None, transformer: torch.nn.Module) -> AbstractContextManager[BlockCapture | None]:
    return nullcontext() if crepa is None else crepa.capture(transformer)
