"""Writes the tiny checkpoints: `build_tiny` writes the one a family's `tiny(flavour)` builds (its folder's
`tiny.py`, from the parts in `loraflow.pipelines.tiny_parts`) in the diffusers directory layout, marked with the
recipe it was built by; `tiny_dinov2` writes CREPA's tiny teacher. What tests, benchmarks and `loraflow demo` load."""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from loraflow.atomic import publish_folder
from loraflow.demo import tiny_world
from loraflow.pipelines import family_spec

RECIPE_KEY = "_loraflow_tiny_recipe"  # model_index.json: what build_tiny built the folder by (builder, seed)


def index_extras(folder: Path, extras: Mapping[str, object], recipe: Mapping[str, object]) -> None:
    """List extra components in folder/model_index.json as a hub checkpoint lists them (library, class), so the
    pipeline that takes them loads the folder alone (HunyuanVideo15ImageToVideoPipeline.from_pretrained(d)); a
    pipeline that does not take them ignores them with a warning, as it would on the hub checkpoint. Mark the recipe
    `build_tiny` built the folder by under RECIPE_KEY (diffusers' loaders skip keys that start with "_")."""
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, component in extras.items():
        index[name] = [type(component).__module__.split(".")[0], type(component).__name__]
    index[RECIPE_KEY] = dict(recipe)
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' per-save "Writing model shards" bars; restore the caller's setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny(family: str, out_dir: str | Path, seed: int = 0, flavour: str | None = None,
               world: bool = False) -> Path:
    """Write a tiny diffusers-layout checkpoint for `family` into out_dir, with the builder its `tiny(flavour)` (the
    family folder's tiny.py: `FamilySpec.tiny_module`) picks and names (`recipe_name`) (None: the default flavour's;
    Kandinsky 5 Image i2i has its own). `world`: the demo's pre-trained tiny world (`tiny_world.tiny`) for the family
    that has one (Kandinsky 5 Video), else `tiny`.

    Idempotent: if out_dir/model_index.json exists, return immediately, after checking that it holds the pipeline
    the flavour needs and was built by the same recipe (builder and seed, marked in model_index.json): another
    recipe, or a folder without the mark, is refused, never silently reused (`world=True` over an old random
    checkpoint kept the random one). Components are built in a staging directory next to ``out_dir``, published
    whole by one rename (`atomic.publish_folder`), so an interrupted build never leaves part of a checkpoint.
    Weights are fp32 and depend only on ``seed`` (the global torch RNG state is left untouched).
    """
    out_dir = Path(out_dir)
    spec = family_spec(family)
    pick = tiny_world.tiny if world and family == tiny_world.FAMILY else importlib.import_module(
        spec.tiny_module or spec.module).tiny
    pipeline, name, builder = pick(spec.flavour(flavour))
    recipe = {"builder": name, "seed": seed}
    if (out_dir / "model_index.json").exists():
        index = json.loads((out_dir / "model_index.json").read_text())
        built = index["_class_name"]
        if built != pipeline.__name__:
            wanted = f"{family} flavour {flavour!r}" if flavour else family
            raise ValueError(f"{out_dir} holds a tiny {built} checkpoint, but {wanted} needs a {pipeline.__name__}: "
                             "build it into another folder")
        _check_recipe(out_dir, index.get(RECIPE_KEY), recipe)
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()):  # the build publishes a whole folder: it never merges into one
        raise ValueError(f"{out_dir} holds files but no model_index.json, so no finished checkpoint: delete it to "
                         "build the tiny checkpoint there, or build into another folder")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe, extras = builder()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        with _no_progress_bars():
            pipe.save_pretrained(staging, safe_serialization=True)
            for subfolder, component in extras.items():
                component.save_pretrained(staging / subfolder)
            index_extras(staging, extras, recipe)
        publish_folder(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_recipe(out_dir: Path, held: dict[str, object] | None, recipe: dict[str, object]) -> None:
    """Refuse a built folder whose mark (`held`) names another recipe, or that has none (built before the mark
    existed, or not by build_tiny): its weights are not what this call would build."""
    if held == recipe:
        return
    what = (f"was built by {held['builder']} (seed {held['seed']})" if held else
            "has no build_tiny recipe in its model_index.json, so what it holds is unknown (built by an older "
            "loraflow, or not by build_tiny)")
    raise ValueError(f"{out_dir} {what}, but this build is {recipe['builder']} (seed {recipe['seed']}): delete the "
                     "folder to build it again, or build into another folder")


def tiny_dinov2(out_dir: str | Path, seed: int = 0) -> Path:
    """A DINOv2 image encoder (CREPA's teacher) at width 16, patch 4, saved with save_pretrained: a folder
    `crepa_encoder_path` can name, loaded with the real from_pretrained."""
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          patch_size=4, image_size=16)
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's generator left as it was (as build_tiny)
        torch.manual_seed(seed)
        model = Dinov2Model(config).eval()
    model.save_pretrained(out_dir)
    return Path(out_dir)
