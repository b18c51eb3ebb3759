"""Flow-matching pieces as pure functions: sigma sampling, the shift, the noisy sample, the loss, the lr schedule.
The one place of the noising and the loss: training, evaluation, scheduled sampling and the tiny world use these.

Convention (diffusers' FlowMatchEulerDiscreteScheduler, Kandinsky 5, HunyuanVideo 1.5):
    x_t = (1 - sigma) * x0 + sigma * noise,  target velocity = noise - x0,  timestep = sigma * 1000.
An i2v flavour's first `given` latent frames (`flavour.conditioning_frames`) are inputs: clean in x_t, out of the loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from loraflow.kernels.losses import LossType, regression_loss

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


def noisy_sample(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, given: int = 0,
                 last: bool = False) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise (B, C, T, h, w), its first `given` latent frames (and its last, `last`)
    clean.

    i2v (Kandinsky5I2VPipeline): the image latent replaces frame 0 of x_t at every step; here that is x0[:, :, :1],
    which for i2v flavours the latents stage encodes from the first frame alone, as the pipeline encodes its image
    (the clip's own latent frame 0 differs: the video VAE's GroupNorms take statistics over every frame).
    i2v_mode first_last gives the last latent frame the same way (`last`).
    """
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))  # broadcast (B,) over (B, C, T, h, w)
    return clean_frames((1 - s) * x0 + s * noise, x0, given, last)


def clean_frames(x: torch.Tensor, x0: torch.Tensor, given: int, last: bool = False) -> torch.Tensor:
    """x with its first `given` latent frames (dim 2), and its last one with `last`, replaced by x0's."""
    x = torch.cat([x0[:, :, :given], x[:, :, given:]], dim=2) if given else x
    return torch.cat([x[:, :, :-1], x0[:, :, -1:]], dim=2) if last else x


def flow_mse(prediction: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, given: int = 0, last: bool = False,
             loss: LossType = LossType(), sigma: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Flow-matching loss against noise - x0 (fp32), over the generated latent frames only: the `given` conditioning
    frames (and the last one, `last`) are inputs (inference never steps them), so their prediction is trained on
    nothing. Training may ask for another `loss_type` (kernels/losses.py; the Huber kinds need each sample's `sigma`)
    and weigh each element by its loss `mask` (B, 1, 1, h, w: masked loss, contracts/masks.py); eval loss stays MSE,
    unmasked."""
    end = prediction.shape[2] - 1 if last else None
    target = (noise - x0)[:, :, given:end].float()
    # A π-Flow distilled transformer (Kandinsky 6) predicts n velocities per channel, grid-major (diffusers'
    # PiflowScheduler reshapes its output (n_grid, C)), each turned into an x0 at the same x_t (`DXPolicy`: x0_g = x_t -
    # sigma * output_g): trained on a clip, every one is held to the clip's x0, so to noise - x0; losses averaged
    grid = prediction.split(x0.shape[1], dim=1)
    return sum(regression_loss(p[:, :, given:end].float(), target, loss, sigma, mask) for p in grid) / len(grid)


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
