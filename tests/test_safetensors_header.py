"""LoRA files a config names (`init_lora`, `validation_adapter_path`) that are corrupt, pickled or not weights: refused
when the config loads (so by `loraflow check`), naming the key and the file, and by the stage code that reads them,
instead of a MemoryError after minutes (a header length of 2^40 was read as a length to allocate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraflow.cli import main
from loraflow.config import ConfigError, parse_config
from loraflow.config.validation_adapters import ValidationAdapter, adapter_keys
from loraflow.training.options.adapters import init_lora_version
from tests.factory import demo_dict, write_config

LORA = {"transformer.blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8),
        "transformer.blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}


def corrupt_files(folder: Path) -> dict[str, Path]:
    """A good LoRA file spoiled three ways, each with the words its message must hold."""
    good = folder / "good.safetensors"
    save_file(LORA, good)
    data = good.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(iter(LORA))
    header[name]["data_offsets"][1] += 1 << 20  # past the end of the file
    moved = json.dumps(header).encode()
    files = {"header length says 1099511627776 bytes": (1 << 40).to_bytes(8, "little") + data[8:],
             "its header is not JSON": data[:8] + b"\xff" * length + data[8 + length:],
             f"tensor {name!r} has data_offsets": len(moved).to_bytes(8, "little") + moved + data[8 + length:]}
    paths = {}
    for i, (words, content) in enumerate(files.items()):
        paths[words] = folder / f"broken-{i}.safetensors"
        paths[words].write_bytes(content)
    return paths


@pytest.mark.parametrize("key", ["init_lora", "validation_adapter_path"])
def test_a_corrupt_lora_file_is_refused_at_load_naming_the_key_and_the_file(key: str, tmp_path: Path) -> None:
    data = demo_dict(tmp_path / "model", tmp_path / "data", tmp_path)
    broken = corrupt_files(tmp_path)
    parse_config({**data, key: str(tmp_path / "good.safetensors")})  # the file they were made from loads
    for words, path in broken.items():
        with pytest.raises(ConfigError) as info:
            parse_config({**data, key: str(path)})
        (problem,) = info.value.problems
        assert f"`{key}` {path} is not a readable safetensors file" in problem and words in problem


def test_the_stage_side_names_a_corrupt_file_instead_of_running_out_of_memory(tmp_path: Path) -> None:
    """The config was valid when loaded; the file changed before the stage read it."""
    for words, path in corrupt_files(tmp_path).items():
        with pytest.raises(ValueError, match="is not a readable safetensors file") as info:
            init_lora_version(str(path))  # the lora stage's run key: the content hash of init_lora
        assert str(path) in str(info.value) and words in str(info.value)
        with pytest.raises(ValueError, match="is not a readable safetensors file"):
            adapter_keys((ValidationAdapter(path=str(path)),))  # the validation stage's key


def test_check_refuses_a_corrupt_init_lora_without_a_traceback(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = corrupt_files(tmp_path)["header length says 1099511627776 bytes"]
    config = write_config(tmp_path / "config.yaml", {**demo_dict(tmp_path / "model", tmp_path / "data", tmp_path),
                                                     "init_lora": str(path)})
    assert main(["check", str(config), "--no-estimates"]) == 2
    err = capsys.readouterr().err
    assert f"init_lora: `init_lora` {path} is not a readable safetensors file" in err and "Traceback" not in err


@pytest.mark.parametrize("suffix", [".pt", ".bin", ".ckpt"])
def test_a_pickled_validation_adapter_is_refused_as_init_lora_is(suffix: str, tmp_path: Path) -> None:
    pickled = tmp_path / f"adapter{suffix}"
    torch.save(LORA, pickled)  # never unpickled: a pickle can run code when loaded
    data = demo_dict(tmp_path / "model", tmp_path / "data", tmp_path)
    for key in ("validation_adapter_path", "init_lora"):
        with pytest.raises(ConfigError, match=rf"`{key}` '{pickled}' is not a \.safetensors file"):
            parse_config({**data, key: str(pickled)})
    with pytest.raises(ConfigError, match="is not a .safetensors file"):
        parse_config({**data, "validation_adapter_config": [{"path": str(pickled), "label": "old"}]})


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8])
def test_adapter_tensors_that_are_no_floats_are_refused(dtype: torch.dtype, tmp_path: Path) -> None:
    path = tmp_path / "ints.safetensors"
    save_file({**LORA, "transformer.blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4, dtype=dtype)}, path)
    data = demo_dict(tmp_path / "model", tmp_path / "data", tmp_path)
    for key in ("validation_adapter_path", "init_lora"):
        with pytest.raises(ConfigError, match=rf"`{key}` {path}: 1 tensor\(s\) are not floating point"):
            parse_config({**data, key: str(path)})
    save_file(LORA, path)
    parse_config({**data, "validation_adapter_path": str(path), "init_lora": str(path)})
