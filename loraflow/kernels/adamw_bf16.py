"""`optimizer: adamw_bf16`: AdamW whose two moments are stored in bfloat16, rounded stochastically.

What it is, against SimpleTuner's `adamw_bf16` (helpers/training/optimizers/adamw_bfloat16): that one trains bf16
parameters and keeps a bf16 compensation buffer beside them; loraflow's LoRA parameters are always fp32, so here
only the optimizer state shrinks (exp_avg and exp_avg_sq: 2 bytes each instead of 4, half of AdamW's state).
The parameters and the update are computed in fp32 exactly as torch's single-tensor AdamW computes them, from the
moments just computed in fp32; only what is *stored* for the next step is rounded. Stochastic rounding (round up
with probability equal to the fraction cut off) keeps the stored moments unbiased, so small updates to a moment
are not lost as round-to-nearest would lose them.

Resume is exact without a generator in the state: step t's random bits for parameter i come from a generator
seeded by (seed, t, i), and the state is tensors only (`step`, `exp_avg`, `exp_avg_sq`), as a checkpoint stores it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MIX = 1_000_003  # a prime: (seed, step, index) -> distinct generator seeds for any realistic run


def round_stochastic(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """float32 -> bfloat16, rounding each value up (in magnitude) with probability equal to the fraction of a bf16
    ulp it lies above the value below it; E[result] = values. bf16 is float32's top 16 bits, so adding 16 random
    bits to the low half and cutting it off does exactly that (the sign bit is apart: magnitudes round alike)."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, generator=generator, device=values.device)
    bits = (values.float().contiguous().view(torch.int32) + noise) & -65536  # -65536 = 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


class AdamWBF16(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), bf16 moments (see the module doc)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "seed": seed})
        # load_state_dict casts every state tensor to its parameter's dtype (fp32): put the moments back in bf16,
        # which is exact (they were bf16 when saved)
        self.register_load_state_dict_post_hook(_moments_to_bf16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("AdamWBF16 takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay, seed = group["lr"], group["eps"], group["weight_decay"], group["seed"]
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                step = int(state["step"].item())
                grad = p.grad.float()
                # 1. the fp32 moments from the stored ones, as torch's _single_tensor_adam updates them
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                # 2. the update, in torch's order: decay, then addcdiv with the bias corrections
                p.mul_(1 - lr * decay)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                # 3. what the next step reads: bf16, rounded stochastically from (seed, step, index)
                generator = torch.Generator(p.device).manual_seed(((seed * MIX + step) * MIX + index) % 2**64)
                state["exp_avg"] = round_stochastic(exp_avg, generator)
                state["exp_avg_sq"] = round_stochastic(exp_avg_sq, generator)


def _moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                state[name] = state[name].to(torch.bfloat16)
