"""SimpleTuner's validation extras on the tiny real Kandinsky 5 Video, from the caches of test_train:
`validation_on_startup` (a render before the first step) and `validation_adapter_path` / `validation_adapter_config`
(the validation stage renders other adapters beside the trained one).

What is claimed: the startup render is the base model's (the validation stage's base frames) and changes no bit of
training; another adapter renders what that adapter renders (the trained file given as "another" adapter reproduces
the LoRA frames), its content is part of the validation key, and off leaves the key as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraflow.config import ConfigError, LoraflowConfig, parse_config
from loraflow.config.validation_adapters import adapter_keys
from loraflow.keys import safetensors_sha256
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.simpletuner import import_simpletuner
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.options import progress_renders as PR
from loraflow.training.options.progress_renders import step_folder
from loraflow.validation import validate as V
from tests.factory import capture_renders, demo_dict, make_config, same_lora_file, train


def save_lora_header(path: Path) -> None:
    """A LoRA file whose header passes load; its one tensor renders nothing here."""
    save_file({"transformer.blocks.0.attn.to_q.lora_A.weight": torch.zeros(1, 1)}, path)


RENDERS = {"validation_resolution": "64x48", "validation_num_video_frames": 5, "validation_num_inference_steps": 2}


@pytest.fixture(scope="module")
def plain(caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> T.LoraReport:
    """A one-step LoRA without any of these options."""
    return train(make_config(caches, tmp_path_factory.mktemp("plain") / "out", max_train_steps=1, **RENDERS))


def test_validation_on_startup_renders_the_base_at_step_0_and_trains_the_same_lora(
        caches: dict[str, Path], plain: T.LoraReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = capture_renders(monkeypatch)
    config = make_config(caches, tmp_path / "startup", validation_on_startup=True, max_train_steps=1, **RENDERS)
    report = train(config)
    assert Path(report.run_dir).name == Path(plain.run_dir).name  # not part of the run
    run = Path(report.run_dir)
    assert sorted(p.name for p in (run / "validation").glob("step-*")) == ["step-0000000"]
    assert same_lora_file(run / T.LORA_FILE, Path(plain.lora_path))
    V.validate(config, get_family(config), model_source(config), Store(config.cache_dir), report.lora_path)
    (startup,), (base, lora) = written["progress"], written["validation"]
    # the new LoRA's B is zero: step 0 adds exactly 0 to every layer, what validation's scale-0 render adds
    assert np.array_equal(startup, base)
    assert not np.array_equal(startup, lora)  # one step moved the LoRA: the comparison means something
    assert (step_folder(run / "validation", 0) / PR.RESULT).is_file()
    assert PR.progress_sheet_path(run) is not None  # the lora asset's metadata shows it (step 0 on top)


def test_validation_renders_other_adapters_beside_the_trained_one(
        caches: dict[str, Path], plain: T.LoraReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trained file given again as another adapter renders the LoRA's frames (its own peft name, same numbers);
    at strength 0.5 it renders something else; the adapters' content and strength key the validation run."""
    written = capture_renders(monkeypatch)
    lora = Path(plain.lora_path)
    adapters = [{"label": "again", "path": str(lora)}, {"label": "half", "path": str(lora.parent), "strength": 0.5}]
    config = make_config(caches, tmp_path / "out", max_train_steps=1, validation_adapter_config=adapters, **RENDERS)
    report = V.validate(config, get_family(config), model_source(config), Store(config.cache_dir), str(lora))
    base, tuned, again, half = written["validation"]
    assert np.array_equal(again, tuned)  # the adapter alone at its strength: nothing else active
    assert not np.array_equal(half, tuned) and not np.array_equal(half, base)
    (prompt,) = report.prompts
    assert sorted(prompt.adapters) == ["again", "half"] and Path(prompt.adapters["half"]).is_file()
    # validation's key: nothing without adapters (the key it had), each adapter's content hash and strength with
    keys = adapter_keys(config.validation_adapters)["adapters"]
    assert adapter_keys(()) == {} and keys[0]["sha256"] == safetensors_sha256(lora)
    assert [(k["name"], k["strength"]) for k in keys] == [("again", 1.0), ("half", 0.5)]


