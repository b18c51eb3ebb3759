"""The released numbers issue 44 corrected, each against its source (the citation in the flavour or the released
file says where; docs/families.md shows them): Kandinsky 5 Pro's SD and HD attention, sizes and i2v scales, the
sampling defaults, the training shift apart from the render shift, the text lengths, Glyph-ByT5's vocabulary and the
Pro distilled releases. Every row failed on the values loraflow had before (named in each row's comment)."""

from __future__ import annotations

import pytest
import torch

from loraflow.config import parse_config
from loraflow.contracts.renders import render_settings
from loraflow.pipelines import family_spec, get_family, load_family
from loraflow.pipelines.released import released_config
from loraflow.pipelines.sources import model_source
from loraflow.training.batches import step_draws

K5V, K5I = "kandinsky5-video", "kandinsky5-image"


def attention(flavour: str) -> tuple[str, float | None]:
    """(attention_type, P) of the transformer as the flavour runs it: its released config under its mode."""
    config = family_spec(K5V).flavour(flavour).configured(released_config(flavour, "transformer"))
    return config["attention_type"], config["attention_P"]


@pytest.mark.parametrize(("flavour", "expected"), [
    ("t2v-pro-sft-5s-hd", ("nabla", 0.8)),  # was flash: configs/k5_pro_t2v_5s_sft_hd.yaml
    ("t2v-pro-pretrain-5s-hd", ("nabla", 0.8)),  # was flash
    ("i2v-pro-sft-5s", ("nabla", 0.8)),  # was flash: configs/k5_pro_i2v_5s_sft_hd.yaml
    ("t2v-pro-sft-10s-hd", ("nabla", 0.7)),  # was P 0.9: configs/k5_pro_t2v_10s_sft_hd.yaml
    ("t2v-pro-sft-5s-sd", ("flash", None)),  # no SD flavour before: configs/k5_pro_t2v_5s_sft_sd.yaml
    ("t2v-pro-sft-10s-sd", ("nabla", 0.9)),  # configs/k5_pro_t2v_10s_sft_sd.yaml
    ("i2v-pro-sft-5s-sd", ("flash", None)),  # configs/k5_pro_i2v_5s_sft_sd.yaml
    ("t2v-lite-sft-10s", ("nabla", 0.9)),  # unchanged: the Lite 10 s file
])
def test_pro_attention_is_its_modes(flavour: str, expected: tuple) -> None:
    assert attention(flavour) == expected


def test_the_published_pro_5s_config_is_the_hd_one() -> None:
    """The released file itself (what `check` reads before a download): NABLA P 0.8 with windows 11/3/3 (was
    flash)."""
    config = released_config("t2v-pro-sft-5s-hd", "transformer")
    assert {k: config[k] for k in ("attention_type", "attention_P", "attention_wT", "attention_wW", "attention_wH",
                                   "attention_add_sta", "attention_method")} == {
        "attention_type": "nabla", "attention_P": 0.8, "attention_wT": 11, "attention_wW": 3, "attention_wH": 3,
        "attention_add_sta": True, "attention_method": "topcdf"}


@pytest.mark.parametrize(("flavour", "size", "shift", "musubi"), [
    ("t2v-pro-sft-5s-hd", (768, 1280), 10.0, "k5-pro-t2v-5s-hd"),  # was 512x768, shift 5
    ("t2v-pro-sft-10s-hd", (768, 1280), 10.0, "k5-pro-t2v-10s-hd"),  # was 512x768, shift 5
    ("t2v-pro-sft-5s-sd", (512, 768), 10.0, "k5-pro-t2v-5s-sd"),  # no SD flavour before
    ("i2v-pro-sft-5s", (768, 1280), 5.0, "k5-pro-i2v-5s-hd"),  # HD i2v scale 5 (yaml); was 512x768
    ("i2v-pro-sft-5s-sd", (512, 768), 10.0, "k5-pro-i2v-5s-sd"),  # SD i2v scale 10 (yaml)
])
def test_pro_modes_render_at_their_size_and_scale_under_musubis_names(flavour: str, size: tuple, shift: float,
                                                                       musubi: str) -> None:
    spec = family_spec(K5V)
    chosen = spec.flavour(flavour)
    assert (chosen.size, chosen.flow_shift, spec.peer_flavour(musubi)) == (size, shift, flavour)
    assert chosen.training_shift == 5.0  # as before issue 44: runs train as they did


