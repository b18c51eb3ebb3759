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


def run_cli(*args: str, memory: int | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m loraflow.cli ARGS` in a fresh process (under an address-space cap of `memory` bytes; with `env`
    over this one's environment)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
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


# -- item 4: finite adapters and renders -----------------------------------------------------------------------------

def lora_of(model: Path, path: Path, fill: float = 0.01, module: str | None = None) -> Path:
    """A diffusers-format LoRA file of rank 2 on the model transformer's first linear layer (or `module`, of a 4x4
    weight: another family's), its values all `fill`."""
    import numpy as np
    from safetensors.numpy import save_file

    from loraflow.safetensors_header import read_header, tensor_entries

    (weights,) = (model / "transformer").glob("*.safetensors")
    shapes = {n: e["shape"] for n, e in tensor_entries(read_header(weights)).items()}
    name = module or next(n.removesuffix(".weight") for n, s in sorted(shapes.items())
                          if n.endswith(".weight") and len(s) == 2)
    out, inner = shapes.get(f"{name}.weight", [4, 4])
    save_file({f"transformer.{name}.lora_A.weight": np.full((2, inner), fill, np.float32),
               f"transformer.{name}.lora_B.weight": np.full((out, 2), fill, np.float32)}, str(path))
    return path


@pytest.mark.parametrize(("make", "words"), [
    (lambda model, path: lora_of(model, path, float("nan")), "2 tensor(s) hold NaN or infinite values (e.g. "
                                                             "transformer."),
    (lambda model, path: lora_of(model, path, float("-inf")), "2 tensor(s) hold NaN or infinite values"),
    (lambda model, path: lora_of(model, path, module="blocks.0.attn.to_q"),
     "adapts 1 module(s) the model's transformer"),
])
def test_a_broken_or_foreign_validation_adapter_is_refused_by_check(make: Any, words: str, model: Path,
                                                                   demo_data: Path, tmp_path: Path) -> None:
    """A NaN adapter rendered an all-black video and the step succeeded; another family's passed `check` and failed
    late in peft. A good one passes."""
    good = lora_of(model, tmp_path / "good.safetensors")
    result = run_cli("check", str(config_file(model, demo_data, tmp_path, validation_adapter_path=str(good))),
                     "--no-estimates")
    assert result.returncode == 0, result.stderr[-2000:]
    bad = make(model, tmp_path / "bad.safetensors")
    result = run_cli("check", str(config_file(model, demo_data, tmp_path, validation_adapter_path=str(bad))),
                     "--no-estimates")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"`validation_adapter_path` {bad}" in result.stderr and words in result.stderr
    assert "Traceback" not in result.stderr


def test_a_render_all_of_one_value_is_flagged() -> None:
    import numpy as np

    from loraflow.contracts.reports import PromptRenders
    from loraflow.validation.validate import flat_renders

    moving = np.random.default_rng(0).integers(0, 255, (5, 8, 8, 3), dtype=np.uint8)
    videos = {"base": moving, "LoRA": np.zeros_like(moving), "grey": np.full_like(moving, 128)}
    assert flat_renders(videos) == ["LoRA", "grey"]
    row = dict(name="a", prompt="a cat", base="b.mp4", lora="l.mp4", contact_sheet="c.png", mean_abs_pixel_change=1.0)
    assert "flat" not in PromptRenders(**row).json_row()  # result.json as it was where nothing is flat
    assert PromptRenders(**row, flat=["LoRA"]).json_row()["flat"] == ["LoRA"]


def test_check_fails_when_a_dataset_ends_with_no_clip(tiny_k5: Path, demo_data: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """`check` exited 0 when every file of a dataset was dropped (training later blamed the eval holdout)."""
    from loraflow.cli import main
    from tests.factory import videos

    data = tmp_path / "uncaptioned"
    videos(data, 2, captions=False)
    settings = demo_dict(tiny_k5, demo_data, tmp_path)
    settings["datasets"].insert(1, {**settings["datasets"][0], "id": "uncaptioned", "instance_data_dir": str(data)})
    assert main(["check", "--no-estimates", str(write_config(tmp_path / "config.yaml", settings))]) == 2
    err = capsys.readouterr().err
    assert "dataset 'uncaptioned': none of its 2 file(s) gives a clip" in err and "`disabled: true`" in err


# -- item 5: the last tracebacks and the wrong words -----------------------------------------------------------------

@pytest.mark.parametrize(("key", "value"), [("model_family", ["x"]), ("model_flavour", ["x"]),
                                            ("model_family", {"a": 1})])
def test_a_family_or_flavour_that_is_no_name_is_named_by_check(key: str, value: Any, tiny_k5: Path, demo_data: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`model_family: [x]` was a TypeError (unhashable type) from the flavour lookup, before validation."""
    from loraflow.cli import main

    assert main(["check", "--no-estimates", str(config_file(tiny_k5, demo_data, tmp_path, **{key: value}))]) == 2
    assert f"{key}: Input should be a valid string (got {value!r})" in capsys.readouterr().err


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: os.mkfifo(p), "is a FIFO (a named pipe), not a file"),
    (lambda p: p.mkdir(), "is a folder, not a file"),
    (lambda p: p.symlink_to("/dev/null"), "is a device, not a file"),
    (lambda p: p.symlink_to(p.with_name("gone.yaml")), "is a link that leads nowhere"),
    (lambda p: None, "does not exist"),
])
def test_a_config_path_that_is_no_file_is_called_what_it_is(make: Any, words: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """A FIFO, a device or a folder given as the config was said not to exist."""
    from loraflow.cli import main

    path = tmp_path / "config.yaml"
    make(path)
    assert main(["check", str(path)]) == 2
    assert f"config file {path} {words}: give the config's YAML or JSON file" in capsys.readouterr().err


def test_a_dataset_folder_become_a_file_after_caching_is_named_by_check(tiny_k5: Path, demo_data: Path,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """The stale-source check raised NotADirectoryError (a regression) when instance_data_dir became a file."""
    from loraflow.cli import main
    from loraflow.config import load_config
    from tests.factory import run_clips

    run_clips(load_config(config_file(tiny_k5, demo_data, tmp_path)))
    settings = demo_dict(tiny_k5, demo_data, tmp_path)
    file = next(demo_data.glob("*.mp4"))
    settings["datasets"][0]["instance_data_dir"] = str(file)
    assert main(["check", "--no-estimates", str(write_config(tmp_path / "file.yaml", settings))]) == 2
    out, err = capsys.readouterr()
    assert f"instance_data_dir {file} is not a folder" in err
    # the folder is another source now, so the cache holds no part of this config's dataset (docs/caches.md: parts
    # are keyed by their sources): nothing cached is stale for it
    assert "source file(s) changed since it was cached" not in out


@pytest.mark.parametrize("text", ['{"step": 3, "optim', "[1, 2]", '{"step": "3", "optimizer": {}, "history": []}'])
def test_a_truncated_checkpoint_state_is_named_with_the_folder_to_delete(text: str, tmp_path: Path) -> None:
    import torch

    from loraflow.training.checkpoints import resume_optimizer

    checkpoint = tmp_path / "checkpoints" / "step-0000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(text)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(RuntimeError) as caught:
        resume_optimizer(checkpoint, optimizer)
    assert f"checkpoint file {checkpoint / 'state.json'} is unreadable (" in str(caught.value)
    assert f"delete its folder {checkpoint} to resume from the one before it" in str(caught.value)


def test_an_s3_cache_that_does_not_answer_is_one_message(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """No network for an s3:// cache_dir was a botocore traceback (EndpointConnectionError). A closed local port
    stands for the network: nothing leaves the machine."""
    config = config_file(tiny_k5, demo_data, tmp_path, cache_dir="s3://loraflow-test-bucket/cache")
    result = run_cli("check", str(config), "--no-estimates", env={
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "loraflow check: the cache (`cache_dir`) did not answer (EndpointConnectionError" in result.stderr
    assert "set `cache_dir` to a local folder" in result.stderr and "Traceback" not in result.stderr


def test_a_text_encoder_config_its_class_refuses_is_named_by_check(model: Path, demo_data: Path,
                                                                  tmp_path: Path) -> None:
    """A value transformers rejects (an unknown rope_type) was a KeyError from inside transformers, in the
    estimates."""
    path = model / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["rope_scaling"] = {"rope_type": "bogus"}
    path.write_text(json.dumps(config))
    result = run_cli("check", str(config_file(model, demo_data, tmp_path)), timeout=600,
                     env={"LORAFLOW_ESTIMATES_CACHE": str(tmp_path / "estimates")})
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"{path}: the transformers class Qwen2_5_VLForConditionalGeneration refuses it (KeyError: 'bogus'): "
            "fix the value it names") in result.stderr
    assert "Traceback" not in result.stderr


# `loraflow cache` on a 200 KiB tmpfs in a mount namespace of its own ($1: the disk): the latents worker fills it.
CACHE_ON_A_FULL_DISK = 'mount -t tmpfs -o size=200k tmpfs "$1" && exec "$2" -m loraflow.cli cache "$3" --dataset "$4"'


def test_cache_on_a_full_disk_is_one_message_per_process(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """The latents worker said the disk was full, then the parent raised a RuntimeError traceback."""
    from tests.factory import missing_input

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--mount", "--map-root-user", "true"]).returncode:
        missing_input("needs a mount namespace (unshare --mount --map-root-user) for a private tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    config = config_file(tiny_k5, demo_data, tmp_path, cache_dir=str(disk / "cache"))
    done = subprocess.run([unshare, "--mount", "--map-root-user", "sh", "-c", CACHE_ON_A_FULL_DISK, "sh", str(disk),
                           sys.executable, str(config), "demo-videos"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"the disk holding {disk}/cache/latents/shards is full" in done.stderr
    assert "loraflow cache: latents worker(s) 0/1 of dataset 'demo-videos' failed" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_video_of_zero_duration_is_named_by_its_frames(tmp_path: Path) -> None:
    """17 frames all at one timestamp were called "9 frames" (or "17 frames at 408 fps"): a rate made up."""
    from fractions import Fraction

    import av

    from loraflow.media.frames import probe
    from loraflow.media.types import MediaError
    from tests.media_factory import index_frame

    path = tmp_path / "still.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in [*range(17), None]:
            frame = None if i is None else av.VideoFrame.from_ndarray(index_frame(i, 96, 64), format="rgb24")
            if frame is not None:
                frame.pts, frame.time_base = 0, Fraction(1, 24)
            for packet in stream.encode(frame):
                packet.pts = packet.dts = 0
                out.mux(packet)
    with pytest.raises(MediaError) as caught:
        probe(path)
    assert caught.value.reason == "zero_duration"
    assert "its 17 frames all carry one timestamp (the video lasts 0 s)" in str(caught.value)


# -- item 5: the abort at exit ---------------------------------------------------------------------------------------

AS_THE_PROCESS = r"""
import atexit, sys
atexit.register(print, "atexit ran", flush=True)
class Finalized:
    def __del__(self):
        print("finalized", flush=True)
kept = Finalized()  # its __del__ runs only when the interpreter finalizes
sys.argv = ["loraflow", *sys.argv[1:]]
from loraflow.cli import main
main()
"""


def test_the_command_exits_without_finalizing_the_interpreter(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """`check` aborted at exit in 2 of ~156 runs ("terminate called without an active exception", exit 134): the
    estimates start torch's autograd device threads (C++, holding Python thread states), and one that wakes while the
    interpreter finalizes is ended by pthread_exit, which aborts in C++ frames (pytorch/pytorch#38228). As the
    process, the command runs atexit's handlers and exits without finalizing, so no thread meets a finalizing
    interpreter. The exit code is kept."""
    for argv, code in ((["check", "--no-estimates", str(config_file(tiny_k5, demo_data, tmp_path))], 0),
                       (["check", str(tmp_path / "none.yaml")], 2)):
        done = subprocess.run([sys.executable, "-c", AS_THE_PROCESS, *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == code, done.stderr[-2000:]
        assert "atexit ran" in done.stdout and "finalized" not in done.stdout


def check_runs(count: int, tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """`count` checks in a row, each computing its estimates afresh (what starts the autograd threads): none aborts."""
    config = config_file(tiny_k5, demo_data, tmp_path)
    for run in range(count):
        result = run_cli("check", str(config), timeout=600,
                         env={"LORAFLOW_ESTIMATES_CACHE": str(tmp_path / f"estimates-{run}")})
        assert result.returncode == 0 and "terminate called" not in result.stderr, (run, result.stderr[-2000:])
        assert "estimates (no model loads" in result.stdout and "reused from" not in result.stdout


def test_ten_checks_in_a_row_exit_cleanly(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    check_runs(10, tiny_k5, demo_data, tmp_path)


@pytest.mark.soak
def test_two_hundred_checks_in_a_row_exit_cleanly(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """The acceptance of issue 62: 200 checks in a row without an abort (`make soak`)."""
    check_runs(200, tiny_k5, demo_data, tmp_path)


# -- item 3: cache files read only when they are the store's own ----------------------------------------------------

def other_table(path: Path) -> None:
    """A Parquet file of another schema than a clips manifest's, in its place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"name": ["a", "b"], "size": [1, 2]}), path)


@pytest.mark.parametrize(("spoil", "words"), [
    (lambda part: part.write_bytes(part.read_bytes()[:100]), "is not readable (ArrowInvalid"),
    (lambda part: other_table(part), "is not a clips manifest loraflow wrote (KeyError"),
])
def test_a_tampered_clips_manifest_is_a_problem_in_check(spoil: Any, words: str, tiny_k5: Path, demo_data: Path,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A truncated manifest crashed `check` (ArrowInvalid); one of another schema was a KeyError naming no file."""
    from loraflow.cli import main
    from loraflow.config import load_config
    from tests.factory import run_clips

    config = config_file(tiny_k5, demo_data, tmp_path)
    _, store = run_clips(load_config(config))
    (part,) = (tmp_path / "cache" / "clips" / "manifest").glob("**/*.parquet")  # keyed: <dataset>/<sources>.parquet
    spoil(part)
    assert main(["check", "--no-estimates", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{part} in the cache {words}" in err and "delete it" in err
