"""Tolerances derived from the arithmetic, for the comparisons that cannot be bit for bit (issue 15: the suite must
mean the same on any x86 CPU and thread count, whatever order their kernels add in).

One IEEE rounding moves a value by at most u of itself: u = 2^-24 in float32, 2^-53 in float64. A float sum of n
terms errs by at most gamma_n * sum|terms|, gamma_n = n u / (1 - n u), in whatever order it adds them (Higham,
Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1): two orders differ by at most twice that.

A comparison is bit for bit where both sides run the same ops on the same shapes with the same thread count. Where
they cannot (another padding, batch composition or slab shape changes how a kernel blocks its sums), either the
bound above is computed from the magnitudes involved (one layer), or the network runs in float64 and the two
sides must agree to FLOAT64_AGREEMENT (`assert_float64_close`).
"""

from __future__ import annotations

import torch

U32 = 2.0**-24  # float32's unit roundoff; float64's is 2^-53

# Two float64 runs of one network's math (other shapes, paddings or summation orders): each layer's sums of
# n <= 2^11 products (the tiny models' widest) differ by at most 2 gamma_n ~ 2^-41 of their magnitudes; with 2^5
# for the layers amplifying it, 2^-36 (1.5e-11) of the output's largest magnitude (measured: at most 2^-47). The same
# comparisons in float32 differ by 2^-23 to 2^-18 of it, and a wrong pad, mask, crop, scale or input moves it by more
# than 1e-4: both would fail.
FLOAT64_AGREEMENT = 2.0**-36
# The same derivation in float32 (u = 2^-24): 2 gamma_n ~ 2^-12 per layer, 2^-7 of the output's largest magnitude with
# the 2^5; float32 differences measured 2^-23 to 2^-18 of it (above). For float32 networks that cannot run in float64
# (a benchmark's smoke run).
FLOAT32_AGREEMENT = 2.0**-7


def gamma(n: int, u: float) -> float:
    """The bound on the relative error of a sum of n terms (of their absolute sum), in any order."""
    return n * u / (1 - n * u)


def assert_float64_close(mine: torch.Tensor, reference: torch.Tensor, float32_roundings: int = 0) -> None:
    """`mine` and `reference` computed in float64 by different routes to the same math; `float32_roundings` of them
    were then rounded to float32 (a family returns float32), each moving a value by at most U32 of itself."""
    reference = reference.double().reshape(mine.shape)
    difference = (mine.double() - reference).abs()
    tolerance = float32_roundings * U32 * reference.abs() + FLOAT64_AGREEMENT * reference.abs().max()
    worst = (difference / tolerance).max().item()
    assert worst <= 1, f"differs by up to {worst:.3g} x the tolerance (max |difference| {difference.max().item():.3g})"
