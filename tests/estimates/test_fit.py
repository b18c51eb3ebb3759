"""The fit marks of `loraflow check`'s estimates table (`estimates.fit`)."""

from __future__ import annotations

from loraflow import estimates
from tests.estimates.measured import GIB


def test_fit_marks_keep_a_margin() -> None:
    """✓ under 90% of the card with 0.5 GiB of CUDA context, tight up to all of it, ✗ over."""
    def stage(gib: float) -> estimates.StageEstimate:
        return estimates.StageEstimate("lora", {"weights": int(gib * GIB)})

    assert [stage(g).mark(24) for g in (20.5, 21.2, 23.4, 23.6)] == ["✓", "tight", "tight", "✗"]
    assert stage(20.5).fits(24) and not stage(21.2).fits(24)
