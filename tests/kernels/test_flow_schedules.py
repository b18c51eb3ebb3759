"""The flow schedules from the peers (kernels/flow_matching.py `sample_sigmas`, `auto_shift`) against their closed
forms: each sampler's empirical CDF within the Dvoretzky-Kiefer-Wolfowitz bound of the exact CDF.

DKW (Massart's constant): P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2). With n = 20000 draws and eps = 0.0175 that is
below 1e-5: a correct sampler fails on fewer than 1 seed in 100000 (the seeds are fixed, so the test is
deterministic); a wrong alpha/beta, a missing shift or a range off by 0.05 moves the CDF by more than 0.05.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from loraflow.kernels.flow_matching import auto_shift, sample_sigmas

N = 20_000
EPS = 0.0175  # 2 exp(-2 N EPS^2) = 9.7e-6


def ks(draws: torch.Tensor, cdf: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """sup |F_n - F| of the draws against the exact CDF, in float64 (both sides of each step)."""
    x = draws.double().sort().values
    f = cdf(x)
    i = torch.arange(1, len(x) + 1, dtype=torch.float64)
    return max((i / len(x) - f).abs().max().item(), (f - (i - 1) / len(x)).abs().max().item())


def unshift(x: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of sigma' = s sigma / (1 + (s - 1) sigma): the CDF of a shifted draw is F(unshift(x))."""
    return x / (shift - (shift - 1) * x)


def draws(seed: int = 0, **kwargs) -> torch.Tensor:
    return sample_sigmas(N, torch.Generator().manual_seed(seed), **kwargs)


def test_beta_schedule_draws_beta_then_shifts() -> None:
    # Beta(2, 2): F = 3x^2 - 2x^3; Beta(1, 3): F = 1 - (1 - x)^3 (integer parameters: polynomial CDFs)
    assert ks(draws(beta=(2.0, 2.0)), lambda x: 3 * x**2 - 2 * x**3) < EPS
    assert ks(draws(1, beta=(1.0, 3.0), shift=3.0), lambda x: 1 - (1 - unshift(x, 3.0)) ** 3) < EPS
    assert ks(draws(1, beta=(1.0, 3.0), shift=3.0), lambda x: 1 - (1 - x) ** 3) > 0.1  # the shift shows


def test_timestep_range_maps_the_shifted_sigmas_onto_it() -> None:
    """musubi-tuner's min/max_timestep: t' = t (max - min)/1000 + min/1000 after the shift: uniform on [0.2, 0.7];
    sigmoid(scale N(0,1)), shifted by 2, on [0.1, 1.0]: F(x) = Phi(logit(unshift((x - 0.1)/0.9)) / scale)."""
    uniform = draws(2, mode="uniform", timesteps=(200, 700))
    assert ks(uniform, lambda x: ((x - 0.2) / 0.5).clamp(0, 1)) < EPS
    phi = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)

    def sigmoid_cdf(x: torch.Tensor) -> torch.Tensor:
        u = unshift((x - 0.1) / 0.9, 2.0)
        return phi.cdf(torch.log(u / (1 - u)) / 1.3)

    assert ks(draws(3, mode="sigmoid", scale=1.3, shift=2.0, timesteps=(100, None)), sigmoid_cdf) < EPS
    same = torch.Generator().manual_seed(4)  # unset range: the draws of before, bit for bit
    assert torch.equal(sample_sigmas(8, same, shift=3.0, timesteps=(None, None)),
                       sample_sigmas(8, torch.Generator().manual_seed(4), shift=3.0))


def test_auto_shift_is_simpletuners_token_rule() -> None:
    """exp(mu), mu through (256, 0.5) and (4096, 1.15), linear (Flux's calculate_shift, diffusers' defaults)."""
    assert auto_shift(256) == math.exp(0.5)
    assert math.isclose(auto_shift(4096), math.exp(1.15), rel_tol=4 * 2.0**-52)
    assert math.isclose(auto_shift(2176), math.exp(0.825), rel_tol=4 * 2.0**-52)  # the midpoint
