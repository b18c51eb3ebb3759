"""Flow-matching pieces as pure functions: sigma sampling, the shift, the noisy sample, the lr schedule.

Convention (diffusers' FlowMatchEulerDiscreteScheduler, Kandinsky 5, HunyuanVideo 1.5):
    x_t = (1 - sigma) * x0 + sigma * noise,  target velocity = noise - x0,  timestep = sigma * 1000.
"""

from __future__ import annotations

import math

import torch

SIGMA_SAMPLING = ("sigmoid", "logit_normal", "uniform")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's static shift: sigma' = s * sigma / (1 + (s - 1) * sigma). shift 1 is identity."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_sigmas(
    batch: int,
    generator: torch.Generator,
    mode: str = "sigmoid",
    shift: float = 1.0,
    scale: float = 1.0,
    mean: float = 0.0,
) -> torch.Tensor:
    """Training sigmas in (0, 1), shape (B,). `sigmoid` and `logit_normal` draw sigmoid(mean + scale * N(0,1))."""
    if mode in ("sigmoid", "logit_normal"):
        sigmas = torch.sigmoid(mean + scale * torch.randn(batch, generator=generator))
    elif mode == "uniform":
        sigmas = torch.rand(batch, generator=generator)
    else:
        raise ValueError(f"sigma sampling {mode!r} is not known; allowed: {', '.join(SIGMA_SAMPLING)}")
    return shift_sigmas(sigmas, shift)


def noisy_sample(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))  # broadcast (B,) over (B, C, T, H, W)
    return (1 - s) * x0 + s * noise


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, schedule: str = "constant") -> float:
    """Linear warmup, then constant or cosine decay to 0 at total_steps."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return base_lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"lr schedule {schedule!r} is not known; allowed: constant, cosine")