def test_bad_validation_adapters_are_named_at_load(tmp_path: Path) -> None:
    lora = tmp_path / "other.safetensors"
    save_lora_header(lora)  # load reads its header; validation reads the tensors
    data = demo_dict(tmp_path / "model", tmp_path / "data", tmp_path)
    cases = {"either `validation_adapter_path`": {"validation_adapter_path": str(lora),
                                                  "validation_adapter_config": [{"path": str(lora)}]},
             "Hugging Face ids are not downloaded": {"validation_adapter_path": "org/turbo:adapter.safetensors"},
             "taken by validation's own renders": {"validation_adapter_config": [{"path": str(lora), "label": "LoRA"}]},
             "two validation adapters are named 'other'": {"validation_adapter_config": {"runs": [
                 {"path": str(lora)}, {"path": str(lora), "strength": 0.5}]}},
             "one adapter per entry": {"validation_adapter_config": [{"adapters": [str(lora), str(lora)]}]},
             "`validation_on_startup` renders": {"validation_on_startup": True, "validation_prompt": None}}
    for message, keys in cases.items():
        with pytest.raises(ConfigError, match=message):
            parse_config({**data, **keys})
    (tmp_path / "adapters.json").write_text(json.dumps({"runs": [{"label": "a", "path": str(lora)}]}))
    config = parse_config({**data, "validation_adapter_config": "adapters.json"}, base_dir=tmp_path)
    assert [(a.name, a.strength) for a in config.validation_adapters] == [("a", 1.0)]


def test_the_validation_options_import_under_simpletuners_names(tmp_path: Path) -> None:
    lora = tmp_path / "turbo.safetensors"
    save_lora_header(lora)
    single = {"model_family": "kandinsky5-video", "validation_prompt": "a cat", "validation_on_startup": True,
              "validation_adapter_path": str(lora), "validation_adapter_name": "turbo",
              "validation_adapter_strength": 0.8, "validation_adapter_mode": "comparison"}
    imported = import_simpletuner(single, [])
    assert [(k, v) for k, v, _ in imported.unmapped] == [("validation_adapter_mode", "comparison")]
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m",
                                            "datasets": demo_dict(tmp_path, tmp_path, tmp_path)["datasets"]})
    assert config.validation_on_startup and [(a.name, a.path, a.strength) for a in config.validation_adapters] == [
        ("turbo", str(lora), 0.8)]
    runs = {"runs": [{"label": "turbo", "path": str(lora), "strength": 0.5}]}
    listed = import_simpletuner({"model_family": "kandinsky5-video", "validation_adapter_config": runs}, [])
    assert listed.config["validation_adapter_config"] == runs and not listed.unmapped
    off = import_simpletuner({**single, "validation_adapter_mode": "none"}, [])
    assert not any(k.startswith("validation_adapter") for k in off.config)
    assert sorted(k for k, _, _ in off.unmapped) == sorted(k for k in single if k.startswith("validation_adapter"))


def test_a_render_all_of_one_value_is_flagged_in_result_json(
        caches: dict[str, Path], plain: T.LoraReport, tmp_path: Path) -> None:
    """A NaN LoRA renders an all-black video, and the step succeeded saying nothing (issue 62 item 4): the renders
    are flagged in the prompt's result.json and the report (the base too: it runs the LoRA's layers at scale 0, and
    0 x NaN is NaN). A LoRA that renders a moving picture is not flagged."""
    from safetensors.torch import load_file

    broken = tmp_path / "nan.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(plain.lora_path).items()}, broken)
    config = make_config(caches, tmp_path / "out", max_train_steps=1, **RENDERS)
    report = V.validate(config, get_family(config), model_source(config), Store(config.cache_dir), str(broken))
    (prompt,) = report.prompts
    assert prompt.flat == ["base", "LoRA"]
    assert json.loads((Path(prompt.contact_sheet).parent / "result.json").read_text())["flat"] == ["base", "LoRA"]
    report = V.validate(config, get_family(config), model_source(config), Store(config.cache_dir), plain.lora_path)
    assert report.prompts[0].flat is None
    assert "flat" not in json.loads((Path(report.prompts[0].contact_sheet).parent / "result.json").read_text())


def test_a_nan_validation_adapter_is_refused_before_any_render(
        caches: dict[str, Path], plain: T.LoraReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It rendered an all-black video and the step succeeded (issue 62 item 4)."""
    from safetensors.torch import load_file

    broken = tmp_path / "nan.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(plain.lora_path).items()}, broken)
    written = capture_renders(monkeypatch)
    config = make_config(caches, tmp_path / "out", max_train_steps=1, validation_adapter_path=str(broken), **RENDERS)
    with pytest.raises(ValueError, match=f"`validation_adapter_path` {broken}: .* tensor\\(s\\) hold NaN"):
        V.validate(config, get_family(config), model_source(config), Store(config.cache_dir), plain.lora_path)
    assert written["validation"] == []
