"""A fourth model family, added in this one file and one registry row: the config model, `build_tiny` and the stages
(clips -> latents -> text_embeds -> a short training) take it without an edit anywhere else.

The family ("kandinsky5-mini") is Kandinsky 5 Video under another name, with its own prompt template, flavour table
and tiny checkpoint (a smaller flow shift). It is real: a tiny Kandinsky5T2VPipeline written by `build_tiny`, loaded
through from_pretrained, encoded, trained. What makes it a family is exactly what docs/families.md lists: a module
with `SPEC` (here it names itself as its `module`: it has no load time to protect), `make_family` and `tiny`, and
its row in `loraflow.pipelines.FAMILIES`.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from diffusers import Kandinsky5T2VPipeline
from safetensors.torch import load_file

from loraflow.config import LoraflowConfig, load_config
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import FAMILIES, describe_families, get_family
from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour
from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_pipeline
from loraflow.pipelines.kandinsky5.video.family import Kandinsky5Video
from loraflow.pipelines.kandinsky5.video.spec import VIDEO_CLASSES
from loraflow.pipelines.kandinsky5.video.tiny import hunyuan_video_vae
from loraflow.pipelines.sources import model_source
from loraflow.pipelines.tiny_parts import TinyPipeline, recipe_name
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.text.text_embeds import encode_texts
from loraflow.store import Store
from loraflow.training import loop as T
from tests.factory import demo_dict, write_config

NAME = "kandinsky5-mini"

# 1. the family's plain data ------------------------------------------------------------------------------------
SPEC = FamilySpec(
    name=NAME,
    description="Kandinsky 5 Video under another name and prompt, to show a family is one module",
    flavours=(Flavour("t2v-mini", "t2v", 24.0, 17, (64, 64), 3.0, 4.0, TWO_ENCODER_PARTS, classes=VIDEO_CLASSES),),
    default_flavour="t2v-mini",
    spatial_multiple=16,
    vae_temporal_factor=4,
    module=__name__,
    simpletuner_names=("kandinsky5-mini",),
)

# 2. the adapter ------------------------------------------------------------------------------------------------
PROMPT_TEMPLATE = "<|im_start|>system\nDescribe the video.<|im_end|>\n<|im_start|>user\n{}<|im_end|>"


@dataclass(frozen=True)
class Kandinsky5Mini(Kandinsky5Video):
    prompt_templates: ClassVar[dict[str, str]] = {"original": PROMPT_TEMPLATE}
    name: str = NAME  # text_signature, max_text_tokens: Kandinsky5Shared's (this template, the flavour's 512 tokens)


def make_family(flavour: str | None) -> Kandinsky5Mini:
    return Kandinsky5Mini(flavour=SPEC.flavour(flavour))


# 3. the tiny checkpoint ----------------------------------------------------------------------------------------
def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    return Kandinsky5T2VPipeline, recipe_name(NAME, "t2v", 1), functools.partial(
        kandinsky5_pipeline, Kandinsky5T2VPipeline, visual_cond=True, vae=hunyuan_video_vae, shift=3.0)


# 4. the registry row, for this module's tests ------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, NAME, __name__)
        yield


@pytest.fixture(scope="module")
def root(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family's tiny checkpoint and two demo clips."""
    root = tmp_path_factory.mktemp("mini")
    build_tiny(NAME, root / "model")
    (root / "data").mkdir()
    for stem in ("clip_00", "clip_02"):
        for ext in (".mp4", ".txt"):
            shutil.copy(demo_data / f"{stem}{ext}", root / "data" / f"{stem}{ext}")
    return root


def make_config(root: Path, **overrides) -> LoraflowConfig:
    data = demo_dict(root / "model", root / "data", root, model_family=NAME, max_train_steps=2,
                     checkpointing_steps=100)
    data.pop("model_flavour")  # the family's default
    data.update(overrides)
    return load_config(write_config(root / f"config-{len(overrides)}.yaml", data))


def test_the_config_model_takes_the_family_and_its_flavours(root: Path) -> None:
    config = make_config(root)
    family = get_family(config)
    assert isinstance(family, Kandinsky5Mini) and family.flavour.name == "t2v-mini"
    with pytest.raises(ValueError, match="model_flavour.*t2v-mini"):  # the family's flavours, by name
        make_config(root, model_flavour="t2v-lite-sft-5s")
    with pytest.raises(ValueError, match="takes no image"):  # its t2v flavour's properties reach validation
        make_config(root, validation_using_datasets=True)
    assert NAME in describe_families()


def test_build_tiny_writes_the_familys_checkpoint(root: Path) -> None:
    index = json.loads((root / "model" / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky5T2VPipeline"
    pipe = Kandinsky5T2VPipeline.from_pretrained(root / "model")
    assert pipe.scheduler.config.shift == 3.0  # this family's builder, not Kandinsky 5 Video's (10.0)


def test_the_stages_cache_and_train_the_family(root: Path) -> None:
    config = make_config(root)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    for op in (build_clips, encode_latents, encode_texts):
        assert op(config, family, model_source(config), store).computed > 0
    keys = [row["key"] for row in store.read_manifest("text_embeds")]
    assert keys and {row["family"] for row in store.get("text_embeds", keys).values()} == {NAME}
    assert T.train_lora(config, family, model_source(config), store).computed == config.max_train_steps
    (lora,) = Path(config.output_dir).rglob(T.LORA_FILE)
    weights = load_file(lora)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    assert any(w.abs().max() > 0 for k, w in weights.items() if "lora_B" in k)  # B starts at zero: it trained


def test_without_its_row_the_family_is_unknown(root: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(FAMILIES, NAME)
        with pytest.raises(ValueError, match="model_family"):
            make_config(root)
