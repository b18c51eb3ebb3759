"""The seed guides' training features (issue 19) through the Dagster `lora` asset on the tiny default: each changes
the LoRA when on, leaves it bit-identical when off, and a run with scheduled sampling and CREPA resumes exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dagster import DagsterInstance, materialize
from safetensors.torch import load_file

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import lora, teacher_features
from loraflow.demo.tiny import tiny_dinov2
from loraflow.kernels.crepa import PROJECTOR_FILE
from loraflow.pipelines.sources import model_source
from loraflow.training import loop as T
from tests.factory import make_config

# biased_late: long rollouts; seed 42 draws offsets 8, 8, 7, 8 for micro-steps 0-3 (uniform drew 0 for both of the
# first two, which would train exactly like no rollout)
ROLLOUT = {"scheduled_sampling_max_step_offset": 8, "scheduled_sampling_probability": 1.0,
           "scheduled_sampling_strategy": "biased_late"}


@pytest.fixture(scope="module")
def guide_caches(own_caches: dict[str, Path]) -> dict[str, Path]:
    """The module's two-clip caches and a tiny DINOv2 teacher beside them ("teacher")."""
    return {**own_caches, "teacher": tiny_dinov2(own_caches["root"] / "dinov2")}


def crepa(guide_caches: dict[str, Path], **more) -> dict:
    return {"crepa_enabled": True, "crepa_block_index": 1, "crepa_encoder_path": str(guide_caches["teacher"]),
            "crepa_encoder_image_size": 16, **more}


def through_asset(guide_caches: dict[str, Path], name: str, **overrides) -> tuple[dict[str, torch.Tensor], dict]:
    """Materialize `teacher_features` and `lora` (the other caches are built) for a config with `overrides`: the
    adapter, and the metadata of lora with teacher_features' under "teacher_features"."""
    make_config(guide_caches, guide_caches["root"] / name, **overrides)
    config_path = str(guide_caches["root"] / f"{name}.yaml")
    result = materialize([teacher_features, lora], instance=DagsterInstance.ephemeral(),
                         resources={"loraflow": LoraflowResource(config_path=config_path)})
    assert result.success
    teacher, trained = ({k: v.value for k, v in e.materialization.metadata.items()}
                        for e in result.get_asset_materialization_events())
    return load_file(trained["lora_path"]), {**trained, "teacher_features": teacher}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def plain(guide_caches: dict[str, Path]) -> tuple[dict[str, torch.Tensor], dict]:
    return through_asset(guide_caches, "plain")


def test_features_off_leave_the_lora_bit_identical(guide_caches: dict[str, Path], plain) -> None:
    off = {"optimizer": "adamw", "report_to": "none", "scheduled_sampling_max_step_offset": 3,
           "scheduled_sampling_probability": 0.0, "crepa_lambda": 0.25}
    adapter, meta = through_asset(guide_caches, "off", **off)
    assert same(adapter, plain[0])
    assert meta["teacher_features"]["crepa_enabled"] is False and meta["teacher_features"]["computed"] == 0
    assert not (Path(meta["lora_path"]).parent / "tensorboard").exists()  # report_to: none
    assert (Path(plain[1]["lora_path"]).parent / "tensorboard").is_dir()  # the default writes TensorBoard as before


@pytest.mark.parametrize("name, overrides", [
    ("adamw_bf16", {"optimizer": "adamw_bf16"}),
    ("int8", {"base_model_precision": "int8-torchao"}),
    ("rollout", ROLLOUT),
])
def test_each_feature_changes_the_lora(guide_caches: dict[str, Path], plain, name: str, overrides: dict) -> None:
    adapter, _ = through_asset(guide_caches, name, **overrides)
    assert adapter.keys() == plain[0].keys() and not same(adapter, plain[0])


def test_crepa_trains_a_projector_and_logs_its_term_apart(guide_caches: dict[str, Path], plain) -> None:
    adapter, meta = through_asset(guide_caches, "crepa", **crepa(guide_caches))
    assert adapter.keys() == plain[0].keys() and not same(adapter, plain[0])
    run = Path(meta["lora_path"]).parent
    assert set(meta["inputs"]) == {"latents", "text_embeds", "teacher_features"}
    assert meta["teacher_features"]["computed"] == 3 and meta["teacher_features"]["image_size"] == 16  # 3 clips
    assert set(load_file(run / PROJECTOR_FILE)) == {"norm.weight", "norm.bias", "linear.weight", "linear.bias"}
    history = json.loads((run / "history.json").read_text())
    # lambda x minus a cosine alignment summed over 1 + 2 exp(-1) frames' weights: |term| <= 0.5 x 1.74
    assert all(0 < abs(row["crepa_loss"]) <= 0.5 * (1 + 2 * math.exp(-1)) for row in history)
    plain_history = json.loads((Path(plain[1]["lora_path"]).parent / "history.json").read_text())
    assert history[0]["loss"] == plain_history[0]["loss"]  # step 1: same weights, same flow loss, the term apart
    assert "crepa_loss" not in plain_history[0]
    # lambda 0: the term adds exact zeros to the LoRA's gradients, and only the projector moves
    zero, _ = through_asset(guide_caches, "crepa0", **crepa(guide_caches, crepa_lambda=0.0))
    assert same(zero, plain[0])


def test_rollout_and_crepa_resume_exactly(guide_caches: dict[str, Path]) -> None:
    """A finished run with its adapter and projector removed resumes from the step-2 checkpoint and recomputes steps
    3-4: the same bits, so every draw of scheduled sampling (a ramped probability) and the projector come back from
    the seed and the checkpoint."""
    settings = {**ROLLOUT, "scheduled_sampling_ramp_steps": 4, "scheduled_sampling_prob_start": 0.0,
                **crepa(guide_caches), "max_train_steps": 4, "checkpointing_steps": 2, "checkpoints_total_limit": None}
    config = make_config(guide_caches, guide_caches["root"] / "resume" / "out", **settings)
    first = T.train_lora(config, _family(config), model_source(config), _store(config))
    run = Path(first.run_dir)
    whole, projector = load_file(run / T.LORA_FILE), load_file(run / PROJECTOR_FILE)
    (run / T.LORA_FILE).unlink()
    (run / PROJECTOR_FILE).unlink()  # else the resumed run's projector would be compared with the first run's file
    resumed = T.train_lora(config, _family(config), model_source(config), _store(config))
    assert resumed.resumed_at_step == 2 and resumed.computed == 2
    assert same(load_file(run / T.LORA_FILE), whole) and same(load_file(run / PROJECTOR_FILE), projector)
    assert [r.crepa_loss for r in resumed.history] == [r.crepa_loss for r in first.history]


def _family(config):
    from loraflow.pipelines import get_family

    return get_family(config)


def _store(config):
    from loraflow.store import Store

    return Store(config.cache_dir, config.manifest_names)


def test_report_to_wandb_offline_logs_the_crepa_term_and_trains_the_same(guide_caches: dict[str, Path], plain,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network in tests
    monkeypatch.setenv("WANDB_SILENT", "true")
    adapter, meta = through_asset(guide_caches, "wandb", report_to="wandb", **crepa(guide_caches))
    run = Path(meta["lora_path"]).parent
    (records,) = (run / "wandb").glob(f"offline-run-*-{run.name}/run-{run.name}.wandb")
    assert b"train/crepa_loss" in records.read_bytes() and b"train/loss" in records.read_bytes()
    crepa_only, _ = through_asset(guide_caches, "crepa-tb", **crepa(guide_caches))  # report_to changes no number
    assert same(adapter, crepa_only)
