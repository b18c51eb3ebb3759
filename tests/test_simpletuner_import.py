"""`loraflow import-simpletuner` on SimpleTuner's own example configs (tests/simpletuner_examples/, verbatim from
bghira/SimpleTuner at bc8e6ab7738c), on any JSON at all (hypothesis), and one test per meaning the importer used to
change silently (issue 57): each SimpleTuner default a config leaves unset is written with its source line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraflow.cli import main
from loraflow.config import LoraflowConfig, load_config
from loraflow.simpletuner import import_simpletuner, to_yaml

EXAMPLES = Path(__file__).parent / "simpletuner_examples"
EXAMPLE_CONFIGS = sorted(p.parent.name for p in (EXAMPLES / "examples").glob("*/config.json"))
PROBLEM = re.compile(r"^  - (datasets\[\d+\]\.)?[a-z_0-9.\[\]]+: ")  # a problem line names its key first
# A Kandinsky 5 Video config as SimpleTuner users write it: everything else left at SimpleTuner's defaults
K5_VIDEO = {"model_family": "kandinsky5_video", "model_type": "lora", "pretrained_model_name_or_path": "m",
            "checkpoint_step_interval": 100, "max_train_steps": 10}
VIDEOS = [{"id": "clips", "type": "local", "dataset_type": "video", "instance_data_dir": "videos",
           "crop": True, "video": {"num_frames": 17}},
          {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True}]


def _copy_examples(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES, tmp_path / "simpletuner")
    return tmp_path / "simpletuner" / "examples"


def _import(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, Path]:
    out = tmp_path / "imported.yaml"
    code = main(["import-simpletuner", *args, "-o", str(out), "--force"])
    return code, capsys.readouterr().err, out


def _problems(err: str) -> list[str]:
    # "\n" only: str.splitlines would also split at the control characters a key may hold
    return [line for line in err.split("problem(s):\n", 1)[1].split("\n") if line] if "problem(s):" in err else []


@pytest.mark.parametrize("example", EXAMPLE_CONFIGS)
def test_every_simpletuner_example_imports_or_names_each_problem_by_key(
        example: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its dataset list and LyCORIS file found where SimpleTuner finds them (config/examples/ is its package's
    examples/); exit 0, or 2 with every problem naming its key and what to do; never a traceback."""
    code, err, out = _import(tmp_path, capsys, str(_copy_examples(tmp_path) / example / "config.json"))
    assert code in (0, 2) and "Traceback" not in err, err
    assert all(PROBLEM.match(line) for line in _problems(err)), err
    assert (code == 2) == bool(_problems(err))
    imported = yaml.safe_load(out.read_text())
    assert imported["model_family"] in ("kandinsky5-video", "kandinsky5-image", "hunyuanvideo-1.5")
    hub = imported["datasets"][0]
    assert hub["type"] == "huggingface" and hub["dataset_name"]
    if "video" in example:  # the huggingface: block's columns, carried as loraflow's dataset keys
        assert (hub["video_column"], hub["caption_column"]) == ("video", "prompt")
        # SimpleTuner's 48 frames are not 4k+1 for these VAEs: named, with the two nearest
        assert _problems(err) == ["  - datasets[0].video.num_frames: `num_frames - 1` must be divisible by 4 (the "
                                  "VAE's temporal factor); got 48. Use 45 or 49."]
    if "lycoris" in example:  # the preset names Kandinsky5FeedForward: the feed-forward trains, as in SimpleTuner
        assert imported["lora_include_ffn"] is True and imported["lycoris_config"]["algo"] == "lokr"
    assert imported["checkpointing_steps"] == json.loads((EXAMPLES / "examples" / example / "config.json")
                                                         .read_text())["checkpoint_step_interval"]