@pytest.mark.parametrize(("family", "flavour", "expected"), [
    # (steps, guidance, render shift, training shift)
    (K5I, "t2i-lite-sft", (50, 3.5, 3.0, 1.0)),  # was (30, 5.0, 1.0, 1.0)
    (K5I, "i2i-lite-pretrain", (50, 3.5, 3.0, 1.0)),  # was (30, 5.0, 1.0, 1.0)
    (K5V, "i2v-lite-5s", (30, 5.0, 10.0, 5.0)),  # render shift was 5: configs/k5_lite_i2v_5s_sft_sd.yaml says 10
    (K5V, "t2v-lite-distilled16steps-5s", (16, 1.0, 5.0, 10.0)),  # render shift was 10: its yaml says 5
    (K5V, "t2v-lite-distilled16steps-10s", (16, 1.0, 10.0, 10.0)),  # unchanged
    (K5V, "t2v-pro-pretrain-10s-hd", (30, 5.0, 10.0, 5.0)),  # render shift was 5: the pipeline's default 10
])
def test_sampling_defaults(family: str, flavour: str, expected: tuple) -> None:
    chosen = family_spec(family).flavour(flavour)
    assert (chosen.steps, chosen.guidance, chosen.flow_shift, chosen.training_shift) == expected


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_the_pro_distilled_releases_are_flavours(task: str) -> None:
    """Kandinsky-5.0-{T2V,I2V}-Pro-distilled-5s-Diffusers (unlisted before): 16 steps, no CFG (FastVideo's presets;
    the original has not released them)."""
    chosen = family_spec(K5V).flavour(f"{task}-pro-distilled-5s")
    assert chosen.repo == f"kandinskylab/Kandinsky-5.0-{task.upper()}-Pro-distilled-5s-Diffusers"
    assert (chosen.steps, chosen.guidance, chosen.task) == (16, 1.0, task)


def image_config(**more: object) -> object:
    dataset = {"id": "images", "instance_data_dir": "unused", "video": {"num_frames": 1}}
    return parse_config({"model_family": K5I, "model_flavour": "t2i-lite-sft",
                         "pretrained_model_name_or_path": "unused", "datasets": [dataset], **more})


def test_training_draws_with_the_training_shift_and_renders_with_the_render_shift() -> None:
    """Kandinsky 5 Image: the seed guide trains at shift 1.0, the release renders at 3.0 (before: one number, 1.0,
    for both). Left unset, `flow_schedule_shift` is the training shift: the sigmas equal those of shift 1.0 set
    explicitly, not those of 3.0."""
    config = image_config()
    family = get_family(config)
    assert render_settings(config, family, model_source(config)).flow_shift == 3.0
    shape = (2, 16, 1, 8, 8)

    def sigmas(shift: float | None) -> torch.Tensor:
        return step_draws(config.model_copy(update={"flow_schedule_shift": shift}), family, 0, shape).sigma

    assert torch.equal(sigmas(None), sigmas(1.0)) and not torch.allclose(sigmas(None), sigmas(3.0))


@pytest.mark.parametrize(("family", "flavour", "tokens"), [
    (K5V, "t2v-lite-sft-5s", 256),  # was 512: every original video config's text_embedder.qwen.max_length
    (K5V, "i2v-pro-sft-5s", 256),  # was 512
    (K5I, "t2i-lite-sft", 512),  # unchanged: configs/k5_lite_t2i_sft_hd.yaml
    (K5I, "i2i-lite-sft", 1024),  # unchanged: diffusers' I2I max_sequence_length
])
def test_text_length(family: str, flavour: str, tokens: int) -> None:
    assert load_family(family, flavour).max_text_tokens == tokens


def test_glyph_byt5_vocabulary_has_the_colour_and_font_tokens() -> None:
    """384 byt5-small ids + HunyuanVideo 1.5's colour and font tokens (was 384)."""
    assert released_config("t2v-480p", "text_encoder_2")["vocab_size"] == 1510
