"""A training step's FLOPs, counted (loraflow/training/flops.py): what a LoRA step really runs (no gradient of a
frozen weight), checkpoint recompute apart, and the MFU line nanoGPT prints."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from loraflow.training.flops import MicroStepFlops, StepRate, card_peak_tflops, step_flops


def two_layers(checkpointed: bool) -> MicroStepFlops:
    """x (B, i) -> frozen Linear(i, h) -> trained Linear(h, o): a LoRA step's shape in miniature."""
    torch.manual_seed(0)
    batch, i, h, o = 3, 5, 7, 11
    frozen, trained = torch.nn.Linear(i, h).requires_grad_(False), torch.nn.Linear(h, o)
    x = torch.randn(batch, i)
    counter = step_flops()
    with counter:
        forward = (lambda t: trained(frozen(t))) if not checkpointed else \
            (lambda t: checkpoint(lambda u: trained(frozen(u)), t, use_reentrant=False))
        loss = forward(x).square().sum()
        counter.in_backward = True
        loss.backward()
    return counter.counted()


def test_a_lora_steps_flops_are_what_runs_and_recompute_is_apart() -> None:
    """Forward 2*B*i*h + 2*B*h*o; the backward only the trained weight's gradient, 2*B*h*o (no input gradient:
    the frozen layer and x need none); checkpointed, the frozen layer's output is recomputed (2*B*i*h, apart)."""
    batch, i, h, o = 3, 5, 7, 11
    plain = two_layers(checkpointed=False)
    assert plain == MicroStepFlops(model=2 * batch * i * h + 2 * 2 * batch * h * o, recompute=0)
    recomputed = two_layers(checkpointed=True)
    assert recomputed.model == plain.model and recomputed.recompute == 2 * batch * i * h


def test_mfu_against_the_cards_peak() -> None:
    assert card_peak_tflops("NVIDIA H100 PCIe") == 756.5 and card_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert card_peak_tflops("NVIDIA H200") == 989.4 and card_peak_tflops("NVIDIA GeForce RTX 4090") == 165.2
    assert card_peak_tflops("Some Card") is None and card_peak_tflops("Some Card", 100.0) == 100.0
    rate = StepRate.of([MicroStepFlops(300 * 10**12, 100 * 10**12)] * 2, 2.0, 989.4)
    assert (rate.tflop, rate.recompute_tflop, rate.tflops) == (600.0, 200.0, 300.0)
    assert rate.line(989.4) == " | 300 TFLOP/s | MFU 30.3% (+10.1% recompute)"
    assert StepRate.of([MicroStepFlops(10**9, 0)], 1.0, None).line(None) == " | 0.001 TFLOP/s"
