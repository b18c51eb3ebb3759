"""Hostile and careless input (issue 62 items 3 and 5), through the real CLI in a subprocess where the CLI is the
boundary: a model config of absurd sizes, safetensors headers that lie, cache files that are not the store's own,
and the tracebacks that became messages. Each case names the key or file and what to do, exits 2, no traceback."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.factory import REPO, demo_dict, write_config

GIB = 1 << 30


def run_cli(*args: str, memory: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m loraflow.cli ARGS` in a fresh process (under an address-space cap of `memory` bytes)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "loraflow.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=timeout, preexec_fn=cap if memory else None)


@pytest.fixture
def model(tiny_k5: Path, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint to spoil."""
    return Path(shutil.copytree(tiny_k5, tmp_path / "model"))


def config_file(model: Path, demo_data: Path, root: Path, **overrides: Any) -> Path:
    """The file `factory.config_for` loads, for the CLI and the stages to read."""
    return write_config(root / "config.yaml", demo_dict(model, demo_data, root, **overrides))


def edit_json(path: Path, **values: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


# -- item 3a: a model config's sizes against its family's released ones ----------------------------------------------

@pytest.mark.parametrize(("component", "values", "words"), [
    ("transformer", {"num_visual_blocks": 10**9}, "`num_visual_blocks` is 1000000000; kandinsky5-video's released "
                                                  "transformer configs have 32 to 60, and loraflow builds at most 240"),
    ("vae", {"layers_per_block": 10**9}, "`layers_per_block` is 1000000000; kandinsky5-video's released vae configs "
                                         "have 2, and loraflow builds at most 8"),
    ("vae", {"block_out_channels": [8] * 100_000}, "`block_out_channels (length)` is 100000"),
    ("text_encoder", {"text_config": {"num_hidden_layers": 10**9}}, "`text_config.num_hidden_layers` is 1000000000"),
])
def test_a_model_config_of_absurd_sizes_is_refused_by_check_in_a_small_memory_cap(
        component: str, values: dict, words: str, model: Path, demo_data: Path, tmp_path: Path) -> None:
    """Estimates on (the default): it allocated without bound (2.4 GB in 40 s, then a SystemError under 6 GiB).
    Under 2 GiB of address space torch cannot even be imported: the refusal comes before anything is built."""
    path = model / component / "config.json"
    config = json.loads(path.read_text())
    for key, value in values.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(config))
    result = run_cli("check", str(config_file(model, demo_data, tmp_path)), memory=2 * GIB)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{path}: {words}" in result.stderr and "Traceback" not in result.stderr
    assert "estimates: left out until the model's problems below are fixed" in result.stdout


def test_the_tiny_and_released_configs_are_within_their_bounds(tiny_k5: Path) -> None:
    from loraflow.pipelines.released import FAMILIES, FLAVOURS, HEADROOM, _read, read_model_config, size_problems

    for flavour, parts in FLAVOURS.items():
        for component, stem in parts.items():
            assert size_problems(_read(f"{stem}.{component}.json")["config"], Path("x"), flavour, component) == []
    for component in FLAVOURS["t2v-lite-sft-5s"]:
        config = read_model_config(tiny_k5 / component / "config.json")
        assert size_problems(config, Path("x"), "t2v-lite-sft-5s", component) == []
    assert HEADROOM == 4 and FAMILIES["t2v-lite-sft-5s"] == "kandinsky5-video"


# -- item 3b: safetensors headers that lie ---------------------------------------------------------------------------

def rewrite_header(path: Path, edit: Any) -> None:
    """Rewrite a safetensors file's header by `edit(header)` (in place), keeping its data bytes."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


def first_two(header: dict) -> tuple[dict, dict]:
    entries = sorted((e for n, e in header.items() if n != "__metadata__"), key=lambda e: e["data_offsets"][0])
    return entries[0], entries[1]


def overlap(header: dict) -> None:
    a, b = first_two(header)
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]


def lying_dtype(header: dict) -> None:
    a, _ = first_two(header)
    a["dtype"] = "F16" if a["dtype"] == "F32" else "F32"


def zero_size(header: dict) -> None:
    header["extra.weight"] = {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}


def many(header: dict) -> None:
    header.update({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(100_001)})


def many_dims(header: dict) -> None:
    a, _ = first_two(header)
    a["shape"] = a["shape"] + [1] * 20


@pytest.mark.parametrize(("edit", "words"), [
    (overlap, "where the tensor before it ends at"),
    (lying_dtype, "bytes; F"),
    (zero_size, "tensor 'extra.weight' has shape [0, 4]: it holds no values"),
    (many, "tensors; loraflow reads at most 100000 per file"),
    (many_dims, "not a list of at most 8 sizes"),
])
def test_a_lying_safetensors_header_in_the_model_is_refused_by_check_naming_file_and_tensor(
        edit: Any, words: str, model: Path, demo_data: Path, tmp_path: Path) -> None:
    """They passed `check` and failed late, in the loader (or cost 800 MB and 10-30 s: 10^6 tensors)."""
    (weights,) = (model / "transformer").glob("*.safetensors")
    rewrite_header(weights, edit)
    result = run_cli("check", str(config_file(model, demo_data, tmp_path)), "--no-estimates")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{weights} is not a readable safetensors file" in result.stderr and words in result.stderr
    assert "Traceback" not in result.stderr


# -- item 5: tracebacks that became messages -------------------------------------------------------------------------

@pytest.mark.parametrize(("spoil", "words"), [
    (lambda p: p.write_text(p.read_text()[:40]), "is not a readable model config (not JSON"),
    (lambda p: p.write_text("[1, 2]"), "is not a readable model config (a JSON list, not an object)"),
    (lambda p: p.write_bytes(b"\xff\xfe{}"), "is not a readable model config (not JSON"),
])
def test_an_unreadable_model_config_is_named_by_check(spoil: Any, words: str, model: Path, demo_data: Path,
                                                      tmp_path: Path) -> None:
    path = model / "vae" / "config.json"
    spoil(path)
    result = run_cli("check", str(config_file(model, demo_data, tmp_path)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{path} {words}" in result.stderr and "Traceback" not in result.stderr
