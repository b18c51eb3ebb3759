"""A training step's FLOP rate and model FLOPs utilisation (MFU), as nanoGPT's `train.py` prints it beside each step.

The FLOPs are counted, not modelled: the first micro-step of each new batch shape runs under `StepFlops`, a torch
dispatch mode that adds torch's flop-counter formulas (`torch.utils.flop_counter`: matmuls, convolutions and the
attention kernels) over every op of the forward and the backward. A LoRA step's backward computes no gradient of a
frozen weight, so the count is what ran, not the 3x-the-forward rule of full fine-tuning. Gradient checkpointing
recomputes the checkpointed blocks' forward inside the backward: those ops run with grad mode on (the autograd
engine runs the backward's own ops with it off), so they are counted apart. The model FLOPs (`tflop`) leave them
out, as MFU does (PaLM, appendix B); `recompute_tflop` is the extra work the card did. The other micro-steps of the
same shapes reuse the count: same shapes, same ops.

MFU is the model FLOPs per second over the card's dense bf16 peak: `gpu_peak_tflops`, else the card's row of
`PEAK_TFLOPS` by name, else unknown (the FLOP rate alone is logged, as on the CPU). Flex attention (NABLA) has no
formula in the counter: its FLOPs are left out, and the line says the count is a lower bound there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a part of `torch.cuda.get_device_name()`; the first match
# wins, so the more specific names come first. Sources: NVIDIA's datasheets (H100: "H100 Tensor Core GPU" datasheet,
# BF16 1,979 / 1,513 TFLOPS with sparsity for SXM / PCIe, halved; H200: "H200 Tensor Core GPU" datasheet, 1,979 with
# sparsity; A100: "A100 Tensor Core GPU" datasheet, BF16 312; L40S: datasheet, 733 with sparsity), and the
# architecture whitepapers for the GeForce cards with FP32 accumulate, which training uses (Ada "NVIDIA ADA GPU
# ARCHITECTURE" appendix, RTX 4090 165.2; Blackwell "NVIDIA RTX BLACKWELL GPU ARCHITECTURE", RTX 5090 209.5;
# Ampere GA102 whitepaper, RTX 3090 71).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.5),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 366.5),
    ("RTX 5090", 209.5),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
)


def card_peak_tflops(device_name: str, configured: float | None = None) -> float | None:
    """The peak MFU is measured against: `configured` (the `gpu_peak_tflops` key), else the known card's."""
    if configured is not None:
        return configured
    return next((peak for name, peak in PEAK_TFLOPS if name in device_name), None)


@dataclass(frozen=True)
class MicroStepFlops:
    """One micro-step's counted FLOPs: forward and backward as the model needs them, and checkpoint recompute."""

    model: int
    recompute: int
    uncounted: frozenset[str] = frozenset()  # ops with a known cost and no formula (flex attention)


def attention_flops() -> dict:
    """Formulas for the CPU flash-attention kernel that SDPA takes on CPU tensors, which torch's flop counter
    lacks: its own SDPA formulas, 4 * B * H * N_q * N_kv * d forward (two batched matmuls, 2 flops per
    multiply-add) and 2x that backward (four matmuls plus the recomputed scores)."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001 (shapes)
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001 (shapes)
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def flop_formulas() -> dict:
    """torch's flop-counter formulas by op, with the CPU attention kernel's."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, **{op: shape_wrapper(f) for op, f in attention_flops().items()}}


def step_flops() -> Any:
    """A new `StepFlops` mode (torch imported here, not at import)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    formulas = flop_formulas()
    flex = {"flex_attention", "flex_attention_backward"}

    class StepFlops(TorchDispatchMode):
        """FLOPs of every op with a formula: `recompute` those run with grad mode on inside a backward."""

        supports_higher_order_operators = True  # flex attention is one: passed through, named uncounted

        def __init__(self) -> None:
            super().__init__()
            self.forward = self.backward = self.recompute = 0
            self.in_backward = False
            self.uncounted: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if packet in formulas:
                flops = formulas[packet](*args, **kwargs, out_val=out)
                if not self.in_backward:
                    self.forward += flops
                elif torch.is_grad_enabled():
                    self.recompute += flops
                else:
                    self.backward += flops
            elif getattr(func, "__name__", "") in flex:
                self.uncounted.add(func.__name__)
            return out

        def counted(self) -> MicroStepFlops:
            return MicroStepFlops(self.forward + self.backward, self.recompute, frozenset(self.uncounted))

    return StepFlops()


@dataclass(frozen=True)
class StepRate:
    """A step's FLOP rate and, where the card's peak is known, its MFU (and the recompute's share beside it)."""

    tflop: float  # model FLOPs of the step, 1e12
    recompute_tflop: float
    tflops: float  # model TFLOP/s
    mfu: float | None  # model TFLOP/s over the peak; None: peak unknown (the CPU, an unlisted card)
    lower_bound: bool  # some ops (flex attention) had no formula

    @classmethod
    def of(cls, counts: list[MicroStepFlops], seconds: float, peak_tflops: float | None) -> StepRate:
        model, recompute = sum(c.model for c in counts) / 1e12, sum(c.recompute for c in counts) / 1e12
        rate = model / seconds
        return cls(model, recompute, rate, None if peak_tflops is None else rate / peak_tflops,
                   any(c.uncounted for c in counts))

    def line(self, peak_tflops: float | None) -> str:
        """' | 41.2 TFLOP/s | MFU 4.2% (+1.3% recompute)' for the step's log line."""
        rate = f"{self.tflops:.3g}{'+' if self.lower_bound else ''} TFLOP/s"
        if self.mfu is None or peak_tflops is None:
            return f" | {rate}"
        recompute = self.recompute_tflop / self.tflop * self.mfu if self.tflop else 0.0
        extra = f" (+{100 * recompute:.1f}% recompute)" if self.recompute_tflop else ""
        return f" | {rate} | MFU {100 * self.mfu:.1f}%{extra}"
