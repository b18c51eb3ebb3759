"""What changes a training run's key is what each config field declares (`setting(..., run_key=...)`), nothing else.

The fields are found by walking the config models, never listed by hand: a new field is covered the day it lands.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.config import (
    DatasetConfig,
    LoraflowConfig,
    StrictModel,
    TreadConfig,
    TreadRoute,
    VideoSettings,
    load_config,
    setting,
)
from loraflow.config.adapter_kinds import LycorisConfig
from loraflow.config.fields import ConfigFields
from loraflow.config.guide_features import GuideFeatures
from loraflow.config.run_key import run_key_of
from loraflow.config.training_options import TrainingOptions
from loraflow.config.validation_adapters import ValidationAdapter
from loraflow.training.run import run_dir

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = {"latents": "l", "text_embeds": "t"}
Path_ = tuple[str | int, ...]  # field names, and indices into tuples of models


def demo() -> LoraflowConfig:
    """The demo config with TREAD, a LyCORIS config and a validation adapter on, so that every config model
    (TreadRoute too) has an instance to vary."""
    config = load_config(REPO / "configs" / "demo.yaml")
    route = TreadRoute(selection_ratio=0.5, start_layer_idx=0, end_layer_idx=-1)
    lycoris = LycorisConfig(algo="lokr", linear_dim=4)
    return config.model_copy(update={"tread_config": TreadConfig(routes=(route,)), "lora_type": "lycoris",
                                     "lycoris_config": lycoris,
                                     "validation_adapter_config": (ValidationAdapter(path="other.safetensors"),)})


def fields(model: StrictModel) -> Iterator[tuple[Path_, str, type[StrictModel], str]]:
    """(path, run key rule, owning model, name) of every field of `model` and of the models it holds."""
    for name in type(model).model_fields:
        yield (name,), run_key_of(type(model), name), type(model), name
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        for index, item in items:
            if isinstance(item, StrictModel):
                prefix = (name,) if index is None else (name, index)
                yield from (((*prefix, *p), *rest) for p, *rest in fields(item))


def get(model: Any, path: Path_) -> Any:
    for part in path:
        model = model[part] if isinstance(part, int) else getattr(model, part)
    return model


def replaced(model: Any, path: Path_, value: Any) -> Any:
    """`model` with the field at `path` set to `value` (unvalidated: only the key is computed)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        return (*model[:head], replaced(model[head], rest, value), *model[head + 1:])
    return model.model_copy(update={head: replaced(getattr(model, head), rest, value)})


def changed(value: Any) -> Any:
    """A value different from `value` (JSON-able: the run key only hashes it)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, tuple) and value:
        return (*value, value[-1])
    return "changed"  # None, (), a mapping


def key(config: LoraflowConfig) -> str:
    return run_dir(config, UPSTREAM).name


def test_the_walk_reaches_every_config_model() -> None:
    reached = {(owner, name) for _, _, owner, name in fields(demo())}
    models = {LoraflowConfig, DatasetConfig, VideoSettings, TreadConfig, TreadRoute, LycorisConfig, ValidationAdapter}
    assert reached == {(m, name) for m in models for name in m.model_fields}
    loaded = {m for m in _subclasses(StrictModel) if m.__module__.startswith("loraflow.")}
    # a new config model is reached by the walk, or this names it; ConfigFields, GuideFeatures and TrainingOptions
    # are LoraflowConfig's bases, whose fields the walk reaches as LoraflowConfig's (the first assertion)
    assert loaded == models | {ConfigFields, GuideFeatures, TrainingOptions}


def _subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct, *_subclasses(direct)}}


def test_a_field_changes_the_run_key_exactly_when_it_declares_so() -> None:
    config = demo()
    base = key(config)
    wrong = []
    for path, rule, _, _ in fields(config):
        moved = key(replaced(config, path, changed(get(config, path)))) != base
        if moved != (rule != "never"):  # when_set fields are at their default in the demo: changing one sets it
            wrong.append(f"{'.'.join(map(str, path))} ({rule}) {'moved' if moved else 'kept'} the run key")
    assert wrong == []


def test_a_new_when_set_field_at_its_default_keeps_every_run_key() -> None:
    class Later(LoraflowConfig):
        new_feature: float = setting(0.0, run_key="when_set", description="a training feature added after runs")

    config = demo().model_copy(update={"validation_adapter_config": None})  # validated: its file does not exist
    later = Later.model_validate(config.model_dump())
    assert key(later) == key(config)
    assert key(later.model_copy(update={"new_feature": 0.5})) != key(config)


def test_a_field_that_does_not_declare_fails_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"`Undeclared\.new_feature` does not declare"):
        class Undeclared(LoraflowConfig):
            new_feature: float = 0.0