def test_the_kandinsky5_image_t2i_example_is_a_valid_config(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, err, out = _import(tmp_path, capsys, str(_copy_examples(tmp_path) / "kandinsky5-image-6b-t2i.lycoris-lokr"
                                                   / "config.json"))
    assert code == 0, err
    config = load_config(out)
    assert (config.model_family, config.grad_clip_method, config.flow_schedule_shift) == ("kandinsky5-image", "value",
                                                                                           3.0)
    assert config.datasets[0].crop_style == "random" and config.datasets[0].crop_aspect == "square"


def test_a_dataset_file_that_is_one_object_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(K5_VIDEO))
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text(json.dumps(VIDEOS[0]))
    code, err, _ = _import(tmp_path, capsys, str(config), str(backend))
    assert code == 2 and "holds a JSON object" in err and "wrap one dataset in [ ]" in err
    config.write_text(json.dumps([K5_VIDEO]))
    code, err, _ = _import(tmp_path, capsys, str(config), str(backend))
    assert code == 2 and "config.json (the first argument) holds a JSON array" in err
    backend.write_text("[{")
    code, err, _ = _import(tmp_path, capsys, str(tmp_path / "config" / "missing.json"), str(backend))
    assert code == 2 and "missing.json does not exist" in err


# -- any JSON at all --------------------------------------------------------------------------------------------------
SIMPLETUNER_KEYS = ["model_family", "model_flavour", "validation_resolution", "lr_scheduler", "optimizer",
                    "flow_schedule_shift", "flow_schedule_auto_shift", "lycoris_config", "lora_type", "report_to",
                    "text_encoder_1_precision", "scheduled_sampling_sampler", "base_model_precision",
                    "checkpoint_step_interval", "user_prompt_library", "musubi_blocks_to_swap", "crepa_enabled",
                    "pretrained_model_name_or_path", "resolution", "resolution_type", "minimum_image_size",
                    "text_encoder_2_precision", "validation_adapter_mode", "init_lora", "output_dir",
                    "data_backend_config", "--model_family", "max_grad_norm", "peft_lora_target_modules"]
DATASET_KEYS = ["id", "type", "dataset_type", "crop", "crop_style", "crop_aspect", "crop_aspect_buckets", "video",
                "huggingface", "conditioning", "conditioning_data", "conditioning_type", "resolution",
                "resolution_type", "minimum_image_size", "caption_strategy", "dataset_name", "instance_data_dir"]
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.sampled_from(
    ["kandinsky5_video", "kandinsky5-image", "hunyuanvideo", "lycoris", "area", "true", "mask", "854x480", "0",
     "config/datasets.json", "datasets.json"])
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def keyed(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(names) | st.text(max_size=10), json_values, max_size=8)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=keyed(SIMPLETUNER_KEYS) | json_values,
       backends=st.lists(keyed(DATASET_KEYS) | json_values, max_size=3) | json_values, second=st.booleans())
