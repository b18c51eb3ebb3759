"""The whole DAG in-process on the tiny default, then again: the second pass reuses every cached item.

A pass is what `loraflow demo` runs: a `cache_dataset` run per dataset partition, then `train_and_validate`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dagster import DagsterInstance

from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.cli import demo_summary
from tests.factory import REPO, demo_dict, write_config


def events(results, asset: str) -> list:
    return [e for r in results for e in r.get_asset_materialization_events() if e.asset_key.path[-1] == asset]


def metadata(results, asset: str) -> dict:
    (event,) = events(results, asset)
    return {k: v.value for k, v in event.materialization.metadata.items()}


@pytest.fixture(scope="module")
def dag_run(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("dag")
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, demo_data, root, max_train_steps=6,
                                                          checkpointing_steps=3))
    resource = LoraflowResource(config_path=str(config))
    instance = DagsterInstance.ephemeral()
    first = materialize_everything(resource, instance)
    second = materialize_everything(resource, instance)
    return first, second, root


def test_every_stage_materializes_with_metadata(dag_run) -> None:
    first, _, root = dag_run
    assert [r.success for r in first] == [True, True]  # cache_dataset for demo-videos, then train_and_validate
    assert [e.partition for e in events(first, "clips") + events(first, "latents")] == ["demo-videos"] * 2
    assert [e.partition for e in events(first, "lora")] == [None]
    clips = metadata(first, "clips")
    assert clips["computed"] >= 5 and clips["quarantined"] == 0 and clips["dataset"] == "demo-videos"
    assert "data:image/png;base64," in clips["preview"]
    latents = metadata(first, "latents")
    assert latents["computed"] == clips["computed"]
    lora = metadata(first, "lora")
    assert Path(lora["lora_path"]).is_file() and np.isfinite(lora["final_loss"])
    assert (lora["optimizer"], lora["loss_type"]) == ("adamw", "l2")  # what trained it (issue 32)
    # the estimate beside the measured peak (tests/estimates/ compares them): tiny models, well under 1 GiB
    for meta, parts in ((latents, {"weights", "activations"}), (lora, {"weights", "lora", "optimizer", "activations"})):
        assert 0 < meta["est_peak_gib"] < 1 and set(meta["est_peak_parts_gib"]) == parts
    validation = metadata(first, "validation")
    assert Path(validation["video"]).is_file() and "data:image/png;base64," in validation["preview"]
    assert validation["num_frames"] == 9 and (validation["height"], validation["width"]) == (64, 96)


def test_checks_of_a_dataset_are_recorded_for_its_partition(dag_run) -> None:
    first, _, _ = dag_run  # a pass of another dataset must not replace this one's results (they are per partition)
    evaluations = {(e.asset_check_key.name, e.partition)
                   for r in first for e in r.get_asset_check_evaluations()}
    assert {("latents_shape_and_finite", "demo-videos"), ("latents_cover_clips", "demo-videos"),
            ("captions_not_empty", "demo-videos"), ("text_embeds_cover_captions", None)} <= evaluations


def test_validation_is_downstream_of_the_prompt_embeddings_not_only_of_the_lora() -> None:
    from dagster import AssetKey

    from loraflow.assets.stages import validation

    assert {AssetKey("lora"), AssetKey("text_embeds")} <= set(validation.dependency_keys)


def test_second_materialization_reuses_every_item(dag_run) -> None:
    first, second, _ = dag_run
    assert all(r.success for r in second)
    for asset in ("clips", "latents", "text_embeds", "lora", "validation"):
        meta = metadata(second, asset)
        assert meta["computed"] == 0 and meta["status"].startswith("cached"), asset
    for asset in ("clips", "latents", "text_embeds"):  # item stages: everything the first run made is reused
        assert metadata(second, asset)["reused"] == metadata(first, asset)["computed"], asset
    versions = {e.asset_key.path[-1]: e.materialization.tags.get("dagster/data_version")
                for r in first for e in r.get_asset_materialization_events()}
    again = {e.asset_key.path[-1]: e.materialization.tags.get("dagster/data_version")
             for r in second for e in r.get_asset_materialization_events()}
    assert len(versions) == 6 and versions == again  # content unchanged -> data versions unchanged
    assert versions["teacher_features"] == "off"  # CREPA off: nothing cached, one version
    summary = demo_summary(second)  # what `loraflow demo` prints
    stages = [line.split()[0] for line in summary[:6]]  # text_embeds and teacher_features: either order (no edge)
    assert stages[:2] == ["clips[demo-videos]", "latents[demo-videos]"] and stages[4:] == ["lora", "validation"]
    assert sorted(stages[2:4]) == ["teacher_features", "text_embeds"]
    assert all("computed 0," in line for line in summary[:6])
    # the run folder holds the three LoRA files: the diffusers one, the ComfyUI and musubi-tuner ones beside it (the
    # default)
    lora_file, comfyui_file, musubi_file = (Path(line.split(": ", 1)[1]) for line in summary[6:9])
    assert [line.split(": ")[0] for line in summary[6:9]] == ["lora_path", "comfyui_lora_path", "musubi_lora_path"]
    assert lora_file.is_file() and comfyui_file == lora_file.with_name("pytorch_lora_weights_comfyui.safetensors")
    assert musubi_file == lora_file.with_name("pytorch_lora_weights_musubi.safetensors") and musubi_file.is_file()
    assert comfyui_file.is_file() and summary[9].startswith("video: ")
    assert Path(summary[10].removeprefix("contact_sheet: ")).is_file()


def test_trained_lora_loads_into_the_diffusers_pipeline_and_changes_the_output(dag_run, tiny_k5: Path) -> None:
    from diffusers import Kandinsky5T2VPipeline

    first, _, _ = dag_run
    lora_path = Path(metadata(first, "lora")["lora_path"])
    pipe = Kandinsky5T2VPipeline.from_pretrained(tiny_k5)
    transformer = pipe.transformer
    torch.manual_seed(0)
    hidden = torch.randn(1, 2, 4, 6, 33)
    kwargs = dict(hidden_states=hidden, encoder_hidden_states=torch.randn(1, 5, transformer.config.in_text_dim),
                  pooled_projections=torch.randn(1, transformer.config.in_text_dim2), timestep=torch.tensor([500.0]),
                  visual_rope_pos=[torch.arange(2), torch.arange(2), torch.arange(3)], text_rope_pos=torch.arange(5),
                  scale_factor=(1, 2, 2), sparse_params=None)
    with torch.no_grad():
        before = transformer(**kwargs).sample
        pipe.load_lora_weights(str(lora_path.parent))
        after = transformer(**kwargs).sample
    assert (after - before).abs().max() > 1e-4  # trained lora_B is not zero: the adapter does something


def test_single_stage_from_the_dagster_cli(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """The README's commands: `loraflow partitions`, then one stage for one dataset partition (`dagster asset
    materialize` for clips, `dg launch` for latents)."""
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    env = {**os.environ, "LORAFLOW_CONFIG": str(config), "DAGSTER_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    bin_dir = Path(sys.executable).parent
    materialize = [str(bin_dir / "dagster"), "asset", "materialize", "-m", "loraflow.definitions", "--select"]
    early = subprocess.run([*materialize, "clips", "--partition", "demo-videos"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert early.returncode != 0 and "demo-videos" in early.stderr  # no partition yet: it must be added first
    added = subprocess.run([str(bin_dir / "loraflow"), "partitions", str(config)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert added.returncode == 0 and "added: demo-videos" in added.stdout, added.stderr[-3000:]
    # The same stage command both ways: Dagster's own CLI, and `dg launch` reading `[tool.dg]` of pyproject.toml
    launch = [str(bin_dir / "dg"), "launch", "--assets", "latents", "--partition", "demo-videos"]
    for command in ([*materialize, "clips", "--partition", "demo-videos"], launch):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    from loraflow.store import Store

    store = Store(str(tmp_path / "cache"))
    assert len(store.read_manifest("latents")) == len(store.read_manifest("clips")) >= 5
