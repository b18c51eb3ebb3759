"""Issue 32's optimizers and flow schedules (training/options/optimizers.py, the schedules in step_draws): Muon's update
is orthogonal within its Newton-Schulz iteration's bound, LoRA+'s groups, schedule-free's average around renders and
at export, each schedule option in training's draws. Through `train_lora` (sharing test_train.py's caches and
baseline run): tests/training/test_train.py's issue 32 section."""

from __future__ import annotations

import torch

from loraflow.config import LoraflowConfig
from loraflow.kernels.flow_matching import auto_shift
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.training import batches as D
from loraflow.training.model_setup import load_transformer
from loraflow.training.options.optimizers import averaged_weights, exported, make_optimizer, set_lr
from tests.numerics import U32

CPU = torch.device("cpu")
SHAPE = (4, 16, 3, 8, 12)  # (B, C, T, h, w): 3 x 4 x 6 = 72 tokens


def test_flow_schedule_options_reach_the_training_draws(demo_config: LoraflowConfig) -> None:
    """Micro-step 0's sigmas (`step_draws`: what training uses) with each schedule option, against the plain
    draws of the same generator: the range maps them onto [0.2, 0.8] (two float32 roundings), the auto shift is
    the shift of the batch's token count (frames x h/2 x w/2), the beta schedule draws others. The range is two
    float32 roundings (times 0.6, plus 0.2) of values below the result on either side: each side is within 2u of the
    exact result, so within 4u of the other."""
    def sigmas(**option) -> torch.Tensor:
        config = demo_config.model_copy(update=option)
        return D.step_draws(config, get_family(config), 0, SHAPE).sigma

    plain = sigmas()
    ranged = sigmas(min_timestep=200, max_timestep=800)
    assert torch.allclose(ranged, plain * 0.6 + 0.2, rtol=4 * U32, atol=0) and not torch.equal(ranged, plain)
    tokens = SHAPE[2] * (SHAPE[3] // 2) * (SHAPE[4] // 2)
    assert torch.equal(sigmas(flow_schedule_auto_shift=True), sigmas(flow_schedule_shift=auto_shift(tokens)))
    assert not torch.equal(sigmas(flow_schedule_auto_shift=True), plain)
    beta = sigmas(flow_use_beta_schedule=True, flow_beta_schedule_alpha=1.0)
    assert not torch.equal(beta, plain) and ((0 < beta) & (beta < 1)).all()


def newton_schulz_singular_values(x: torch.Tensor, coefficients: tuple[float, float, float],
                                  steps: int) -> torch.Tensor:
    """X -> aX + (bXX^T + c(XX^T)^2)X maps each singular value s to p(s) = as + bs^3 + cs^5: the iteration's
    exact output singular values, in float64, from the input's normalised ones."""
    a, b, c = coefficients
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def test_muon_update_is_orthogonal_within_its_iteration_bound(demo_config: LoraflowConfig) -> None:
    """One Muon step from zero weights on gradients with singular values 1..100: the update's singular values are
    p^5(s_i / |G|_F) (torch's quintic, 5 steps), not the gradient's spread. torch runs the iteration in bf16
    (u = 2^-8): 5 steps of 3 roundings each (X, XX^T, the polynomial), each moving a singular value by at most
    u |p'| <= 3.5 u of the ~1.2 largest, bound the difference by 15 x 3.5 x 1.2 x 2^-8 < 0.25; a plain
    (unorthogonalised) step would differ by up to 100x. (The expected values lie in 0.69..1.1: the gradient's
    100:1 spread is gone.)"""
    config = demo_config.model_copy(update={"optimizer": "muon"})
    g = torch.Generator().manual_seed(0)
    spread = torch.tensor([100.0, 30.0, 3.0, 1.0], dtype=torch.float64)
    params, gradients = [], []
    for shape in ((4, 48), (48, 4)):  # a lora_A and a lora_B matrix
        u, _ = torch.linalg.qr(torch.randn(shape[0], 4, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(shape[1], 4, generator=g, dtype=torch.float64))
        gradients.append(u @ torch.diag(spread) @ v.T)
        params.append(torch.nn.Parameter(torch.zeros(shape)))
    optimizer = make_optimizer(config, params)
    set_lr(optimizer, 1e-3)
    for p, grad in zip(params, gradients):
        p.grad = grad.float()
    optimizer.step()
    ns = optimizer.param_groups[0]
    for p, grad in zip(params, gradients):
        adjusted = 1e-3 * 0.2 * max(p.shape) ** 0.5  # match_rms_adamw
        update = torch.linalg.svdvals(-p.detach().double() / adjusted)
        nesterov = grad * (1 + ns["momentum"])  # first step: buffer = g, g + mu * buffer
        expected = newton_schulz_singular_values(torch.linalg.svdvals(nesterov) / nesterov.norm(),
                                                 ns["ns_coefficients"], ns["ns_steps"]).sort(descending=True).values
        assert (update - expected).abs().max() < 0.25, (update, expected)


def test_loraplus_puts_the_b_matrices_in_a_group_at_ratio_times_lr(demo_config: LoraflowConfig) -> None:
    config = demo_config.model_copy(update={"loraplus_lr_ratio": 16.0})
    transformer, params = load_transformer(config, get_family(config), model_source(config), CPU)
    optimizer = make_optimizer(config, params, transformer)
    b = {id(p) for n, p in transformer.named_parameters() if "lora_B" in n}
    rest, plus = optimizer.param_groups
    assert {id(p) for p in plus["params"]} == b and b.isdisjoint(id(p) for p in rest["params"])
    set_lr(optimizer, 1e-3)
    assert (rest["lr"], plus["lr"]) == (1e-3, 1.6e-2)


def assert_average(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> None:
    """x is schedule-free's average y + (1 - 1/beta1)(z - y), beta1 = 0.9, within the rounding of either route."""
    step = (1 - 1 / 0.9) * (z.double() - y.double())
    exact = y.double() + step
    assert ((x.double() - exact).abs() <= U32 * (3 * step.abs() + exact.abs())).all()


def test_schedulefree_renders_and_exports_the_average_and_trains_on_unchanged(demo_config: LoraflowConfig) -> None:
    """Around a render during training (`averaged_weights`) the parameters are schedule-free's average
    x = y + (1 - 1/beta1)(z - y); afterwards y again, bit for bit (schedule-free's own train() after eval() rounds
    a few hundred of these 4096 values elsewhere), so the next step is the one without a render.
    After the last step `exported` leaves x in them for good (what train_lora writes).
    Schedule-free's lerp y + w (z - y) rounds w = 1 - 1/beta1 to float32, then the difference z - y, the product and
    the sum once each: within u (3 |w (z - y)| + |x|) of x in float64 (to first order: the rest is 2^-24 of that)."""
    config = demo_config.model_copy(update={"optimizer": "adamw_schedulefree"})

    def stepped(render: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        param = torch.nn.Parameter(torch.zeros(64, 64))  # enough values that eval() then train() rounds some
        optimizer = make_optimizer(config, [param])
        shown = None
        for k in range(3):
            param.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(k))
            optimizer.step()
            if render and k == 1:
                y, z = param.detach().clone(), optimizer.state[param]["z"].clone()
                with averaged_weights(optimizer):
                    shown = param.detach().clone()
                    assert_average(shown, y, z)
                assert torch.equal(param.detach(), y)
        y, z = param.detach().clone(), optimizer.state[param]["z"]
        exported(optimizer)
        assert_average(param.detach(), y, z)
        return y, shown

    rendered, shown = stepped(True)
    assert torch.equal(rendered, stepped(False)[0]) and not torch.equal(shown, rendered)
