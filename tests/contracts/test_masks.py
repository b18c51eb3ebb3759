"""Masked loss through clips -> latents -> lora on the tiny real Kandinsky 5 Video (contracts/masks.py), from the
two-clip dataset of test_train with a `conditioning_type: mask` dataset of PNG masks beside it.

What is claimed: an all-white mask trains the same LoRA bits as no mask (the masks only enter the data versions);
a half mask caches as ones and zeros on the latent grid, changes the LoRA, and the loss's gradient is exactly zero on
the masked-out latents; masked_loss_probability 0 is the unmasked LoRA again, and a masked run resumes bit for bit;
a file without its mask is quarantined, never trained on unmasked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from loraflow.config import ConfigError, LoraflowConfig, parse_config
from loraflow.contracts.masks import MASK_COLUMN, masked_loss_metadata
from loraflow.kernels.flow_matching import flow_mse, noisy_sample
from loraflow.media.frames import probe
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.simpletuner import import_simpletuner
from loraflow.stages.clips.clips import build_clips
from loraflow.store import Store
from loraflow.training import batches as D
from loraflow.training import loop as T
from loraflow.training.model_setup import load_transformer
from tests.factory import cache_for, demo_dict, make_config, same_lora_file, train
from tests.numerics import U32, gamma

CPU = torch.device("cpu")


def masked(own_caches: dict[str, Path], output: Path, half: bool, **overrides: Any) -> LoraflowConfig:
    """The caches' dataset with a mask per video (white; `half`: the right half black), cached in the same store:
    `use` switches its manifests (the text embeddings are the same), every clip and latent stays cached."""
    masks = own_caches["root"] / ("half" if half else "white")
    masks.mkdir(exist_ok=True)
    for video in sorted(own_caches["data"].glob("*.mp4")):
        info = probe(video)
        pixels = np.full((info.height, info.width, 3), 255, np.uint8)
        if half:
            pixels[:, info.width // 2:] = 0
        Image.fromarray(pixels).save(masks / f"{video.stem}.png")
    datasets = demo_dict(own_caches["model"], own_caches["data"], own_caches["root"])["datasets"]
    datasets[0]["conditioning_data"] = "masks"
    datasets.append({"id": "masks", "dataset_type": "conditioning", "conditioning_type": "mask",
                     "instance_data_dir": str(masks)})
    return use(make_config(own_caches, output, datasets=datasets, **{"max_train_steps": 1, **overrides}))


def use(config: LoraflowConfig) -> LoraflowConfig:
    """The config's lists cached beside the others (encoding what the store lacks)."""
    cache_for(config)
    return config


