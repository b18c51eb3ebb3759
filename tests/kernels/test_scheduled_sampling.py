"""Scheduled sampling: off means the input itself, the rollout is Euler on the model's own prediction, the draws come
from the caller's generator alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import Kandinsky5Transformer3DModel

from loraflow.kernels.flow_matching import noisy_sample
from loraflow.kernels.scheduled_sampling import draw_offsets, roll_out, rollout_probability
from tests.numerics import U32

SHAPE = (2, 16, 3, 4, 6)  # (B, C, T, h, w): the tiny K5's 16 latent channels


def latents(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g), torch.tensor([0.3, 0.7])


@pytest.fixture(scope="module")
def k5_predict(tiny_k5: Path):
    """The tiny Kandinsky 5 transformer as a `predict(x_t, sigma)`, text fixed; its parameters require grad."""
    model = Kandinsky5Transformer3DModel.from_pretrained(tiny_k5 / "transformer").requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    text, pooled = torch.randn(2, 5, model.config.in_text_dim, generator=g), torch.randn(2, model.config.in_text_dim2,
                                                                                         generator=g)

    def predict(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        hidden = x.permute(0, 2, 3, 4, 1)  # (B, T, h, w, C)
        hidden = torch.cat([hidden, torch.zeros_like(hidden), torch.zeros(*hidden.shape[:-1], 1)], dim=-1)
        out = model(hidden_states=hidden, encoder_hidden_states=text, pooled_projections=pooled, timestep=sigma * 1000,
                    visual_rope_pos=[torch.arange(3), torch.arange(2), torch.arange(3)], text_rope_pos=torch.arange(5),
                    scale_factor=(1, 1, 1), sparse_params=None, return_dict=False)
        return out.permute(0, 4, 1, 2, 3)

    return predict


def test_off_is_the_input_itself_and_never_calls_the_model() -> None:
    x0, noise, sigma = latents()
    x_t = noisy_sample(x0, noise, sigma)

    def predict(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model ran")

    for probability, offset in ((0.0, 10), (1.0, 0)):
        offsets = draw_offsets(2, torch.Generator().manual_seed(0), probability, offset)
        assert offsets.tolist() == [0, 0]
        assert roll_out(predict, x_t, x0, noise, sigma, offsets) is x_t


def test_one_step_uses_the_models_prediction_without_gradients(k5_predict) -> None:
    """Offset 1 for sample 0: its input is x at sigma + 1/1000 plus -1/1000 times the model's velocity there; sample 1
    (offset 0) keeps its exact x_t; nothing of it is in the autograd graph."""
    x0, noise, sigma = latents()
    x_t = noisy_sample(x0, noise, sigma)
    out = roll_out(k5_predict, x_t, x0, noise, sigma, torch.tensor([1, 0]))
    source = sigma + torch.tensor([1.0, 0.0]) / 1000
    start = noisy_sample(x0, noise, source)
    with torch.no_grad():
        expected = start + (sigma - source).view(-1, 1, 1, 1, 1) * k5_predict(start, source)
    assert not out.requires_grad
    assert torch.equal(out[0], expected[0])
    assert torch.equal(out[1], x_t[1])
    assert not torch.equal(out[0], x_t[0])  # the model is no exact flow: its rollout differs from x_t


def test_euler_on_the_exact_velocity_lands_on_x_t() -> None:
    """The flow path is straight, so Euler steps along noise - x0 end exactly at x_t: only float32 rounding remains,
    at most one U32 of (|x0| + |noise|) per step's add and multiply, plus the two of building the start. A step too
    few or too many is off by 1/1000 of |noise - x0|, about 2^13 times that bound."""
    x0, noise, sigma = latents()
    x_t = noisy_sample(x0, noise, sigma)
    offsets = torch.tensor([7, 4])
    out = roll_out(lambda x, s: noise - x0, x_t, x0, noise, sigma, offsets)
    bound = (2 * 7 + 4) * U32 * (x0.abs() + noise.abs())
    assert ((out - x_t).abs() <= bound).all()
    assert not torch.equal(out, x_t)  # it did step


def test_source_clipped_at_one_and_fixed_frames_stay_clean() -> None:
    x0, noise, _ = latents()
    sigma = torch.tensor([0.995, 0.5])  # 0.995 + 9/1000 > 1: starts at pure noise, fewer steps
    x_t = noisy_sample(x0, noise, sigma)
    x_t[:, :, :1] = x0[:, :, :1]
    calls = []

    def predict(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        calls.append(s.clone())
        return noise - x0

    out = roll_out(predict, x_t, x0, noise, sigma, torch.tensor([9, 3]), fixed_frames=1)
    assert torch.equal(out[:, :, :1], x0[:, :, :1])
    assert calls[0][0].item() == 1.0 and len(calls) == 9
    assert ((out - x_t).abs() <= 24 * U32 * (x0.abs() + noise.abs())).all()


def test_draws_come_from_the_generator_alone() -> None:
    def draw(probability: float, strategy: str = "uniform") -> tuple[list[int], float]:
        g = torch.Generator().manual_seed(5)
        offsets = draw_offsets(64, g, probability, 4, strategy)
        return offsets.tolist(), torch.rand(1, generator=g).item()  # what the next draw sees

    offsets, after = draw(1.0)
    assert draw(1.0) == (offsets, after)
    assert set(offsets) == {0, 1, 2, 3, 4}
    assert draw(0.0) == ([0] * 64, after)  # the same stream consumed, whatever the probability
    half, _ = draw(0.5)
    assert 0 < sum(o == 0 for o in half) - sum(o == 0 for o in offsets) < 64
    early, late = draw(1.0, "biased_early")[0], draw(1.0, "biased_late")[0]
    assert sum(early) < sum(offsets) < sum(late)
    with pytest.raises(ValueError, match="scheduled_sampling_strategy 'unipc'.*uniform, biased_early, biased_late"):
        draw_offsets(2, torch.Generator(), 1.0, 4, "unipc")


def test_probability_ramp() -> None:
    assert rollout_probability(50, 0.3) == 0.3
    ramp = dict(ramp_steps=100, prob_start=0.0, prob_end=0.5, start_step=20)
    assert [rollout_probability(s, 0.3, **ramp) for s in (0, 20, 70, 120, 500)] == [0.0, 0.0, 0.25, 0.5, 0.5]
    cosine = rollout_probability(45, 0.3, shape="cosine", **ramp)
    assert cosine == pytest.approx(0.5 * (0.5 - 0.5 * math.cos(math.pi / 4)), rel=1e-15)
    with pytest.raises(ValueError, match="scheduled_sampling_ramp_shape 'step'.*linear, cosine"):
        rollout_probability(0, 0.3, shape="step")
