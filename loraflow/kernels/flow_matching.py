"""Flow-matching pieces as pure functions: sigma sampling, the shift, the noisy sample, the lr schedule.

Convention (diffusers' FlowMatchEulerDiscreteScheduler, Kandinsky 5, HunyuanVideo 1.5):
    x_t = (1 - sigma) * x0 + sigma * noise,  target velocity = noise - x0,  timestep = sigma * 1000.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SIGMA_SAMPLING = ("sigmoid", "logit_normal", "uniform")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's static shift: sigma' = s * sigma / (1 + (s - 1) * sigma). shift 1 is identity."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def auto_shift(tokens: int) -> float:
    """SimpleTuner's `flow_schedule_auto_shift` (Flux's resolution-dependent shift): exp(mu), mu linear in the
    token count through 0.5 at 256 and 1.15 at 4096 (diffusers' FlowMatchEulerDiscreteScheduler defaults)."""
    return math.exp(0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256))


def sample_sigmas(
    batch: int,
    generator: torch.Generator,
    mode: str = "sigmoid",
    shift: float = 1.0,
    scale: float = 1.0,
    mean: float = 0.0,
    beta: tuple[float, float] | None = None,
    timesteps: tuple[int | None, int | None] = (None, None),
) -> torch.Tensor:
    """Training sigmas in (0, 1), shape (B,). `sigmoid` and `logit_normal` draw sigmoid(mean + scale * N(0,1));
    `beta` (alpha, beta) draws Beta(alpha, beta) instead (SimpleTuner's flow_use_beta_schedule). After the shift,
    `timesteps` (musubi-tuner's min_timestep, max_timestep; None: 0, 1000) maps (0, 1) linearly onto its range."""
    if beta is not None:  # numpy's sampler, seeded from the generator: torch's Beta takes no generator
        seed = int(torch.randint(2**62, (1,), generator=generator))
        sigmas = torch.from_numpy(np.random.default_rng(seed).beta(*beta, size=batch)).float()
    elif mode in ("sigmoid", "logit_normal"):
        sigmas = torch.sigmoid(mean + scale * torch.randn(batch, generator=generator))
    elif mode == "uniform":
        sigmas = torch.rand(batch, generator=generator)
    else:
        raise ValueError(f"sigma sampling {mode!r} is not known; allowed: {', '.join(SIGMA_SAMPLING)}")
    sigmas = shift_sigmas(sigmas, shift)
    if timesteps == (None, None):
        return sigmas
    low, high = (timesteps[0] or 0) / 1000, (1000 if timesteps[1] is None else timesteps[1]) / 1000
    return sigmas * (high - low) + low


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
