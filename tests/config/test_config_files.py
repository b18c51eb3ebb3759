"""Config files from careless or hostile hands (issue 42): a YAML alias bomb, a config of megabytes, a value whose
error would print megabytes. Each is refused at load with one short message naming the file or the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loraflow.cli import main
from loraflow.config import ConfigError, load_config
from tests.factory import demo


def laughs(levels: int, width: int = 10) -> str:
    """The billion laughs: each anchor a list of `width` aliases of the one before, `width ** levels` strings in all."""
    lines = ['l0: &l0 "lol"']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nvalidation_prompt: *l{levels}\n"


def test_yaml_aliases_that_expand_past_a_bound_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(demo()) + laughs(6))  # a million strings (nine levels: `check` hung)
    assert main(["check", "--no-estimates", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000 and "aliases" in err and "100000 values" in err


def test_a_yaml_alias_inside_itself_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(demo()) + "loop: &loop [1, *loop]\n")
    with pytest.raises(ConfigError, match="inside itself"):
        load_config(path)


@pytest.mark.parametrize("where", ["config", "dataset_backend_config", "user_prompt_library"])
def test_a_config_file_over_a_mebibyte_is_refused(tmp_path: Path, where: str) -> None:
    data, prompt = demo(), "a cat " * 200_000  # 1.2 MB: a prompt no text encoder reads past its first lines
    if where == "config":
        data["validation_prompt"] = prompt
    elif where == "dataset_backend_config":
        datasets = data.pop("datasets")
        datasets[0]["instance_prompt"] = prompt
        (tmp_path / "backend.json").write_text(json.dumps(datasets))
        data["dataset_backend_config"] = "backend.json"
    else:
        (tmp_path / "prompts.json").write_text(json.dumps({"cat": prompt}))
        data["user_prompt_library"] = "prompts.json"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert "1 MiB" in problem and "MiB" in problem and len(problem) < 400
    assert (where == "config") or f"{where}" in problem


def test_an_error_prints_a_bounded_part_of_a_huge_value(tmp_path: Path) -> None:
    data = demo()
    data["lora_rank"] = list(range(20_000))  # 120 KB as written: the error names the key and shows its start
    data["seed"] = "9" * 100_000
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(p.split(":")[0] for p in info.value.problems) == ["lora_rank", "seed"]
    assert all(len(p) < 400 for p in info.value.problems), [len(p) for p in info.value.problems]


def test_a_yaml_syntax_error_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model_family: kandinsky5-video\ndatasets: [\n")
    with pytest.raises(ConfigError, match="line 3"):
        load_config(path)
