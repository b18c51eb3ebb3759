"""The released checkpoints' configs (loraflow/pipelines/released): every flavour has its files, and each config,
built with its real class on the meta device, has the parameter count REFERENCE.md gives for that model."""

from __future__ import annotations

import pytest
import torch

from loraflow.estimates import fake_tensors
from loraflow.estimates.fake_tensors import released_model
from loraflow.pipelines import family_specs, released
from loraflow.pipelines.hunyuanvideo15.spec import SPEC as HV15
from loraflow.pipelines.kandinsky6.spec import SPEC as K6
from loraflow.pipelines.released import CREPA_ENCODER, components, released_file

pytestmark = pytest.mark.released

# REFERENCE.md's figures, in billions, to the digits it gives (DINOv2 ViT-g/14 has none there: its public 1.1B)
PARAMS_B = {
    "k5-video-lite-5s.transformer": 2.01, "k5-video-lite-10s.transformer": 2.01,
    "k5-video-pro-5s.transformer": 19.3, "k5-video-pro-10s.transformer": 19.3,
    "k5-image-t2i.transformer": 6.02, "k5-image-i2i.transformer": 6.02,
    **{f"hv15-{r}-{t}.transformer": 8.33 for r in ("480p", "720p") for t in ("t2v", "i2v")},
    "hv15-480p-i2v-step-distilled.transformer": 8.33,  # + the mean-flow timestep embedder (2 linears, 4.72M)
    "hunyuanvideo.vae": 0.25, "flux.vae": 0.08, "hv15.vae": 1.26,
    "qwen2.5-vl-7b.text_encoder": 8.29, "qwen2.5-vl-7b-text.text_encoder": 7.07, "clip-l.text_encoder_2": 0.12,
    "glyph-byt5.text_encoder_2": 0.22, "siglip-so400m.image_encoder": 0.43, "dinov2-giant.crepa_encoder": 1.1,
    # Kandinsky 6: FastVideo's docs/inference/kandinsky6.md ("Pro (30.1B-parameter DiT) and Lite (3.2B)"; the README's
    # 29B and 3B round down); the π-Flow heads add 3.4M (Lite) and 3.1M (Pro); BigVGAN-v2's 122M (NVIDIA/BigVGAN's
    # model table). No public figure for the MMAudio VAE: its config's count, pinned so an edit shows
    "k6-lite.transformer": 3.2, "k6-lite-distill.transformer": 3.2, "k6-pro.transformer": 30.1,
    "k6-pro-distill.transformer": 30.1, "k6.vocoder": 0.12, "k6.audio_vae": 0.31, "k6-distill.audio_vae": 0.31,
}
FILES = sorted(p.stem for p in released.FOLDER.glob("*.json"))


def test_every_flavour_has_its_components() -> None:
    flavours = {f.name for spec in family_specs() for f in spec.flavours}
    assert set(released.FLAVOURS) == flavours, flavours ^ set(released.FLAVOURS)
    siglip = {f.name for f in HV15.flavours if f.task == "i2v"}  # HunyuanVideo 1.5 i2v's image stream
    sound = {f.name for f in K6.flavours}  # Kandinsky 6's audio VAE and vocoder
    for name in released.FLAVOURS:
        common = {"transformer", "vae", "text_encoder", "text_encoder_2", CREPA_ENCODER}
        assert set(components(name)) == (common | ({"image_encoder"} if name in siglip else set())
                                          | ({"audio_vae", "vocoder"} if name in sound else set()))
        for component in components(name):
            source = released_file(name, component)["source"]
            assert source["repo_id"] and source["file"].endswith("config.json") and source["values"]  # test_citations
    # by repository id too, as `estimates` will ask
    assert released_file("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v", "transformer") == \
        released_file("i2v-720p", "transformer")
    assert FILES == sorted(PARAMS_B)  # every file is used by some flavour and checked below


@pytest.mark.parametrize("stem", FILES)
def test_parameter_count_matches_reference(stem: str) -> None:
    name, component = stem.rsplit(".", 1)
    flavour = next(f for f, parts in released.FLAVOURS.items()
                   if parts.get(component) == name or component == CREPA_ENCODER)
    # The audio VAE under fake tensors, not on the meta device: once a pipeline has loaded in the process (the suite's
    # order), torch.linspace(..., dtype=...) under torch.device("meta") returns a CPU tensor, which MMAudioVAE's mel
    # filterbank then mixes with meta ones. (Fake tensors for every file: 40 s more.)
    with fake_tensors.fake_mode() if component == "audio_vae" else torch.device("meta"):
        model = released_model(flavour, component)
    count = sum(p.numel() for p in model.parameters()) / 1e9
    digits = len(str(PARAMS_B[stem]).split(".")[1])
    assert round(count, digits) == PARAMS_B[stem], f"{stem}: {count:.4f}B parameters"


def test_known_values_answers_from_the_callers_tensors() -> None:
    """Under fake tensors, `known_values` answers what HV1.5's forward asks from the real inputs and factories (a
    scalar read, a boolean mask's selection, through `.bool()`, `~` and row iteration), and nothing else: a value
    computed from a fake weight still raises."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # the caller's: 3 valid tokens
    with fake_tensors.fake_mode(), fake_tensors.known_values():
        tokens = torch.empty(1, 4, 8)  # fake, values unknown
        assert bool(torch.all(torch.zeros(1, 4) == 0)) and not bool(torch.all(mask == 0))
        for row, row_mask in zip(tokens, mask.bool()):
            assert row[row_mask].shape == (3, 8) and row[~row_mask].shape == (1, 8)
            assert row_mask[row_mask].shape == (3,)
        written = torch.zeros(4)
        written[:2] = tokens[0, :2, 0]  # an unknown value written: the tensor is no longer known
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            tokens[0, written > 0]
        with pytest.raises(DataDependentOutputException):
            bool(torch.all(tokens == 0))
