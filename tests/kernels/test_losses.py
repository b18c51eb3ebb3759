"""loss_type huber / smooth_l1 against their definitions in float64, and huber_c's schedules against their closed
forms (kernels/losses.py; SimpleTuner's definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from loraflow.kernels.losses import LossType, regression_loss, scheduled_huber_c
from tests.numerics import U32, gamma

SHAPE = (2, 4, 1, 4, 4)  # (B, C, T, h, w): n = 128 elements
N = math.prod(SHAPE)
U64 = 2.0**-53


def residuals(scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(SHAPE, generator=g)
    return target + scale * torch.randn(SHAPE, generator=g), target


def definition(prediction: torch.Tensor, target: torch.Tensor, c: torch.Tensor, kind: str) -> torch.Tensor:
    """SimpleTuner's formula, in float64 on the same (float32) inputs."""
    r = prediction.double() - target.double()
    c = c.double().view(-1, 1, 1, 1, 1)
    curve = torch.sqrt(r**2 + c**2) - c
    return ((2 * c if kind == "huber" else 2) * curve).mean()


def test_huber_at_small_residuals_is_l2() -> None:
    """2c(sqrt(r^2 + c^2) - c) = r^2 - r^4 / (4c^2) + ...: with sqrt(1 + x) in [1 + x/2 - x^2/8, 1 + x/2] for
    x = r^2/c^2 >= 0, each element lies in [r^2 - r^4/(4c^2), r^2]: l2 (r^2 = 2 x the classic r^2/2) to relative
    r^2/(4c^2). In float64 both means err by at most gamma_n 2^-53 of themselves."""
    c = 0.1
    prediction, target = residuals(1e-3 * c)
    p, t = prediction.double(), target.double()
    l2 = regression_loss(p, t).item()
    huber = regression_loss(p, t, LossType("huber", c, "constant"), torch.full((2,), 0.5)).item()
    gap = ((p - t) ** 4).mean().item() / (4 * c**2)
    slack = 2 * gamma(N + 8, U64) * l2
    assert -slack <= l2 - huber <= gap + slack, (l2, huber, gap)
    assert gap < 1e-5 * l2  # every |r| < 6.3e-4 here: each r^2 / (4c^2) < 1e-5


@pytest.mark.parametrize("kind", ["huber", "smooth_l1"])
@pytest.mark.parametrize("scale", [1e-4, 1.0], ids=["small", "large"])
def test_float32_loss_matches_its_float64_definition(kind: str, scale: float) -> None:
    """Each element r^2 / (sqrt(r^2 + c^2) + c) (times 2c or 2) passes through at most 10 float32 roundings of
    relative u = 2^-24, none cancelling (every term is >= 0), and the mean of n = 128 adds gamma_n: the float32 loss
    is the float64 definition to (10 + gamma_n / u) u relative. The textbook sqrt(r^2 + c^2) - c loses
    u c^2 / r^2 (~2% at r = 1e-4, c = 0.1) to cancellation."""
    prediction, target = residuals(scale)
    sigma = torch.tensor([0.2, 0.9])
    for schedule in ("constant", "exponential", "snr"):
        loss = LossType(kind, 0.1, schedule)
        mine = regression_loss(prediction, target, loss, sigma).double()
        reference = definition(prediction, target, scheduled_huber_c(sigma, 0.1, schedule), kind)
        assert abs(mine - reference) <= (10 * U32 + gamma(N, U32)) * reference, (schedule, mine, reference)


def test_huber_c_schedules_are_their_closed_forms() -> None:
    """exponential: exp(-alpha t), alpha = -ln(c)/1000, t = 1000 sigma, i.e. c**sigma; snr: (1 - c)/(1 + s)^2 + c,
    s = sqrt((1 - sigma)/(sigma + 1e-4)). In float64: a few roundings of 2^-53 each."""
    sigma = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    c = 0.1
    exponential = scheduled_huber_c(sigma, c, "exponential")
    assert torch.allclose(exponential, c**sigma, rtol=16 * U64, atol=0)
    s = ((1 - sigma) / (sigma + 1e-4)).sqrt()
    assert torch.allclose(scheduled_huber_c(sigma, c, "snr"), (1 - c) / (1 + s) ** 2 + c, rtol=16 * U64, atol=0)
    assert torch.equal(scheduled_huber_c(sigma, c, "constant"), torch.full_like(sigma, c))
    # each sample's own c: the batch loss is the mean of the samples' losses
    prediction, target = residuals(1.0)
    loss = LossType("huber", c, "snr")
    both = regression_loss(prediction, target, loss, sigma[1:3].float())
    each = [regression_loss(prediction[i:i + 1], target[i:i + 1], loss, sigma[i + 1:i + 2].float()) for i in (0, 1)]
    assert torch.allclose(both, sum(each) / 2, rtol=4 * gamma(N, U32), atol=0)


def test_l2_is_mse_bit_for_bit_and_unknown_names_are_named() -> None:
    prediction, target = residuals(1.0)
    assert torch.equal(regression_loss(prediction, target), torch.nn.functional.mse_loss(prediction, target))
    with pytest.raises(ValueError, match="loss_type 'l1' is not known; allowed: l2, huber, smooth_l1"):
        regression_loss(prediction, target, LossType("l1"), torch.zeros(2))
    with pytest.raises(ValueError, match="huber_schedule 'cosine' is not known"):
        regression_loss(prediction, target, LossType("huber", 0.1, "cosine"), torch.zeros(2))
