"""`adamw_bf16` against torch's fp32 AdamW: the same update, bf16 moments within one bf16 ulp, unbiased rounding,
and an exact resume through the checkpoint's tensor format."""

from __future__ import annotations

import torch

from loraflow.kernels.adamw_bf16 import AdamWBF16, round_stochastic
from loraflow.training.checkpoints import _unflatten_optimizer, optimizer_state

BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: one ulp is at most 2^-7 of the value it rounds


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def test_one_step_is_torch_adamw_and_moments_round_to_a_neighbour() -> None:
    """From the same state (bf16-representable moments, step 4) and gradient, the parameters move exactly as torch's
    single-tensor AdamW moves them; each stored moment is one of the two bf16 values around AdamW's fp32 moment."""
    mine, reference = params(), params()
    ours = AdamWBF16(mine, lr=1e-2, weight_decay=1e-2, seed=3)
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    for p, q in zip(mine, reference):
        grad, m, v = (torch.randn(p.shape, generator=g), torch.randn(p.shape, generator=g),
                      torch.rand(p.shape, generator=g))
        p.grad, q.grad = grad.clone(), grad.clone()
        ours.state[p] = {"step": torch.tensor(3.0), "exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16()}
        torch_adamw.state[q] = {"step": torch.tensor(3.0), "exp_avg": m.bfloat16().float(),
                                "exp_avg_sq": v.bfloat16().float()}
    ours.step()
    torch_adamw.step()
    for p, q in zip(mine, reference):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq"):
            stored, exact = ours.state[p][name], torch_adamw.state[q][name]
            assert stored.dtype == torch.bfloat16
            assert ((stored.float() - exact).abs() <= BF16_ULP * exact.abs()).all()


def test_stochastic_rounding_is_unbiased() -> None:
    """Values a fraction f of an ulp above a bf16 value: the mean of 2^16 roundings is within 6 standard deviations
    (each rounding is off by at most an ulp, so the mean's deviation is at most ulp / 2 / 2^8) of the value, where
    round-to-nearest is off by min(f, 1 - f) ulp, 30 to 64 times that."""
    ulp, n = 2.0**-7, 2**16
    for f in (0.25, 0.1, 0.875):
        for sign in (1.0, -1.0):
            value = torch.full((n,), sign * (1.0 + f * ulp))  # f * ulp is exact in float32
            rounded = round_stochastic(value, torch.Generator().manual_seed(0)).double()
            assert set(rounded.abs().unique().tolist()) == {1.0, 1.0 + ulp}
            assert abs(rounded.mean().item() - value[0].item()) <= 6 * ulp / 2 / 2**8
            assert abs(value.bfloat16().double().mean().item() - value[0].item()) >= 0.1 * ulp  # what SR avoids


def run(optimizer: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: range) -> None:
    """A loss whose gradient depends on the parameters: a resume that changed them would change the next steps."""
    for step in steps:
        optimizer.zero_grad()
        sum(((p - step * 0.1) ** 4).sum() for p in ps).backward()
        optimizer.step()


def test_resume_through_the_checkpoint_format_is_exact() -> None:
    straight = params()
    optimizer = AdamWBF16(straight, lr=1e-2, seed=7)
    run(optimizer, straight, range(6))

    first = params()
    optimizer = AdamWBF16(first, lr=1e-2, seed=7)
    run(optimizer, first, range(3))
    tensors, scalars = optimizer_state(optimizer)  # what save_checkpoint writes: safetensors + JSON
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    optimizer = AdamWBF16(resumed, lr=1e-2, seed=7)
    optimizer.load_state_dict(_unflatten_optimizer(tensors, scalars))
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.bfloat16}
    run(optimizer, resumed, range(3, 6))
    for p, q in zip(straight, resumed):
        assert torch.equal(p, q)
