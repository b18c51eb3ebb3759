"""Masked loss (SimpleTuner's `conditioning_type: mask` dataset and `masked_loss_probability`).

Through the DAG:
    clips     a dataset whose `conditioning_data` names a `conditioning_type: mask` dataset pairs each file with the
              image of the same relative path and stem there (the i2i pairing, `find_source_image`): one mask image
              per video, for every frame (no mask videos). It is cut like its clip (same bucket size, crop style
              and seed) and stored beside the frames as `mask_frames`; its identity is part of the clip key. A
              missing, ambiguous or unreadable mask is a quarantine row with its reason.
    latents   the mask as the latent grid sees it (`latent_mask`): white = train (1), black = ignore (0), grey
              between (the mean of its RGB channels / 255), area-averaged over each latent cell (the VAE's
              spatial factor squared; over time the image is the same at every frame, so the average over the
              temporal factor is the image itself): `loss_mask` (1, 1, h, w), broadcast over channels and frames.
    lora      the per-element squared error times the mask, normalised by the mask's mean over the batch's
              elements (`kernels.flow_matching.flow_mse`'s `mask`): an all-ones mask is the plain MSE bit for bit,
              and a half mask weighs its kept half as much as a full image would. Each micro-step applies the masks
              with probability `masked_loss_probability`, drawn from its own (seed, micro-step) generator (resume
              stays exact).
Eval loss stays unmasked (it compares base and LoRA on whole clips).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from loraflow.config.dataset import is_mask_dataset

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.contracts.clip_rows import ClipRow

MASK_CODE = "mask-1"  # bump when `latent_mask` would give other numbers for the same mask
MASK_COLUMN = "loss_mask"


def latent_mask(mask_frames: np.ndarray, latent_shape: tuple[int, ...]) -> np.ndarray:
    """uint8 (1, H, W, 3) mask image at the clip's size -> float32 (1, 1, h, w) in [0, 1], area-averaged per cell
    of the (C, T, h, w) latent."""
    gray = mask_frames[0].astype(np.float32).mean(axis=-1) / 255.0  # (H, W)
    (height, width), (h, w) = gray.shape, latent_shape[-2:]
    if height % h or width % w:
        raise ValueError(f"a {width}x{height} mask does not tile the {w}x{h} latent grid: a bug in the bucket sizes")
    cells = gray.reshape(h, height // h, w, width // w).mean(axis=(1, 3))  # (h, w)
    return np.ascontiguousarray(cells[None, None], dtype=np.float32)


def latent_key_part(clip: ClipRow) -> dict[str, str]:
    """What a masked clip adds to its latent's key (the downsampling's version); nothing for other clips."""
    return {"mask": MASK_CODE} if clip.mask else {}


def batch_mask(rows: list[dict[str, Any]], probability: float, seed: int) -> torch.Tensor | None:
    """(B, 1, 1, h, w) float32 masks of a micro-step's latent rows (ones for a row without one), or None: no row
    has a mask, or this micro-step's draw (from its own `seed`) skips them (`masked_loss_probability`)."""
    import torch

    if not any(r.get(MASK_COLUMN) is not None for r in rows):
        return None
    if probability < 1 and torch.rand(1, generator=torch.Generator().manual_seed(seed)).item() >= probability:
        return None
    h, w = np.asarray(rows[0]["latent"]).shape[-2:]
    ones = np.ones((1, 1, h, w), dtype=np.float32)
    return torch.from_numpy(np.stack([np.asarray(r[MASK_COLUMN]) if r.get(MASK_COLUMN) is not None else ones
                                      for r in rows]))


def masked_loss_metadata(config: LoraflowConfig) -> dict[str, str]:
    """The `lora` asset's line on masked loss: nothing when no dataset pairs masks."""
    ids = [d.id for d in config.training_datasets if is_mask_dataset(config.source_images(d))]
    if not ids:
        return {}
    return {"masked_loss": f"masks on dataset(s) {', '.join(ids)}, applied with probability "
                           f"{config.masked_loss_probability:g}, normalised by the mask's mean (contracts/masks.py)"}