@pytest.fixture(scope="module")
def unmasked(own_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> T.LoraReport:
    return train(use(make_config(own_caches, tmp_path_factory.mktemp("unmasked") / "out", max_train_steps=1)))


def test_an_all_white_mask_trains_the_unmasked_lora(own_caches: dict[str, Path], unmasked: T.LoraReport,
                                                     tmp_path: Path) -> None:
    config = masked(own_caches, tmp_path / "masked", half=False)
    ours = train(config)
    assert ours.inputs["latents"] != unmasked.inputs["latents"]  # the masks are in the latents' data version
    assert same_lora_file(Path(ours.lora_path), Path(unmasked.lora_path))
    assert [r.loss for r in ours.history] == [r.loss for r in unmasked.history]
    assert "masks on dataset(s) demo-videos" in masked_loss_metadata(config)["masked_loss"]
    assert masked_loss_metadata(make_config(own_caches, tmp_path / "plain")) == {}
    (own_caches["root"] / "white" / "clip_02.png").unlink()  # a file without its mask: quarantined, with the reason
    store = Store(config.cache_dir, config.manifest_names)
    report = build_clips(config, get_family(config), model_source(config), store)
    assert [(Path(q.file).name, q.reason) for q in report.quarantined] == [("clip_02.mp4", "missing_mask")]


def test_a_half_mask_zeroes_the_gradient_of_masked_out_latents(own_caches: dict[str, Path], tmp_path: Path) -> None:
    half = masked(own_caches, tmp_path / "half", half=True)
    store, family = Store(half.cache_dir, half.manifest_names), get_family(half)
    rows = store.get("latents", {r["key"] for r in store.read_manifest("latents")})
    for row in rows.values():  # area averages: whole cells on each side are exactly 1 and 0
        mask = np.asarray(row[MASK_COLUMN])  # (1, 1, h, w)
        w = mask.shape[-1]
        assert mask.shape[-2:] == np.asarray(row["latent"]).shape[-2:]
        assert (mask[..., : w // 2 - 1] == 1).all() and (mask[..., w // 2 + 1:] == 0).all()
    batch = D.load_micro_batch(half, family, store, D.build_samples(half, store)[:1], 0)
    transformer, _ = load_transformer(half, family, model_source(half), CPU)
    x_t = noisy_sample(batch.x0, batch.draws.noise, batch.draws.sigma, family.flavour.conditioning_frames)
    prediction = family.velocity(transformer, x_t, batch.draws.sigma, batch.text).detach().requires_grad_(True)
    loss = flow_mse(prediction, batch.x0, batch.draws.noise, family.flavour.conditioning_frames, mask=batch.mask)
    loss.backward()
    weights = batch.mask.expand_as(prediction)
    assert (prediction.grad[weights == 0] == 0).all() and (prediction.grad[weights == 1] != 0).all()
    # normalised by the mask's mean: the kept cells' plain MSE. Both sides weigh the same elements by the same ops;
    # each then sums two sets of n non-negative fp32 terms (relative error <= gamma_n each, in any order) and divides
    # up to three times (u each): within 2 gamma_n + 3u of the exact ratio, so the two within twice that.
    error = (prediction - (batch.draws.noise - batch.x0)).detach() ** 2
    expected = ((error * weights).sum() / weights.sum()).item()
    rounding = (4 * gamma(prediction.numel(), U32) + 6 * U32) * expected
    assert abs(loss.item() - expected) <= rounding
    unmasked = flow_mse(prediction, batch.x0, batch.draws.noise, family.flavour.conditioning_frames)
    assert abs(loss.item() - unmasked.item()) > 2 * rounding  # not the unmasked loss, whatever the rounding


def test_a_half_mask_changes_the_lora_probability_0_does_not_and_a_resume_is_exact(
        own_caches: dict[str, Path], unmasked: T.LoraReport, tmp_path: Path) -> None:
    half = masked(own_caches, tmp_path / "half", half=True)
    run = lambda name, **overrides: train(half.model_copy(update={"output_dir": str(tmp_path / name),  # noqa: E731
                                                                  **overrides}))
    assert not same_lora_file(Path(run("half").lora_path), Path(unmasked.lora_path))
    never = run("never", masked_loss_probability=0.0)
    assert same_lora_file(Path(never.lora_path), Path(unmasked.lora_path))  # every micro-step's draw skips the masks
    # 0.25: with seed 42 micro-step 0 skips the masks and 1 applies them (each from its own generator)
    sometimes = half.model_copy(update={"masked_loss_probability": 0.25, "max_train_steps": 2,
                                        "checkpointing_steps": 1, "output_dir": str(tmp_path / "sometimes")})
    store, family = Store(half.cache_dir, half.manifest_names), get_family(half)
    samples = D.build_samples(half, store)[:1]
    assert [D.load_micro_batch(sometimes, family, store, samples, k).mask is None for k in range(2)] == [True, False]
    whole = train(sometimes)
    kept = tmp_path / "whole.safetensors"
    shutil.copy(whole.lora_path, kept)
    Path(whole.lora_path).unlink()  # killed after its step-1 checkpoint, as far as the run can tell
    resumed = train(sometimes)
    assert resumed.resumed_at_step == 1 and same_lora_file(Path(resumed.lora_path), kept)


def test_mask_datasets_are_checked_and_imported_under_simpletuners_names(tmp_path: Path) -> None:
    data = demo_dict(tmp_path / "model", tmp_path / "videos", tmp_path)
    masks = {"id": "masks", "dataset_type": "conditioning", "conditioning_type": "mask",
             "instance_data_dir": str(tmp_path / "masks")}
    with pytest.raises(ConfigError, match="`conditioning_type` goes on a `dataset_type: conditioning`"):
        parse_config({**data, "datasets": [{**data["datasets"][0], "conditioning_type": "mask"}]})
    sources = {k: v for k, v in masks.items() if k != "conditioning_type"}
    with pytest.raises(ConfigError, match="or give the conditioning dataset `conditioning_type: mask`"):
        parse_config({**data, "datasets": [{**data["datasets"][0], "conditioning_data": "masks"}, sources]})
    backend = [{"id": "videos", "type": "local", "dataset_type": "video", "instance_data_dir": str(tmp_path / "v"),
                "conditioning_data": "masks"},
               {**masks, "type": "local"},
               {"id": "seg", "type": "local", "dataset_type": "conditioning", "conditioning_type": "segmentation",
                "instance_data_dir": str(tmp_path / "seg")}]
    imported = import_simpletuner({"model_family": "kandinsky5-video", "masked_loss_probability": 0.25}, backend)
    assert imported.config["datasets"][0]["conditioning_data"] == "masks"
    assert [(k, v) for k, v, _ in imported.unmapped] == [("datasets[2].conditioning_type", "segmentation")]
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    assert config.masked_loss_probability == 0.25
    assert config.source_images(config.training_datasets[0]).conditioning_type == "mask"
