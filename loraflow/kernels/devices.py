"""Where models run, and giving the memory back after a stage."""

from __future__ import annotations

import ctypes
import gc
import logging
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log.info("running on %s", device)
    fixed_mkl_threads()
    return device


@cache
def fixed_mkl_threads() -> None:
    """Stop MKL from choosing a matmul's thread count at run time (MKL_DYNAMIC, on by default), Intel's first
    condition for run-to-run reproducible results: with it, MKL may split one product's sums differently from one
    call to the next, so a render or a training step could depend on what the process did before. Set through
    torch's own MKL, so it holds however early torch was imported; a torch without MKL has nothing to fix."""
    try:
        mkl = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        mkl.MKL_Set_Dynamic(0)  # the C entry point; `mkl_set_dynamic` is the Fortran one (takes a pointer)
    except (OSError, AttributeError):
        log.debug("torch has no MKL whose thread count to fix")


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
