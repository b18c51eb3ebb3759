"""CREPA: the loss against a loop-by-loop reference in float64, the projector's gradients, and block capture on the
real tiny Kandinsky 5 and HunyuanVideo 1.5 transformers (tokens map to latent frames and patches as the docs say)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel, Kandinsky5Transformer3DModel

from loraflow.kernels.crepa import (
    CrepaProjector,
    align_teacher,
    capture_block,
    crepa_loss,
    frame_tokens,
    hidden_width,
    load_projector,
    save_projector,
    token_grid,
)
from loraflow.kernels.tread import TokenLayout
from tests.numerics import gamma

K5 = TokenLayout("visual_transformer_blocks", rope_arg=3, rope_token_dim=1)
HV15 = TokenLayout("transformer_blocks", rope_arg=4, rope_token_dim=0, output_index=0)
U64 = 2.0**-53


def reference(projected, teacher, distance, tau, cumulative, normalize) -> float:
    """The formula of the module doc, one cosine at a time."""
    b_count, frames, patches, _ = projected.shape

    def sim(b: int, f: int, g: int) -> float:
        return sum(torch.nn.functional.cosine_similarity(projected[b, f, p], teacher[b, g, p], dim=0).item()
                   for p in range(patches)) / patches

    d = min(distance, frames - 1)
    offsets = list(range(1, d + 1)) if cumulative else ([d] if d else [])
    videos = []
    for b in range(b_count):
        totals = []
        for f in range(frames):
            total = sim(b, f, f)
            for k in offsets:
                total += sum(math.exp(-k / tau) * sim(b, f, g) for g in (f - k, f + k) if 0 <= g < frames)
            totals.append(total)
        videos.append(sum(totals) / (frames if normalize else 1))
    return -sum(videos) / b_count


@pytest.mark.parametrize("distance,tau,cumulative,normalize", [
    (0, 1.0, False, True), (1, 1.0, False, True), (2, 0.5, False, False), (2, 0.5, True, True), (9, 2.0, True, False),
])
def test_loss_matches_the_reference(distance: int, tau: float, cumulative: bool, normalize: bool) -> None:
    """Both sides in float64: they differ by summation order only, at most 2 gamma_n of the sum of |terms| with n the
    products behind one loss (B T^2 P E), each cosine term at most 1 in magnitude (x (1 + 2 sum of weights) <= 5)."""
    g = torch.Generator().manual_seed(0)
    projected, teacher = torch.randn(2, 5, 4, 3, generator=g, dtype=torch.float64), torch.randn(2, 5, 4, 3, generator=g,
                                                                                                dtype=torch.float64)
    terms = crepa_loss(projected, teacher, (5, 2, 2), distance, tau, cumulative, normalize)
    n = 2 * 5 * 5 * 4 * 3
    assert abs(terms.loss.item() - reference(projected, teacher, distance, tau, cumulative, normalize)) <= \
        2 * gamma(n, U64) * 5 * 5 * n
    assert terms.loss.dtype == torch.float64


def test_identical_features_score_the_neighbour_count() -> None:
    """Every token equal to every feature: each cosine is 1, so frame f scores 1 + w per neighbour frame
    (4 frames, distance 1: 2 end frames with one neighbour, 2 with two); exact up to one rounding per term."""
    ones = torch.ones(1, 4, 4, 3)
    w = math.exp(-1 / 0.5)
    terms = crepa_loss(ones, ones, (4, 2, 2), distance=1, tau=0.5)
    assert terms.loss.item() == pytest.approx(-(4 + 6 * w) / 4, rel=2**-20)
    assert terms.self_similarity.item() == pytest.approx(1.0, rel=2**-20)


def test_spatial_align_and_pooling() -> None:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(1, 2, 9, 5, generator=g)  # a 3 x 3 teacher grid
    assert align_teacher(teacher, 3, 3) is teacher
    # 2 x 2 -> 2 x 4, bilinear on patch centres: columns 0, 1 land at 0, 0.25, 0.75, 1 (exact binary fractions)
    ramp = torch.tensor([0.0, 1.0, 0.0, 1.0]).view(1, 1, 4, 1)
    assert align_teacher(ramp, 2, 4).flatten().tolist() == [0.0, 0.25, 0.75, 1.0] * 2
    projected = torch.randn(1, 2, 8, 5, generator=g)
    pooled = crepa_loss(projected, teacher, (2, 2, 4), distance=0, spatial_align=False)
    cosines = torch.nn.functional.cosine_similarity(projected.mean(2), teacher.mean(2), dim=-1)  # (1, 2)
    assert pooled.loss.item() == pytest.approx(-cosines.mean().item(), abs=2**-20)


def test_bad_settings_name_the_key() -> None:
    x = torch.ones(1, 2, 4, 3)
    with pytest.raises(ValueError, match="crepa_adjacent_tau must be > 0; got 0"):
        crepa_loss(x, x, (2, 2, 2), tau=0)
    with pytest.raises(ValueError, match="crepa_adjacent_distance must be >= 0"):
        crepa_loss(x, x, (2, 2, 2), distance=-1)


def test_projector_gets_gradients_and_round_trips(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    projector = CrepaProjector(8, 5)
    hidden, teacher = torch.randn(2, 3 * 4, 8, generator=g), torch.randn(2, 3, 4, 5, generator=g)
    crepa_loss(projector(frame_tokens(hidden, (3, 2, 2))), teacher, (3, 2, 2)).loss.backward()
    for name, p in projector.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0 and torch.isfinite(p.grad).all(), name
    save_projector(projector, tmp_path / "p.safetensors")
    loaded = load_projector(tmp_path / "p.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(projector.state_dict().values(), loaded.state_dict().values()))


@pytest.fixture(scope="module")
def k5(tiny_k5: Path) -> Kandinsky5Transformer3DModel:
    return Kandinsky5Transformer3DModel.from_pretrained(tiny_k5 / "transformer")


@pytest.fixture(scope="module")
def hv15(tmp_path_factory: pytest.TempPathFactory) -> HunyuanVideo15Transformer3DModel:
    from loraflow.demo.tiny import build_tiny

    path = build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("models") / "hv15")
    return HunyuanVideo15Transformer3DModel.from_pretrained(path / "transformer")


def k5_forward(model: Kandinsky5Transformer3DModel, latents: torch.Tensor) -> torch.Tensor:
    """latents (B, 16, T, h, w) through the tiny K5 (visual_cond: zero condition and mask channels)."""
    g = torch.Generator().manual_seed(3)
    b, _, t, h, w = latents.shape
    hidden = latents.permute(0, 2, 3, 4, 1)
    hidden = torch.cat([hidden, torch.zeros_like(hidden), torch.zeros(*hidden.shape[:-1], 1)], dim=-1)
    return model(hidden_states=hidden, encoder_hidden_states=torch.randn(b, 5, model.config.in_text_dim, generator=g),
                 pooled_projections=torch.randn(b, model.config.in_text_dim2, generator=g),
                 timestep=torch.full((b,), 500.0), visual_rope_pos=[torch.arange(t), torch.arange(h // 2),
                                                                    torch.arange(w // 2)],
                 text_rope_pos=torch.arange(5), scale_factor=(1, 1, 1), sparse_params=None, return_dict=False)


def hv15_forward(model: HunyuanVideo15Transformer3DModel, latents: torch.Tensor) -> torch.Tensor:
    """latents (B, 32, T, h, w) through the tiny HunyuanVideo 1.5 (t2v: zero condition, mask and image embeds)."""
    g = torch.Generator().manual_seed(3)
    b, _, t, h, w = latents.shape
    config = model.config
    hidden = torch.cat([latents, torch.zeros(b, config.in_channels - latents.shape[1], t, h, w)], dim=1)
    return model(hidden_states=hidden, timestep=torch.full((b,), 500.0),
                 encoder_hidden_states=torch.randn(b, 7, config.text_embed_dim, generator=g),
                 encoder_attention_mask=torch.ones(b, 7),
                 encoder_hidden_states_2=torch.randn(b, 4, config.text_embed_2_dim, generator=g),
                 encoder_attention_mask_2=torch.ones(b, 4),
                 image_embeds=torch.zeros(b, 729, config.image_embed_dim), return_dict=False)[0]


@pytest.mark.parametrize("name", ["k5", "hv15"])
def test_block_tokens_are_frames_of_patches(name: str, request: pytest.FixtureRequest) -> None:
    """Changing one latent patch (frame 2, patch row 1, column 2) changes, at block 0's input, the token
    frame_tokens puts at [frame 2, 1 * columns + 2] and no other; block N's capture has the grid's token count,
    and a CREPA loss on it alone reaches the transformer's own weights (the LoRA, in training)."""
    model = request.getfixturevalue(name)
    layout, forward, channels = (K5, k5_forward, 16) if name == "k5" else (HV15, hv15_forward, 32)
    latents = torch.randn(1, channels, 3, 4, 6, generator=torch.Generator().manual_seed(4))
    grid = token_grid(model.config, (3, 4, 6))
    ph = 4 // grid[1]
    changed = latents.clone()
    changed[:, :, 2, 1 * ph, 2 * ph] += 1.0
    inputs = []
    handle = getattr(model, layout.blocks)[0].register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        forward(model, latents), forward(model, changed)
    handle.remove()
    moved = (frame_tokens(inputs[1], grid) - frame_tokens(inputs[0], grid)).abs().sum(-1)[0]  # (frames, patches)
    assert moved.nonzero().tolist() == [[2, 1 * grid[2] + 2]]

    model.zero_grad()
    with capture_block(model, layout, 1) as capture:
        forward(model, latents)
    tokens = frame_tokens(capture.hidden, grid)
    assert tokens.shape == (1, grid[0], grid[1] * grid[2], 32)  # both tiny transformers are 32 wide
    assert hidden_width(model.config) == 32  # the projector's input width, read from each family's config
    crepa_loss(tokens, torch.randn(1, 3, 4, tokens.shape[-1]), grid).loss.backward()
    first = next(p for n, p in model.named_parameters() if n.startswith(f"{layout.blocks}.0."))
    assert first.grad is not None and first.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="crepa_block_index 2: this transformer has 2 visual blocks; use one of 0..1"):
        with capture_block(model, layout, 2):
            pass
