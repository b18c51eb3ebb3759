"""Renders during training (`validation_steps`) on the tiny real Kandinsky 5 Video, from the two-clip caches
(tests/factory.py `build_caches`).

What is claimed: renders at steps N, 2N.. with the validation settings; the LoRA they show is the one training holds
(the same frames as the validation stage's LoRA render of the exported file); rendering changes no bit of training
(same adapter file, same losses, transformer and RNG states untouched); a resumed run skips rendered steps.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from loraflow.config import ConfigError, parse_config
from loraflow.media.previews import BLOCK_GAP, SHEET_ROW_HEIGHT, TEXT_HEIGHT
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.launch.distributed import World
from loraflow.training.model_setup import load_transformer
from loraflow.training.options.progress_renders import ProgressRenders, progress_sheet_path, rendering, step_folder
from loraflow.training.run import RunContext, current_run_dir, run_dir, upstream_versions
from loraflow.validation import validate as V
from tests.factory import cache_for, capture_renders, demo_dict, make_config, same_lora_file, train

CPU = torch.device("cpu")
RENDERS = {"validation_resolution": "64x48", "validation_num_video_frames": 5, "validation_num_inference_steps": 2,
           "lora_dropout": 0.1}  # dropout: eval mode must switch it off, and training must draw it as always


def decode(path: Path) -> np.ndarray:
    """uint8 (F, H, W, 3) of an mp4, read with PyAV."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_renders_every_n_steps_and_the_same_lora_as_without(own_caches: dict[str, Path], tmp_path: Path) -> None:
    settings = {"max_train_steps": 4, **RENDERS}
    rendered = make_config(own_caches, tmp_path / "rendered", validation_steps=2, **settings)
    plain = make_config(own_caches, tmp_path / "plain", **settings)
    upstream = upstream_versions(Store(plain.cache_dir, plain.manifest_names), plain, get_family(plain))
    assert run_dir(rendered, upstream).name == run_dir(plain, upstream).name  # not part of the run
    with_renders, without = train(rendered), train(plain)
    run = Path(with_renders.run_dir)
    assert same_lora_file(run / T.LORA_FILE, Path(without.lora_path))
    assert [r.loss for r in with_renders.history] == [r.loss for r in without.history]
    assert not (Path(without.run_dir) / "validation").exists()
    folders = sorted(p.name for p in (run / "validation").glob("step-*"))
    assert folders == ["step-0000002", "step-0000004"]
    videos = [decode(step_folder(run / "validation", s) / "00-validation.mp4") for s in (2, 4)]
    assert all(v.shape == (5, 48, 64, 3) for v in videos)
    assert np.abs(videos[0].astype(int) - videos[1]).mean() > 0  # the LoRA evolved between the renders
    sheet = Image.open(progress_sheet_path(run))
    assert sheet.height == TEXT_HEIGHT + 2 * SHEET_ROW_HEIGHT + BLOCK_GAP  # the prompt, then one line per step


@pytest.mark.parametrize("flavour", [{}, {"model_flavour": "i2v-lite-5s", "validation_num_video_frames": 17}],
                         ids=["t2v", "i2v"])
def test_the_last_render_is_what_validation_renders(own_caches: dict[str, Path], tmp_path: Path, flavour: dict,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The frames rendered at the last step equal the validation stage's LoRA render (the diffusers pipeline with
    the exported file at scale 1, same seed; i2v: same first frame); with lora_dropout, only if both run the
    adapter in eval mode. Frames, not mp4s: libx264's threads make the encoded bytes vary with machine load."""
    written = capture_renders(monkeypatch)
    shutil.copytree(own_caches["root"] / "cache", tmp_path / "cache")  # i2v's lists beside t2v's, in a copy
    config = make_config(own_caches, tmp_path / "out", max_train_steps=2, validation_steps=2,
                         cache_dir=str(tmp_path / "cache"), **{**RENDERS, **flavour})
    store = cache_for(config)
    report = train(config)
    V.validate(config, get_family(config), model_source(config), store, report.lora_path)
    (ours,), (base, lora) = written["progress"], written["validation"]  # validation writes base.mp4, then lora.mp4
    # bit for bit by construction: the exported file holds training's fp32 adapter, both renders run it unmerged at
    # scale 1 through the same pipeline call, in this process (same kernels, same thread count)
    assert np.array_equal(ours, lora)
    assert not np.array_equal(ours, base)  # the LoRA shows in the pixels: the comparison means something
    mp4 = decode(step_folder(Path(report.run_dir) / "validation", 2) / "00-validation.mp4")
    assert mp4.shape == ours.shape  # (h264 at this size and noise is far from lossless: no pixel comparison)


@pytest.mark.parametrize("memory", [
    {"enable_group_offload": True, "group_offload_type": "leaf_level", "gradient_checkpointing": True},
    {"base_model_precision": "fp8-layerwise"},
    {"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": -1}]}},
], ids=["offload+checkpointing", "fp8", "tread"])
def test_the_lora_is_the_same_with_renders_under_memory_features(own_caches: dict[str, Path], tmp_path: Path,
                                                                   memory: dict) -> None:
    rendered = train(make_config(own_caches, tmp_path / "a", validation_steps=1, **RENDERS, **memory))
    plain = train(make_config(own_caches, tmp_path / "b", **RENDERS, **memory))
    run = Path(rendered.run_dir)
    assert same_lora_file(run / T.LORA_FILE, Path(plain.lora_path))
    assert decode(step_folder(run / "validation", 2) / "00-validation.mp4").shape == (5, 48, 64, 3)


