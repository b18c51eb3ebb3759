"""SimpleTuner's loss types for the flow-matching regression (`loss_type`, `huber_c`, `huber_schedule`).

With r = prediction - target and c the (scheduled) huber_c, elementwise, then the mean:
    l2         r^2                                  (F.mse_loss: the default, bit for bit what training did before)
    huber      2c (sqrt(r^2 + c^2) - c)             pseudo-Huber: ~ r^2 for |r| << c, ~ 2c|r| for |r| >> c
    smooth_l1  2 (sqrt(r^2 + c^2) - c)              the same curve divided by c: ~ r^2 / c, then ~ 2|r|
The schedules make c a function of each sample's sigma (timestep = 1000 sigma), as SimpleTuner computes them:
    constant     c
    exponential  exp(-alpha t) with alpha = -ln(c) / 1000, i.e. c ** sigma (1 at pure data, c at pure noise)
    snr          (1 - c) / (1 + s)^2 + c with s = sqrt((1 - sigma) / (sigma + 1e-4)), the flow "sigma" of SNR
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

LOSS_TYPES = ("l2", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")


class LossType(NamedTuple):
    """What the flow loss is: `l2` alone needs no sigma."""

    kind: str = "l2"
    huber_c: float = 0.1
    huber_schedule: str = "snr"


def scheduled_huber_c(sigma: torch.Tensor, huber_c: float, schedule: str) -> torch.Tensor:
    """c per sample, shape (B,), from each sample's sigma in (0, 1)."""
    sigma = sigma.double()
    if schedule == "constant":
        return torch.full_like(sigma, huber_c)
    if schedule == "exponential":
        return torch.exp(-(-torch.log(torch.tensor(huber_c, dtype=torch.float64)) / 1000) * (sigma * 1000))
    if schedule == "snr":
        s = ((1 - sigma) / (sigma + 1e-4)) ** 0.5
        return (1 - huber_c) / (1 + s) ** 2 + huber_c
    raise ValueError(f"huber_schedule {schedule!r} is not known; allowed: {', '.join(HUBER_SCHEDULES)}")


def regression_loss(prediction: torch.Tensor, target: torch.Tensor, loss: LossType = LossType(),
                    sigma: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The mean loss of `prediction` against `target` (B, ...), both fp32; `sigma` (B,) for a scheduled c.
    `weights` (broadcast over the elements: masked loss's masks) weigh each element, the mean then normalised by
    the weights' mean, so all-ones weights give the unweighted loss."""
    if loss.kind == "l2":
        if weights is None:
            return F.mse_loss(prediction, target)
        elementwise = F.mse_loss(prediction, target, reduction="none")
    else:
        if loss.kind not in LOSS_TYPES:
            raise ValueError(f"loss_type {loss.kind!r} is not known; allowed: {', '.join(LOSS_TYPES)}")
        if sigma is None:
            raise ValueError(f"loss_type {loss.kind}: the scheduled huber_c needs each sample's sigma")
        c = scheduled_huber_c(sigma, loss.huber_c, loss.huber_schedule).to(prediction)
        c = c.view(-1, *([1] * (prediction.dim() - 1)))  # (B,) over (B, C, T, H, W)
        squared = (prediction - target) ** 2
        # = sqrt(r^2 + c^2) - c, without its cancellation at small r
        curve = squared / (torch.sqrt(squared + c ** 2) + c)
        elementwise = 2 * (c if loss.kind == "huber" else 1) * curve
        if weights is None:
            return elementwise.mean()
    weights = weights.to(elementwise.device).expand_as(elementwise)
    return (elementwise * weights).mean() / weights.mean()