def test_any_json_imports_or_is_a_message_never_a_traceback(config: Any, backends: Any, second: bool, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Random nested JSON as config.json and as the dataset list: exit 0 with YAML that reads back, or exit 2 with
    messages (an exception here is the traceback a user would see)."""
    config_json, backend_json = tmp_path / "config" / "config.json", tmp_path / "config" / "datasets.json"
    config_json.parent.mkdir(exist_ok=True)
    config_json.write_text(json.dumps(config))
    backend_json.write_text(json.dumps(backends))
    # without the second argument, the file config.json's data_backend_config names (if any) is searched for
    code, err, out = _import(tmp_path, capsys, str(config_json), *[str(backend_json)] * second)
    assert code in (0, 2), err
    if out.exists():
        assert isinstance(yaml.safe_load(out.read_text()), dict)  # the comments never break the YAML
        out.unlink()
    if code == 2:  # the importer's message, or the config's problems, each under its key
        assert err.startswith("import-simpletuner: ") or _problems(err)[0].startswith("  - "), err


# -- one test per meaning that used to change silently ---------------------------------------------------------------
def test_simpletuner_spellings_of_the_families_import() -> None:
    for spelling, family in (("kandinsky5_video", "kandinsky5-video"), ("kandinsky5_image", "kandinsky5-image"),
                             ("Kandinsky5-Video", "kandinsky5-video"), ("hunyuanvideo", "hunyuanvideo-1.5")):
        assert import_simpletuner({"model_family": spelling}, []).config["model_family"] == family


def test_a_lycoris_preset_of_the_familys_feed_forward_class_trains_the_feed_forward() -> None:
    preset = {"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1, "factor": 4,
              "apply_preset": {"target_module": ["Kandinsky5Attention", "Kandinsky5FeedForward"]}}
    imported = import_simpletuner({"model_family": "kandinsky5-image", "lora_type": "lycoris",
                                   "lycoris_config": preset}, [])
    assert imported.config["lora_include_ffn"] is True
    hunyuan = import_simpletuner({"model_family": "hunyuanvideo", "lora_type": "lycoris", "lycoris_config": {
        **preset, "apply_preset": {"target_module": ["Attention"]}}}, [])
    assert "lora_include_ffn" not in hunyuan.config  # no feed-forward class named: attention only


def test_checkpoint_step_interval_is_the_checkpoint_interval() -> None:
    imported = import_simpletuner(K5_VIDEO, VIDEOS)
    assert imported.config["checkpointing_steps"] == 100
    assert "checkpoint_step_interval" not in [key for key, _, _ in imported.unmapped]
    unset = import_simpletuner({"model_family": "kandinsky5_video"}, VIDEOS)
    assert unset.config["checkpointing_steps"] == 500  # SimpleTuner's default, not loraflow's 50


def test_keys_left_unset_get_simpletuners_defaults_with_their_source_line(tmp_path: Path) -> None:
    imported = import_simpletuner(K5_VIDEO, VIDEOS)
    text = to_yaml(imported, ["config.json"])
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    config = load_config(path)
    assert (config.lora_dropout, config.caption_dropout_probability, config.flow_schedule_shift) == (0.1, 0.1, 3.0)
    assert (config.max_grad_norm, config.grad_clip_method) == (2.0, "value")  # SimpleTuner clips per value
    assert config.peft_lora_target_modules == ("to_key", "to_query", "to_value")  # no out_layer, as SimpleTuner
    assert (config.datasets[0].crop_style, config.datasets[0].crop_aspect) == ("random", "square")
    assert (config.learning_rate, config.train_batch_size, config.gradient_checkpointing) == (4e-7, 4, True)
    lines = text.splitlines()
    assert "lora_dropout: 0.1  # SimpleTuner's default (simpletuner/simpletuner_sdk/server/services/field_registry/" \
           "sections/lora.py:137 at bc8e6ab7738c)" in lines
    assert any(line.startswith("peft_lora_target_modules:  # SimpleTuner's default (simpletuner/helpers/models/"
                               "kandinsky5_video/model.py:57") for line in lines)
    assert any(line.startswith("    crop_style: random  # SimpleTuner's default (simpletuner/helpers/data_backend/"
                               "factory.py:560") for line in lines)
    given = import_simpletuner({**K5_VIDEO, "lora_dropout": 0.0, "flow_schedule_auto_shift": True}, VIDEOS)
    assert given.config["lora_dropout"] == 0.0 and "flow_schedule_shift" not in given.config  # set ones stay


def test_simpletuner_target_list_adapts_no_out_layer() -> None:
    """peft_lora_target_modules on a real (tiny) Kandinsky 5 DiT: query, key and value only, where loraflow's own
    list adds out_layer."""
    from loraflow.pipelines import load_family
    from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_transformer
    from loraflow.training.options.adapters import add_adapter

    family = load_family("kandinsky5-video")
    adapted = {}
    for targets in (None, ["to_key", "to_query", "to_value"]):
        config = LoraflowConfig.model_validate({"model_family": "kandinsky5-video", "datasets": [
                                                    {"id": "v", "instance_data_dir": "videos"}],
                                                "pretrained_model_name_or_path": "m",
                                                "peft_lora_target_modules": targets})
        transformer = kandinsky5_transformer(visual_cond=True)
        add_adapter(transformer, config, family)
        adapted[targets is None] = {n.split(".lora_A")[0] for n, _ in transformer.named_parameters() if "lora_A" in n}
    assert adapted[False] and all(name.endswith(("to_key", "to_query", "to_value")) for name in adapted[False])
    assert adapted[True] - adapted[False] == {n for n in adapted[True] if n.endswith("out_layer")} != set()


def test_value_clipping_clamps_each_gradient_element() -> None:
    """grad_clip_method value (SimpleTuner's default) clamps elements; norm scales the whole gradient."""
    from loraflow.training.model_setup import Trainable

    for method, expected in (("value", [0.5, -0.5, 0.25]), ("norm", [x * 0.5 / 5 ** 0.5 for x in (2, -1, 0)])):
        weight = torch.nn.Parameter(torch.zeros(3))
        module = torch.nn.Module()
        module.weight = weight
        trainable = Trainable(module, [weight], torch.device("cpu"))
        weight.grad = torch.tensor([2.0, -1.0, 0.25] if method == "value" else [2.0, -1.0, 0.0])
        norm = trainable.step(torch.optim.SGD([weight], lr=1.0), 0.5, method)
        assert torch.allclose(-weight.detach(), torch.tensor(expected)), method
        assert norm == pytest.approx(torch.tensor([2.0, -1.0, 0.25 if method == "value" else 0.0]).norm().item())


def test_user_prompt_library_is_found_as_simpletuner_finds_it(tmp_path: Path) -> None:
    """Relative to SimpleTuner's folder (config/'s parent), written absolute: loraflow reads it beside the YAML."""
    (tmp_path / "config").mkdir()
    library = tmp_path / "config" / "user_prompt_library.json"
    library.write_text(json.dumps({"a": "a prompt"}))
    settings = {**K5_VIDEO, "user_prompt_library": "config/user_prompt_library.json"}
    imported = import_simpletuner(settings, VIDEOS, base_dir=tmp_path / "config")
    assert imported.config["user_prompt_library"] == str(library.resolve())
    missing = import_simpletuner({**settings, "user_prompt_library": "config/other.json"}, VIDEOS,
                                 base_dir=tmp_path / "config")
    assert missing.config["user_prompt_library"] == str(tmp_path / "config" / "other.json")
    assert any("was not found" in note for note in missing.notes)


def test_the_docs_list_every_simpletuner_default_with_its_source() -> None:
    from loraflow.simpletuner import defaults

    table = (Path(__file__).parents[1] / "docs" / "simpletuner.md").read_text()
    written = (*defaults.TRAINING, *defaults.LORA_TARGETS.values(), defaults.CROP_STYLE, defaults.CROP_ASPECT,
               defaults.CAPTION_COLUMN, defaults.LYCORIS_FILE)
    for default in written:
        assert f"| `{default.key}` | `{default.value}` | {default.source} |" in table, default.key


def test_where_simpletuner_does_not_clip_the_import_says_so() -> None:
    """SimpleTuner skips clipping with prodigy or max_grad_norm 0 (trainer.py:7138-7142); loraflow always clips."""
    prodigy = import_simpletuner({**K5_VIDEO, "optimizer": "prodigy"}, VIDEOS)
    assert any("optimizer prodigy: SimpleTuner does not clip" in note for note in prodigy.notes)
    zero = import_simpletuner({**K5_VIDEO, "max_grad_norm": 0}, VIDEOS)
    assert "max_grad_norm" not in zero.config  # not loraflow's refused 0, nor SimpleTuner's 2.0 default
    assert [(key, value) for key, value, _ in zero.unmapped] == [("max_grad_norm", 0)]


def test_lycoris_without_its_file_reads_simpletuners_default_file_or_says_what_to_set(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    settings = {"model_family": "kandinsky5-image", "lora_type": "lycoris",
                "peft_lora_target_modules": ["to_key"]}  # SimpleTuner reads the list for standard LoRAs only
    with pytest.raises(ValueError, match="lora_type lycoris without lycoris_config: SimpleTuner then reads "
                                         "config/lycoris_config.json"):
        import_simpletuner(settings, VIDEOS, base_dir=tmp_path / "config")
    (tmp_path / "config" / "lycoris_config.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 8}))
    imported = import_simpletuner(settings, VIDEOS, base_dir=tmp_path / "config")
    assert imported.config["lycoris_config"] == {"algo": "lokr", "linear_dim": 8}
    assert "peft_lora_target_modules" not in imported.config
    assert [key for key, _, _ in imported.unmapped] == ["peft_lora_target_modules"]