def test_rendering_leaves_training_as_it_was(own_caches: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(own_caches, tmp_path / "out", validation_steps=1, **RENDERS)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    transformer, params = load_transformer(config, family, model_source(config), CPU)
    for p in params:  # non-zero B: the adapter acts
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    transformer.train()
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    rngs = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    out = tmp_path / "run"
    run = RunContext(config, family, model_source(config), store, {}, out, World(), CPU)
    renders = ProgressRenders(run, transformer)
    renders.after_step(3)
    assert (step_folder(out / "validation", 3) / "result.json").is_file()
    after = transformer.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert all(m.training for m in transformer.modules()) and all(p.grad is None for p in params)
    assert all(p.requires_grad for p in params)
    assert torch.equal(torch.get_rng_state(), rngs[0]) and random.getstate() == rngs[1]
    assert np.array_equal(np.random.get_state()[1], rngs[2])
    with rendering(transformer):  # the context itself: RNG drawn inside, restored after
        torch.rand(3), random.random(), np.random.rand()
        assert not transformer.training
    assert torch.equal(torch.get_rng_state(), rngs[0]) and random.getstate() == rngs[1]


def test_a_resumed_run_renders_only_the_steps_it_has_not(own_caches: dict[str, Path], tmp_path: Path) -> None:
    """Steps 1-4 rendered, the last checkpoint at 2: a run that lost step 4's render and its adapter (as a kill
    between the two would) resumes at 2, renders step 4 again and leaves step 3's files alone."""
    config = make_config(own_caches, tmp_path / "out", max_train_steps=4, validation_steps=1, checkpointing_steps=2,
                         **RENDERS)
    run = Path(train(config).run_dir)
    folder = run / "validation"
    assert sorted(p.name for p in folder.glob("step-*")) == [f"step-000000{s}" for s in (1, 2, 3, 4)]
    kept = {p: p.stat().st_mtime_ns for p in step_folder(folder, 3).iterdir()}
    shutil.rmtree(step_folder(folder, 4))
    (run / T.LORA_FILE).unlink()
    resumed = train(config)
    assert resumed.resumed_at_step == 2
    assert {p: p.stat().st_mtime_ns for p in step_folder(folder, 3).iterdir()} == kept
    assert (step_folder(folder, 4) / "result.json").is_file()
    assert decode(step_folder(folder, 4) / "00-validation.mp4").shape == (5, 48, 64, 3)


def test_two_ranks_render_once_and_the_lora_asset_shows_the_renders(own_caches: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """`accelerate launch` of two CPU ranks under Dagster Pipes: rank 0 renders, rank 1 waits, the asset shows it."""
    from dagster import DagsterInstance, materialize

    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.stages import lora

    config = make_config(own_caches, tmp_path / "two", num_processes=2, max_train_steps=2, validation_steps=1,
                         **RENDERS)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on CPUs, also on a GPU machine
        result = materialize([lora], resources={"loraflow": LoraflowResource(config_path=str(tmp_path / "two.yaml"))},
                             instance=DagsterInstance.ephemeral())
    assert result.success
    (event,) = result.get_asset_materialization_events()
    shown = event.materialization.metadata["renders_during_training"].value
    assert shown.startswith("![first validation prompt, per step](data:image/png;base64,")
    run = current_run_dir(config, get_family(config), Store(config.cache_dir, config.manifest_names))
    assert sorted(p.name for p in (run / "validation").glob("step-*")) == ["step-0000001", "step-0000002"]
    assert not list(run.glob("validation/**/*.tmp*"))  # every write finished (one writer: rank 0)


def test_validation_steps_needs_a_prompt(own_caches: dict[str, Path], tmp_path: Path) -> None:
    data = demo_dict(own_caches["model"], own_caches["data"], tmp_path, validation_steps=5, validation_prompt=None)
    with pytest.raises(ConfigError, match="`validation_steps` 5"):
        parse_config(data)
    with pytest.raises(ConfigError, match="validation_steps"):
        parse_config({**data, "validation_steps": -1})
    assert parse_config({**data, "validation_steps": 0}).validation_steps == 0  # off


@pytest.mark.parametrize("family_name", ["kandinsky5-video", "kandinsky5-image", "hunyuanvideo-1.5"])
def test_the_renderer_wraps_the_given_transformer_without_moving_it(family_name: str, tmp_path: Path) -> None:
    """In-training renders reuse training's transformer: no second copy is loaded, and it stays where it is."""
    from loraflow.demo.tiny import build_tiny
    from loraflow.pipelines.base import load_component

    path = build_tiny(family_name, tmp_path / family_name)
    data = {**demo_dict(path, tmp_path / "data", tmp_path), "model_family": family_name, "model_flavour": None}
    if family_name == "kandinsky5-image":
        data["datasets"][0]["video"] = {"num_frames": 1}  # single frames: what this family trains on
    family = get_family(parse_config(data))
    training = load_component(path, "transformer")
    # "meta" stands in for an accelerator on a CPU-only machine: what is moved there shows it
    pipe = family.load_renderer(str(path), None, torch.device("meta"), transformer=training)
    assert pipe.transformer is training and {p.device.type for p in training.parameters()} == {"cpu"}
    assert {p.device.type for p in pipe.vae.parameters()} == {"meta"}
