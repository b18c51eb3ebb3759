"""Every JSON block of every seed guide (`../shared/seeds/`, all five files, all languages), imported the way the guide
combines them: its config.json blocks merged over the `model_family` it names, its multidatabackend.json block as the
dataset list, its user_prompt_library.json block as that file. Each key is carried over, or skipped for a reason
still true of today's config model: the model refuses that key, or that value of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraflow.config import ConfigError, parse_config
from loraflow.pipelines import family_flavour, family_spec
from loraflow.pipelines.flavours import NOT_DIFFUSERS
from loraflow.simpletuner import BACKEND_KEYS, ONLY_VALUE, import_simpletuner, simpletuner_families
from loraflow.simpletuner.paths import FILE_KEYS
from tests.factory import GUIDES, SEEDS, combine, missing_input


@pytest.fixture(params=GUIDES or [None], ids=[g.name for g in GUIDES] or ["no guides"])
def guide(request: pytest.FixtureRequest) -> Path:
    """Each seed guide; with none (the shared folder absent) one test that skips, or fails under CI."""
    if request.param is None:
        missing_input(f"no seed guides: {SEEDS} (the shared folder beside the repository) is absent")
    return request.param


def test_every_key_of_a_guide_is_carried_or_skipped_for_a_true_reason(guide: Path, tmp_path: Path) -> None:
    settings, backends = combine(guide, tmp_path, with_i2v=True)
    assert settings.get("model_family") and backends, "the guide names its family and its datasets"
    imported = import_simpletuner(settings, backends, base_dir=tmp_path / "config")
    skipped = {key: (value, why) for key, value, why in imported.unmapped}
    family = simpletuner_families()[settings["model_family"]]
    for key, value in settings.items():
        if key in skipped:
            assert skipped[key][0] == value and refused(family, key, value), key
        elif key in ONLY_VALUE or key in BACKEND_KEYS:  # the one value loraflow has; the datasets, inline
            assert value == ONLY_VALUE.get(key, value) and imported.config["datasets"], key
        elif key == "model_family":
            assert imported.config[key] == family
        elif key == "pretrained_model_name_or_path" and value in NOT_DIFFUSERS:
            assert imported.config[key] == family_flavour(family, settings.get("model_flavour")).repo
        elif key == "validation_resolution" and imported.config[key] != value:  # off the family's multiple
            multiple = family_spec(family).spatial_multiple
            assert all(int(side) % multiple == 0 for side in imported.config[key].split("x")), key
            assert f"validation_resolution {value} became {imported.config[key]}" in "\n".join(imported.notes)
        elif key in FILE_KEYS:  # found where SimpleTuner reads it (its folder, config/'s parent): written absolute
            assert imported.config[key] == str((tmp_path / value).resolve()), key
        else:
            assert imported.config[key] == value, key
    for index, entry in enumerate(backends):
        dataset = imported.config["datasets"][index]
        for key, value in entry.items():
            if key == "crop":  # SimpleTuner's switch for the crop keys, carried by them (its default style: random)
                style = entry.get("crop_style", "random") if value is True else "center"
                assert dataset.get("crop_style", "center") == style
            else:
                assert dataset[key] == value, f"datasets[{index}].{key}"
    assert all(why != "no loraflow equivalent" for _, why in skipped.values()), skipped  # each with its own reason
    assert set(skipped) <= ALLOWED_SKIPS, set(skipped) - ALLOWED_SKIPS


def test_a_guides_import_is_a_valid_config(guide: Path, tmp_path: Path) -> None:
    settings, backends = combine(guide, tmp_path, with_i2v=False)
    imported = import_simpletuner(settings, backends, base_dir=tmp_path / "config")
    parse_config(imported.config, guide.name, tmp_path)


# What a guide may leave behind: keys today's config model has no equivalent for (issue 19 adds some of them).
ALLOWED_SKIPS = {"optimizer", "base_model_precision", "text_encoder_2_precision", "base_model_default_dtype"}


def refused(family: str, key: str, value: Any) -> bool:
    """Today's config model refuses `key: value` (unknown key, or a value it does not allow)."""
    base = {"model_family": family, "pretrained_model_name_or_path": "org/model",
            "datasets": [{"id": "v", "dataset_type": "image", "instance_data_dir": "images"}]}
    parse_config(base)
    try:
        parse_config({**base, key: value})
    except ConfigError as error:
        return any(problem.startswith(f"{key}:") for problem in error.problems)
    return False
