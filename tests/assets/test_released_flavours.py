"""Issue 33's flavours through the whole DAG (`materialize_everything`: clips, latents, text_embeds, lora, validation)
on their tiny checkpoints, validated with their released sampling defaults (no validation_* sampling key set).

The distilled flavours differ from their base in two ways a tiny run can see: validation renders with the release's
step count and guidance 1.0 (no negative pass), and HunyuanVideo 1.5 step-distilled is a mean-flow transformer that
training must call with the interval's end (`timestep_r`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dagster import DagsterInstance

from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.config import load_config
from loraflow.contracts.renders import render_settings
from loraflow.pipelines import load_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.sources import model_source
from tests.factory import demo_dict, write_config

HV = "hunyuanvideo-1.5"
# (family, flavour, validation_resolution, more keys): one run per distinct tiny checkpoint (the other new flavours
# differ from these only in their sampling defaults, checked without rendering below; the Kandinsky 5 distilled and
# no-CFG transformers have the Lite config, whose DAG tests/assets/test_dag.py runs, and validation reads the
# defaults through the same render_settings as these runs); the i2v one mixes in t2v batches (`i2v_prob` 0.3 trains
# micro-step 0 as t2v, 1 as i2v: tests/pipelines/test_hv_i2v.py)
RUNS = [(HV, "t2v-480p-distilled", "64x48", {}), (HV, "i2v-480p-step-distilled", "64x48", {"i2v_prob": 0.3}),
        # Kandinsky 6's π-Flow head, its tail frame and PiflowScheduler through the DAG (issue 46)
        ("kandinsky6", "lite-distill-i2v", "64x48", {"i2v_prob": 0.3})]
NEW = {"kandinsky5-video": ("t2v-lite-nocfg-5s", "t2v-lite-nocfg-10s", "t2v-lite-distilled16steps-5s",
                            "t2v-lite-distilled16steps-10s", "t2v-pro-distilled-5s", "i2v-pro-distilled-5s"),
       HV: ("t2v-480p-distilled", "i2v-480p-distilled", "i2v-480p-step-distilled", "i2v-720p-distilled"),
       "kandinsky6": ("lite-distill-t2v", "pro-distill-i2v")}
# the releases' (steps, guidance, shift): each flavour's citations say where each number is from
RELEASED = {"t2v-lite-nocfg-5s": (50, 1.0, 10.0), "t2v-lite-nocfg-10s": (50, 1.0, 10.0),
            "t2v-lite-distilled16steps-5s": (16, 1.0, 5.0), "t2v-lite-distilled16steps-10s": (16, 1.0, 10.0),
            "t2v-pro-distilled-5s": (16, 1.0, 5.0), "i2v-pro-distilled-5s": (16, 1.0, 5.0),
            "t2v-480p-distilled": (50, 1.0, 5.0), "i2v-480p-distilled": (50, 1.0, 5.0),
            "i2v-480p-step-distilled": (12, 1.0, 7.0), "i2v-720p-distilled": (50, 1.0, 7.0),
            "lite-distill-t2v": (10, 1.0, 5.0), "pro-distill-i2v": (10, 1.0, 5.0)}


@pytest.mark.parametrize("family, flavour", [(f, n) for f, names in NEW.items() for n in names])
def test_validation_renders_with_the_releases_sampling_unless_the_config_says(family: str, flavour: str,
                                                                                tmp_path: Path) -> None:
    """No checkpoint here (its scheduler config would win for the shift): the flavour's own defaults."""
    config = demo_dict(tmp_path / "absent", tmp_path / "data", tmp_path, model_family=family, model_flavour=flavour,
                       # NABLA's 128s: the 10 s ones, and the Pro distilled (the Pro 5 s file until downloaded)
                       validation_resolution="256x128" if flavour.endswith("10s") or "-pro-" in flavour else "64x48")
    del config["validation_num_inference_steps"], config["validation_guidance"]
    loaded = load_config(write_config(tmp_path / "config.yaml", config))
    settings = render_settings(loaded, load_family(family, flavour), model_source(loaded))
    assert (settings.num_inference_steps, settings.guidance, settings.flow_shift) == RELEASED[flavour]
    chosen = loaded.model_copy(update={"validation_num_inference_steps": 3, "validation_guidance": 4.0})
    assert (render_settings(chosen, load_family(family, flavour), model_source(chosen)).num_inference_steps,
            render_settings(chosen, load_family(family, flavour), model_source(chosen)).guidance) == (3, 4.0)


