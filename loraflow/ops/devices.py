"""Where models run, and giving the memory back after a stage."""

from __future__ import annotations

import gc
import logging

import torch

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log.info("running on %s", device)
    return device


def free_models(*models: object) -> None:
    """Drop references and return cached accelerator memory, so the next stage's model fits."""
    del models
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0
