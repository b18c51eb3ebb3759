"""Scheduled sampling (rollout): train some samples on the model's own roll-out instead of the exact noisy latent.

SimpleTuner's option names and meaning (documentation/experimental/SCHEDULED_SAMPLING.md,
helpers/scheduled_sampling/): each sample of a batch is rolled out with probability
`scheduled_sampling_probability` (or, over `scheduled_sampling_ramp_steps` from `scheduled_sampling_start_step`, a
probability ramped from `scheduled_sampling_prob_start` to `scheduled_sampling_prob_end`, `linear` or `cosine`), by
an offset of 0..`scheduled_sampling_max_step_offset` timesteps drawn per `scheduled_sampling_strategy`. A rolled-out
sample starts at the later (noisier) sigma + offset / 1000 on the same noise, and the current model integrates it
back to the training sigma with Euler steps of one timestep (1/1000 in sigma), without gradients; the training
target stays noise - x0. So the model sees the errors it makes itself and learns to correct them.

Only Euler is implemented (SimpleTuner's default sampler is UniPC). Pure: every random draw comes from the caller's
generator, and the model enters as a `predict(x_t, sigma) -> velocity` callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from loraflow.kernels.flow_matching import clean_frames, noisy_sample

STRATEGIES = ("uniform", "biased_early", "biased_late")
RAMP_SHAPES = ("linear", "cosine")
NUM_TRAIN_TIMESTEPS = 1000  # timestep = sigma * 1000 (flow_matching.py): one step of the rollout is 1/1000 in sigma

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_t (B, C, T, h, w), sigma (B,)) -> velocity


def rollout_probability(step: int, probability: float, ramp_steps: int = 0, prob_start: float | None = None,
                        prob_end: float | None = None, start_step: int = 0, shape: str = "linear") -> float:
    """The chance that a sample of optimizer step `step` is rolled out. Without a ramp: `probability`. With one:
    prob_start until start_step, then towards prob_end over ramp_steps (both default to `probability`)."""
    if shape not in RAMP_SHAPES:
        raise ValueError(f"scheduled_sampling_ramp_shape {shape!r} is not known; allowed: {', '.join(RAMP_SHAPES)}")
    if not ramp_steps:
        return probability
    start = probability if prob_start is None else prob_start
    end = probability if prob_end is None else prob_end
    progress = min(1.0, max(0.0, (step - start_step) / ramp_steps))
    if shape == "cosine":
        progress = 0.5 - 0.5 * math.cos(math.pi * progress)
    return start + (end - start) * progress


def draw_offsets(batch: int, generator: torch.Generator, probability: float, max_step_offset: int,
                 strategy: str = "uniform") -> torch.Tensor:
    """Per-sample rollout lengths (B,) int64 in 0..max_step_offset, 0 where the sample is not rolled out.

    Always the same two draws (B uniforms for the coin, B for the length), whatever the probability: the
    generator's stream, and so the next micro-step's, never depends on the settings' values."""
    if strategy not in STRATEGIES:
        raise ValueError(f"scheduled_sampling_strategy {strategy!r} is not known; allowed: {', '.join(STRATEGIES)}")
    coin, u = torch.rand(batch, generator=generator), torch.rand(batch, generator=generator)
    if strategy == "uniform":  # 0..max, each equally likely
        offsets = torch.floor(u * (max_step_offset + 1)).clamp(max=max_step_offset)
    elif strategy == "biased_early":  # short rollouts more often
        offsets = torch.round(u**2 * max_step_offset)
    else:  # biased_late: long rollouts more often
        offsets = torch.round((1 - u**2) * max_step_offset)
    return torch.where(coin < probability, offsets, torch.zeros_like(offsets)).long()


@torch.no_grad()
def roll_out(predict: Predict, x_t: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
             offsets: torch.Tensor, fixed_frames: int = 0, fixed_last: bool = False) -> torch.Tensor:
    """The training input at `sigma` (B,): `x_t` itself for samples with offset 0, else the model's own Euler
    roll-out from min(1, sigma + offset / 1000) on the same noise. Latents are (B, C, T, h, w); the first
    `fixed_frames` latent frames (i2v's clean image), and the last one with `fixed_last` (i2v_mode first_last), stay
    x0's throughout, as in `x_t`.

    With no offset above 0 the model is not called and `x_t` comes back as it is. The batch is stepped together
    (one `predict` per timestep of the longest rollout); a sample whose rollout is over keeps its value."""
    if not bool((offsets > 0).any()):
        return x_t
    k = offsets.to(sigma)
    source = torch.clamp(sigma + k / NUM_TRAIN_TIMESTEPS, max=1.0)  # (B,)
    x, current = noisy_sample(x0, noise, source, fixed_frames, fixed_last), source
    for j in range(1, int(offsets.max()) + 1):
        # from the source, not accumulated: step `offset` lands on sigma exactly, whatever float rounding did
        following = torch.where(j >= k, sigma, torch.maximum(source - j / NUM_TRAIN_TIMESTEPS, sigma))
        dt = (following - current).view(-1, *([1] * (x.dim() - 1)))  # <= 0; 0 once a sample reached sigma
        moving = dt != 0
        velocity = predict(x, current)
        if velocity.shape != x.shape:  # a π-Flow head: n velocities per channel, which a scheduler's policy combines
            raise ValueError(f"scheduled sampling rolls out with Euler steps of one velocity per latent channel; this "
                             f"transformer predicts {velocity.shape[1] // x.shape[1]} per channel (a π-Flow distilled "
                             "checkpoint): set scheduled_sampling_max_step_offset: 0, or train the sft checkpoint")
        x = torch.where(moving, clean_frames(x + dt * velocity, x0, fixed_frames, fixed_last), x)
        current = following
    rolled = (offsets > 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(rolled, x.to(x_t.dtype), x_t)