@pytest.fixture(scope="module")
def data(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two of the demo's clips (one bucket each): enough for a run, half the caching of the whole demo."""
    data = tmp_path_factory.mktemp("flavour-data")
    for stem in ("clip_00", "clip_02"):
        for ext in (".mp4", ".txt"):
            shutil.copy(demo_data / f"{stem}{ext}", data / f"{stem}{ext}")
    return data


def tiny_model(family: str, flavour: str, root: Path) -> Path:
    from loraflow.demo.tiny import build_tiny

    return build_tiny(family, root / "models" / flavour, flavour=flavour)


@pytest.mark.parametrize("family, flavour, size, more", RUNS, ids=[r[1] for r in RUNS])
def test_a_released_flavour_runs_the_whole_dag(family: str, flavour: str, size: str, more: dict, data: Path,
                                               tmp_path: Path) -> None:
    """Two render steps (the releases' 12-50 cost minutes on the tiny models); guidance left to the flavour: 1.0."""
    config = demo_dict(tiny_model(family, flavour, tmp_path), data, tmp_path, model_family=family,
                       model_flavour=flavour, max_train_steps=2, checkpointing_steps=100, validation_resolution=size,
                       validation_num_inference_steps=2, **more)
    del config["validation_guidance"]
    resource = LoraflowResource(config_path=str(write_config(tmp_path / "config.yaml", config)))
    results = materialize_everything(resource, DagsterInstance.ephemeral())
    assert all(r.success for r in results)
    (validation,) = [e for e in results[-1].get_asset_materialization_events() if e.asset_key.path == ["validation"]]
    assert validation.materialization.metadata["prompts"].value == 1
    settings = json.loads(next((tmp_path / "output" / "validation").glob("*/results.json")).read_text())["settings"]
    assert (settings["num_inference_steps"], settings["guidance"]) == (2, 1.0)


def test_step_distilled_training_gives_the_transformer_the_interval_end(tmp_path: Path) -> None:
    """Mean flow: `velocity` passes timestep_r = timestep (the empty interval, whose average velocity is the
    instantaneous one training targets); without it the transformer leaves out its second timestep embedder and
    predicts something else."""
    from loraflow.demo.tiny import build_tiny

    flavour = "i2v-480p-step-distilled"
    model = build_tiny(HV, tmp_path / "model", flavour=flavour)
    transformer = load_component(model, "transformer")
    assert transformer.config.use_meanflow
    family = load_family(HV, flavour)
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 32, 2, 3, 4, generator=generator)
    sigma = torch.tensor([0.6])
    text = {"text_embeds": torch.randn(1, 5, transformer.config.text_embed_dim, generator=generator),
            "text_mask": torch.ones(1, 5), "byt5_embeds": torch.randn(1, 3, transformer.config.text_embed_2_dim,
                                                                     generator=generator),
            "byt5_mask": torch.ones(1, 3), "image_latent": torch.randn(1, 32, 1, 3, 4, generator=generator),
            "image_embeds": torch.randn(1, 729, transformer.config.image_embed_dim, generator=generator)}
    with torch.no_grad():
        got = family.velocity(transformer, noisy, sigma, text)
        cond, mask, image_embeds = family._condition(transformer, noisy, text)
        call = {"hidden_states": torch.cat([noisy, cond, mask], 1), "image_embeds": image_embeds,
                "timestep": sigma * 1000, "encoder_hidden_states": text["text_embeds"],
                "encoder_attention_mask": text["text_mask"], "encoder_hidden_states_2": text["byt5_embeds"],
                "encoder_attention_mask_2": text["byt5_mask"], "return_dict": False}
        interval = transformer(**call, timestep_r=sigma * 1000)[0]
        instant = transformer(**call)[0]
    assert torch.equal(got, interval.float())
    assert not torch.allclose(interval, instant)
