"""`loraflow check` (every problem at once, then the bucket plan) and `loraflow import-simpletuner`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from loraflow.cli import main
from loraflow.config import LoraflowConfig, load_config
from loraflow.config.training_options import trained_with
from loraflow.estimates import CUDA_CONTEXT, FIT_SHARE
from loraflow.simpletuner import import_simpletuner
from loraflow.stages.clips.bucket_plan import human_bytes
from tests.factory import K5_IMAGE_BACKEND, demo_dict, missing_input, write_config

# The seed guides' HunyuanVideo 1.5 config.json and its multidatabackend.json, verbatim.
HV_CONFIG = {
    "model_type": "lora", "model_family": "hunyuanvideo", "pretrained_model_name_or_path": "tencent/HunyuanVideo-1.5",
    "model_flavour": "t2v-480p", "output_dir": "output/hunyuan-video", "validation_resolution": "854x480",
    "validation_num_video_frames": 61, "validation_guidance": 6.0, "train_batch_size": 1,
    "gradient_accumulation_steps": 1, "learning_rate": 1e-4, "mixed_precision": "bf16", "optimizer": "adamw_bf16",
    "lora_rank": 16, "enable_group_offload": True, "group_offload_type": "block_level",
    "dataset_backend_config": "config/multidatabackend.json",
}
HV_BACKEND = [
    {"id": "my-video-dataset", "type": "local", "dataset_type": "video", "instance_data_dir": "datasets/videos",
     "caption_strategy": "textfile", "resolution": 480,
     "video": {"num_frames": 61, "min_frames": 61, "frame_rate": 24, "bucket_strategy": "aspect_ratio"},
     "repeats": 10},
    {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
     "cache_dir": "cache/text/hunyuan", "disabled": False},
]
# The Kandinsky 5 Video guide's settings as SimpleTuner's configure tool writes them (`--flag` keys, string values).
K5_FLAGS = {
    "--model_type": "lora", "--model_family": "kandinsky5-video", "--model_flavour": "t2v-lite-sft-5s",
    "--pretrained_model_name_or_path": "models/k5", "--train_batch_size": 1, "--validation_resolution": "512x768",
    "--validation_num_video_frames": 61, "--validation_guidance": 5.0, "--offload_during_startup": "true",
    "--vae_enable_patch_conv": "true", "--data_backend_config": "config/multidatabackend.json",
    "--tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]},
    "--report_to": "comet_ml", "--push_to_hub": "false",  # values and keys loraflow has no use for
}


# -- check -----------------------------------------------------------------------------------------
def test_check_prints_every_config_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "broken.yaml", {
        "model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tmp_path),
        "lora_rnk": 4, "validation_resolution": "wide",
        "datasets": [{"id": "v", "instance_data_dir": str(tmp_path), "video": {"num_frames": 16}}],
    })
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err
    assert "lora_rnk: unknown key; did you mean 'lora_rank'?" in err
    assert "validation_resolution: `validation_resolution` must look like 768x512" in err
    assert "datasets[0].video.num_frames: `num_frames - 1` must be divisible by 4" in err and "Use 13 or 17" in err


def test_check_names_a_missing_model_and_a_missing_dataset_folder_together(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "config.yaml", {
        "model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tmp_path / "no-model"),
        "datasets": [{"id": "gone", "instance_data_dir": str(tmp_path / "no-data")}],
    })
    assert main(["check", str(config)]) == 2
    out, err = capsys.readouterr()
    assert "2 problem(s)" in err
    assert "no-model is not a diffusers checkpoint folder" in err
    assert "dataset 'gone': instance_data_dir" in err and "no-data is not a folder" in err
    # a local folder is not the released repository: no released config stands in for its config.json
    assert "estimate needs the model's config files" in out


def test_check_into_a_pipe_whose_reader_left_exits_1_without_a_traceback(tmp_path: Path) -> None:
    """`loraflow check CONFIG | head -1`: the reader gone, check's next write meets a closed pipe; it exits 1 and
    prints no BrokenPipeError traceback. The read end is closed before the child starts, and `-u` makes check's first
    line (config ok) a write of its own, as the line past stdout's buffer is in a long report: a broken pipe on the
    first line, every run. Seen failing without the handler in `run_command`: the traceback on stderr."""
    import os
    import subprocess
    import sys

    from tests.factory import REPO

    config = write_config(tmp_path / "config.yaml", {
        "model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tmp_path / "no-model"),
        "datasets": [{"id": "gone", "instance_data_dir": str(tmp_path / "no-data")}],
    })
    child = subprocess.Popen([sys.executable, "-u", "-m", "loraflow.cli", "check", str(config)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout is not None
    child.stdout.close()  # the reader leaves before check writes a line
    err = child.communicate(timeout=600)[1]
    assert child.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]


def test_a_broken_pipe_that_is_not_stdouts_is_not_swallowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a stdout whose reader left ends the command quietly: a pipe of the command's own that breaks (a worker's)
    is an error, raised as it came. Seen swallowed when the handler took every BrokenPipeError."""
    import loraflow.cli as cli

    def broken(*args: object, **kwargs: object) -> int:
        raise BrokenPipeError(32, "a worker's pipe")

    monkeypatch.setattr(cli, "check", broken)
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        cli.run_command(["check", str(tmp_path / "config.yaml")])


def test_check_prints_the_bucket_plan_and_dropped_files(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    (data / "broken.mp4").write_bytes(b"this is not a video")
    (data / "broken.txt").write_text("a broken video")
    shutil.copyfile(next(data.glob("*.mp4")), data / "uncaptioned.mp4")
    settings = demo_dict(tiny_k5, data, tmp_path)
    config = write_config(tmp_path / "config.yaml", settings)
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "config ok" in out
    plan = out.split("bucket plan")[1].split("total:")[0]
    buckets = [line.split() for line in plan.splitlines()[2:] if line.strip()]
    assert {row[0] for row in buckets} == {"demo-videos"}
    frames = {int(row[1].split("@")[1]) for row in buckets}
    assert frames == {17, 1}  # 17-frame clips of the videos, 1-frame clips of the stills
    for _, bucket, clips, *sizes in buckets:
        size, count = bucket.split("@")
        width, height = (int(v) for v in size.split("x"))
        latent = 16 * ((int(count) - 1) // 4 + 1) * (height // 8) * (width // 8) * 4 * int(clips)  # C, T, H/8, W/8
        frames_bytes = int(count) * height * width * 3 * int(clips)
        assert " ".join(sizes) == f"{human_bytes(frames_bytes)} {human_bytes(latent)}", bucket
    dropped = {line.split()[1]: line.split()[2] for line in out.split("dropped 2 file(s):")[1].splitlines()[2:]}
    assert dropped == {"broken.mp4": "not_media", "uncaptioned.mp4": "missing_caption"}
    assert not (tmp_path / "cache").exists()  # planning writes nothing


def test_check_shows_no_library_warning_of_its_fake_run(tiny_k5: Path, demo_data: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """An fp8 base with its kept modules in bf16 makes torch's rms_norm warn on the fake step (input and weight
    dtypes differ, no fused kernel): check's output shows no such warning (it printed above the table). Seen failing
    without the filter in `estimates.remembered`: torch's UserWarning recorded."""
    import warnings

    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path, gpu_memory_gb=24,
                                                              base_model_precision="fp8-layerwise",
                                                              fp32_modules_storage="bf16"))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert main(["check", str(config)]) == 0
    assert "validation" in capsys.readouterr().out
    assert [str(w.message) for w in shown if "torch" in w.filename or "diffusers" in w.filename] == []


def test_check_prints_the_estimates_and_the_switch_that_fits_the_named_card(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A card (`gpu_memory_gb`) whose usable share (90%, less 0.5 GiB of CUDA context) is between the tiny step's
    estimate with and without gradient checkpointing (tests/estimates/ measures both): check says training is
    short of it and that checkpointing fits."""
    # 0.0012 GiB usable: the tiny step estimates 0.00169 GiB, 0.000988 with checkpointing (with Kandinsky 5 Video's
    # 256 text tokens since issue 44)
    card = (0.0012 * 2**30 + CUDA_CONTEXT) / FIT_SHARE / 2**30
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path, gpu_memory_gb=card))
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out.split("estimates (no model loads")[1]
    assert "fit: ✓: the peak + 0.5 GiB of CUDA context is under 90% of the card; tight: under all of it" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[4:8]}
    assert set(rows) == {"latents", "text_embeds", "lora", "validation"}
    assert rows["lora"][3:9] == ["✓"] * 6  # MBs fit every card
    assert "lora needs 0.00" in out and f"{card:.3g} GB (gpu_memory_gb) is short" in out
    switches = {line.split(":")[0].strip(): line.split()[-1] for line in out.splitlines() if "GiB" in line[40:]}
    # adamw_bf16 alone does not fit with the margin (on a card this small, within the whole of it: "tight")
    assert switches["gradient_checkpointing"] == "fits" and switches["optimizer"] != "fits"


def test_a_second_check_of_an_unchanged_config_reuses_its_estimates_and_a_changed_one_does_not(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """check's fake-tensor traces take minutes at released size (issue 41): the estimate and its switch list are
    kept in the user's cache folder under a key of the config, the model configs, the bucket, the card and
    loraflow's code, and read back by the next check of the same config: the same table. Another rank is estimated
    anew. The project's cache folder stays unwritten (planning writes nothing)."""
    monkeypatch.setenv("LORAFLOW_ESTIMATES_CACHE", str(tmp_path / "user-cache"))
    card = (0.0012 * 2**30 + CUDA_CONTEXT) / FIT_SHARE / 2**30  # short for training: the switches are listed too
    settings = demo_dict(tiny_k5, demo_data, tmp_path, gpu_memory_gb=card)
    config = write_config(tmp_path / "config.yaml", settings)
    outputs = []
    for _ in range(2):
        assert main(["check", str(config)]) == 0
        outputs.append(capsys.readouterr().out.split("estimates (no model loads")[1])
    first, second = outputs
    assert "reused from" not in first and "reused from" in second
    remembered = {p.name.split("-")[0] for p in (tmp_path / "user-cache").iterdir()}
    assert remembered == {"stages", "switches"} and not (tmp_path / "cache").exists()
    assert [ln for ln in second.splitlines() if "reused from" not in ln] == first.splitlines()
    other = write_config(tmp_path / "other.yaml", {**settings, "lora_rank": settings.get("lora_rank", 8) * 2})
    assert main(["check", str(other)]) == 0
    assert "reused from" not in capsys.readouterr().out


def test_a_remembered_estimate_is_estimated_anew_under_changed_code_or_another_flavour(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a remembered estimate holds loraflow's `code_version`: a copy of the package has this one, a copy
    with one source file changed has another, and under another version `remembered` computes anew; so it does for
    the same config with another flavour."""
    import importlib

    from loraflow.estimates import StageEstimate

    memory = importlib.import_module("loraflow.estimates.remembered")  # the module: the package names its function

    monkeypatch.setenv("LORAFLOW_ESTIMATES_CACHE", str(tmp_path / "user-cache"))
    same, edited = (shutil.copytree(memory.PACKAGE, tmp_path / copy / "loraflow",
                                    ignore=shutil.ignore_patterns("__pycache__")) for copy in ("same", "edited"))
    with (edited / "estimates" / "stages.py").open("a") as source:
        source.write("# a comment is a change too\n")
    this, changed = memory.code_version(), memory.code_version(edited)
    assert memory.code_version(same) == this != changed
    settings = demo_dict(tiny_k5, demo_data, tmp_path)
    configs = {flavour: load_config(write_config(tmp_path / f"{flavour}.yaml", {**settings, "model_flavour": flavour}))
               for flavour in ("t2v-lite-sft-5s", "t2v-lite-pretrain-5s")}
    computed = []
    for version, flavour in ((this, "t2v-lite-sft-5s"), (this, "t2v-lite-sft-5s"), (changed, "t2v-lite-sft-5s"),
                             (this, "t2v-lite-pretrain-5s")):
        monkeypatch.setattr(memory, "code_version", lambda version=version: version)
        memory.remembered(configs[flavour], "stages", {},
                          lambda: computed.append((version, flavour)) or [StageEstimate("lora")])
    assert computed == [(this, "t2v-lite-sft-5s"), (changed, "t2v-lite-sft-5s"), (this, "t2v-lite-pretrain-5s")]


# `loraflow check` in a fresh interpreter, then which model libraries it imported.
CHECK_AND_IMPORTS = """
import sys
from loraflow.cli import main

code = main(["check", sys.argv[1]])
print("heavy:", sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("card", ["gpu_memory_gb", "this machine's"])
def test_a_second_check_finds_its_estimates_without_importing_torch(
        card: str, tiny_k5: Path, demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second check of an unchanged config reads its remembered estimates (the table and, for a card training
    does not fit, the switch lists) without importing torch, diffusers or transformers (seconds of the check's
    second or two otherwise), and prints the first check's table. The card: `gpu_memory_gb` (short for training:
    the switches are listed too), or none set on a machine without a GPU device (`no_gpu_device`: the demo's case)."""
    import os
    import subprocess
    import sys

    from loraflow.estimates.fit import no_gpu_device
    from tests.factory import REPO

    if card != "gpu_memory_gb" and not no_gpu_device():
        pytest.skip("this machine has a GPU device: its card is torch's to tell")
    monkeypatch.setenv("LORAFLOW_ESTIMATES_CACHE", str(tmp_path / "user-cache"))
    small = {"gpu_memory_gb": (0.0012 * 2**30 + CUDA_CONTEXT) / FIT_SHARE / 2**30} if card == "gpu_memory_gb" else {}
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path, **small))
    assert main(["check", str(config)]) == 0
    first = capsys.readouterr().out.split("estimates (no model loads")[1]
    assert ("is short. Switches" in first) == bool(small)
    second = subprocess.run([sys.executable, "-c", CHECK_AND_IMPORTS, str(config)], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1] == "heavy: []"
    out = second.stdout.split("estimates (no model loads")[1]
    assert "reused from" in out
    assert [ln for ln in out.splitlines() if "reused from" not in ln] == first.splitlines()


def test_check_estimates_an_imported_seed_guide_from_the_released_configs_before_download_or_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kandinsky 5 Video guide imported as its reader would (no model downloaded, no clips yet): check
    estimates every stage from loraflow's released config files, at the bucket the dataset asks for."""
    from tests.factory import GUIDES, SEEDS, combine

    guide = next((g for g in GUIDES if "`model_family`: `kandinsky5-video`" in g.read_text()), None)
    if guide is None:
        missing_input(f"no Kandinsky 5 Video seed guide in {SEEDS} (the shared folder beside the repository)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: the model is not on disk
    settings, backends = combine(guide, tmp_path, with_i2v=False)
    (tmp_path / "config.json").write_text(json.dumps(settings))
    (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))
    config = tmp_path / "config.yaml"
    assert main(["import-simpletuner", str(tmp_path / "config.json"), str(tmp_path / "multidatabackend.json"),
                 "-o", str(config)]) == 0
    assert main(["check", str(config)]) == 2  # the model is not in the cache, the dataset folder is not there
    out = capsys.readouterr().out.split("estimates (no model loads")[1]
    assert "k5-video-lite-5s.transformer.json, hunyuanvideo.vae.json" in out
    assert "no clips yet: estimated at the bucket the datasets ask for (512x512@61" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[6:10]}
    assert set(rows) == {"latents", "text_embeds", "lora", "validation"}
    # bf16 Lite (2.01B parameters: 3.7 GiB) + its AdamW-trained LoRA + activations; not a '-' row
    assert all(float(row[1]) > 3.7 for row in rows.values()), rows


@pytest.mark.parametrize(("flavour", "billions"), [("lite-t2v", 3.2), ("pro-distill-i2v", 30.1)])
def test_check_estimates_kandinsky6_at_released_size_before_download(
        flavour: str, billions: float, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kandinsky 6 Lite and Pro by their repository ids, not downloaded: check estimates training (the lora stage)
    and a validation render from loraflow's released Kandinsky 6 config files, Pro's π-Flow head and i2v tail frame
    included; each row at least the transformer's bf16 weights (3.2B / 30.1B parameters, test_released). With
    `train_audio` the output says the estimate leaves the sound out."""
    from loraflow.pipelines import family_flavour

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: the model is not on disk
    monkeypatch.setenv("LORAFLOW_ESTIMATES_CACHE", str(tmp_path / "estimates"))
    repo = family_flavour("kandinsky6", flavour).repo
    config = write_config(tmp_path / "k6.yaml", {
        "model_family": "kandinsky6", "model_flavour": flavour, "pretrained_model_name_or_path": repo,
        "base_model_precision": "bf16", "gradient_checkpointing": True, "validation_resolution": "768x512",
        "validation_num_video_frames": 121, "train_audio": True,
        "datasets": [{"id": "clips", "instance_data_dir": str(tmp_path / "clips"), "resolution": 512,
                      "video": {"num_frames": 61, "min_frames": 61}}]})
    assert main(["check", str(config)]) == 2  # the model is not in the cache, the dataset folder is not there
    printed = capsys.readouterr()
    # the released config's `is_multimodal`, which diffusers 0.42.1's class does not take, logged per fake model
    assert "are not expected and will be ignored" not in printed.out + printed.err
    out = printed.out.split("estimates (no model loads")[1]
    transformer = f"k6-{flavour.split('-')[0]}{'-distill' if '-distill-' in flavour else ''}.transformer.json"
    assert transformer in out and "1024 text tokens" in out
    assert "train_audio: the picture only" in out  # what the numbers leave out of a run with sound
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["lora"], ["validation"])}
    weights = billions * 1e9 * 2 / 2**30
    assert set(rows) == {"lora", "validation"} and all(float(row[1]) > weights for row in rows.values()), rows


# -- partitions ------------------------------------------------------------------------------------
def test_demo_over_another_tiny_checkpoint_says_what_to_delete(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo builds the tiny world (`world=True`); a folder holding the random tiny model is refused, not used."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    config = write_config(tmp_path / "demo.yaml", demo_dict(tiny_k5, demo_data, tmp_path, base="configs/demo.yaml"))
    assert main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"demo: {tiny_k5} was built by kandinsky5-video t2v v1 (seed 0)" in err
    assert "delete the folder to build it again" in err and "Traceback" not in err


def test_partitions_follow_the_configs_training_datasets(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster import DagsterInstance

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    entries = [{"id": name, "instance_data_dir": str(tmp_path)} for name in ("cats", "dogs")]
    base = {"model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tmp_path),
            "datasets": [*entries, {"id": "texts", "dataset_type": "text_embeds"}]}
    config = write_config(tmp_path / "config.yaml", base)
    assert main(["partitions", str(config)]) == 0
    assert "cats, dogs (added: cats, dogs; deleted: none)" in capsys.readouterr().out  # text_embeds: no partition
    write_config(config, {**base, "datasets": [entries[0], {**entries[1], "disabled": True}]})
    assert main(["partitions", str(config)]) == 0
    assert "cats (added: none; deleted: dogs)" in capsys.readouterr().out
    with DagsterInstance.get() as instance:  # stored in DAGSTER_HOME, where `dagster asset materialize` looks
        assert instance.get_dynamic_partitions("datasets") == ["cats"]
    assert main(["partitions", str(tmp_path / "missing.yaml")]) == 2


# -- import-simpletuner ----------------------------------------------------------------------------
def _write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_hunyuan_seed_config_round_trips_and_reports_unmapped_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_json = _write_json(tmp_path / "config" / "config.json", HV_CONFIG)
    backend = _write_json(tmp_path / "config" / "multidatabackend.json", HV_BACKEND)
    out = tmp_path / "imported.yaml"
    assert main(["import-simpletuner", str(config_json), str(backend), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    # Every seed key is carried with its value or reported; which depends on what the config model has today.
    consumed = {"model_type", "model_family", "dataset_backend_config"}
    unmapped = {k for k in HV_CONFIG if k not in LoraflowConfig.model_fields} - consumed
    assert "optimizer" not in unmapped  # adamw_bf16 is carried over (checked below with every kept key)
    reported = {line.split(" = ")[0].removeprefix("  - ") for line in err.splitlines() if line.startswith("  - ")}
    assert reported == unmapped
    for key in unmapped:
        assert f"#   {key} = " in out.read_text(), key  # kept as a comment in the file too
    # the guide's repository is not in the diffusers layout: the flavour's diffusers-format one, said in a note
    assert "imported as 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'" in err
    config = load_config(out)
    assert config.model_family == "hunyuanvideo-1.5"
    assert config.pretrained_model_name_or_path == "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    for key, value in HV_CONFIG.items():
        if key not in consumed | unmapped | {"pretrained_model_name_or_path", "validation_resolution"}:
            assert getattr(config, key) == value, key
    # 854 is no multiple of 16: validation would refuse it, so loading does; the importer takes the nearest
    assert config.validation_resolution == "848x480"
    assert "validation_resolution 854x480 became 848x480: hunyuanvideo-1.5 renders multiples of 16" in err
    video, text = config.datasets
    dumped = video.model_dump()
    dumped["video"] = {k: dumped["video"][k] for k in HV_BACKEND[0]["video"]}
    assert {k: dumped[k] for k in HV_BACKEND[0]} == HV_BACKEND[0]  # every dataset key, the video block included
    assert (text.id, text.dataset_type, text.cache_dir, text.default) == ("text-embeds", "text_embeds",
                                                                          "cache/text/hunyuan", True)


def test_flag_style_config_finds_its_backend_file_and_translates_crop(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_json = _write_json(tmp_path / "st" / "config" / "config.json", K5_FLAGS)  # SimpleTuner's layout
    _write_json(tmp_path / "st" / "config" / "multidatabackend.json", K5_IMAGE_BACKEND)
    assert main(["import-simpletuner", str(config_json)]) == 0
    captured = capsys.readouterr()
    imported = yaml.safe_load(captured.out)
    assert imported["offload_during_startup"] == "true"  # carried as written; the config model parses it
    # crop: true without crop_style: SimpleTuner's default random (data_backend/factory.py:560), not center
    assert (imported["datasets"][0]["crop_style"], imported["datasets"][0]["crop_aspect"]) == ("random", "square")
    unmapped = [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("  - ")]
    assert unmapped == ["  - report_to = 'comet_ml'", "  - push_to_hub = 'false'"]
    config = load_config(write_config(tmp_path / "out.yaml", imported))
    assert config.vae_enable_patch_conv and config.offload_during_startup
    assert config.tread_config is not None and config.tread_config.routes[0].selection_ratio == 0.5
    assert (config.model_family, config.model_flavour, config.validation_num_video_frames) == (
        "kandinsky5-video", "t2v-lite-sft-5s", 61)


def test_import_fails_clearly_without_a_dataset_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_json = _write_json(tmp_path / "config.json", {"model_family": "kandinsky5-video",
                                                          "data_backend_config": "config/missing.json"})
    assert main(["import-simpletuner", str(config_json)]) == 2
    assert "config/missing.json, which does not exist" in capsys.readouterr().err


def test_import_refuses_to_overwrite_a_file_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_json = _write_json(tmp_path / "config" / "config.json", HV_CONFIG)
    backend = _write_json(tmp_path / "config" / "multidatabackend.json", HV_BACKEND)
    out = tmp_path / "mine.yaml"
    out.write_text("# my own config, edited for hours\n")
    assert main(["import-simpletuner", str(config_json), str(backend), "-o", str(out)]) == 2
    assert out.read_text() == "# my own config, edited for hours\n"
    assert f"{out} exists" in capsys.readouterr().err
    assert main(["import-simpletuner", str(config_json), str(backend), "-o", str(out), "--force"]) == 0
    assert load_config(out).model_family == "hunyuanvideo-1.5"


def test_quantised_base_precision_is_reported_and_supported_ones_are_kept() -> None:
    quantised = import_simpletuner({"model_family": "kandinsky5-video", "base_model_precision": "int4-quanto"}, [])
    assert "base_model_precision" not in quantised.config
    [(key, value, why)] = quantised.unmapped
    assert (key, value) == ("base_model_precision", "int4-quanto") and "int8-torchao" in why
    int8 = import_simpletuner({"model_family": "kandinsky5-video", "base_model_precision": "int8-quanto"}, [])
    assert int8.config["base_model_precision"] == "int8-quanto" and "int8-torchao" in int8.notes[0]
    kept = import_simpletuner({"model_family": "kandinsky5-video", "base_model_precision": "fp8-layerwise"}, [])
    assert kept.config["base_model_precision"] == "fp8-layerwise" and not kept.unmapped


def test_k5_image_guides_quantisation_block_imports_to_a_valid_config() -> None:
    """Seed guide 002's block, verbatim: `no_change` is fp32, the rest is reported with what to use instead."""
    block = {"base_model_precision": "int8-quanto", "text_encoder_1_precision": "no_change",
             "text_encoder_2_precision": "no_change", "lora_rank": 16, "base_model_default_dtype": "bf16"}
    imported = import_simpletuner({"model_family": "kandinsky5-image", **block}, K5_IMAGE_BACKEND)
    unmapped = {key: why for key, _, why in imported.unmapped if key in block}
    assert set(unmapped) == {"text_encoder_2_precision", "base_model_default_dtype"}
    assert all(why != "no loraflow equivalent" for why in unmapped.values())
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m",
                                            "output_dir": "o"})
    assert (config.text_encoder_1_precision, config.base_model_precision) == ("fp32", "int8-quanto")
    int8 = import_simpletuner({"model_family": "kandinsky5-image", "text_encoder_1_precision": "int8-quanto"}, [])
    assert int8.config["text_encoder_1_precision"] == "int8-torchao" and "int8" in int8.notes[0]
    int4 = import_simpletuner({"model_family": "kandinsky5-image", "text_encoder_1_precision": "int4-quanto"}, [])
    assert "text_encoder_1_precision" not in int4.config and int4.unmapped[0][0] == "text_encoder_1_precision"


def test_an_i2i_backend_keeps_its_conditioning_dataset_and_pairing() -> None:
    """SimpleTuner's edit-dataset layout: the image dataset names its `dataset_type: conditioning` sources."""
    backend = [{"id": "edits", "type": "local", "dataset_type": "image", "instance_data_dir": "data/edits",
                "conditioning_data": "edit-sources", "caption_strategy": "textfile", "resolution": 1024},
               {"id": "edit-sources", "type": "local", "dataset_type": "conditioning",
                "instance_data_dir": "data/sources"}]
    imported = import_simpletuner({"model_family": "kandinsky5-image", "model_flavour": "i2i-lite-sft"}, backend)
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    (edits,) = config.training_datasets
    assert config.source_images(edits).instance_data_dir == "data/sources"
    other = import_simpletuner({"model_family": "kandinsky5-video", "model_flavour": "i2v-lite-5s"}, backend)
    assert "conditioning_data" not in other.config["datasets"][0]  # SimpleTuner's i2v/ControlNet pairing
    assert [key for key, _, _ in other.unmapped] == ["datasets[0].conditioning_data"]


def test_resolution_and_minimum_image_size_are_carried_in_pixels_and_converted_from_megapixels() -> None:
    backend = [{"id": "px", "type": "local", "dataset_type": "video", "instance_data_dir": "a", "resolution": 480,
                "resolution_type": "pixel_area", "minimum_image_size": 480},
               {"id": "mp", "type": "local", "dataset_type": "video", "instance_data_dir": "b", "resolution": 1.05,
                "resolution_type": "area", "minimum_image_size": 1.05}]
    imported = import_simpletuner({"model_family": "kandinsky5-video"}, backend)
    px, mp = imported.config["datasets"]
    assert (px["resolution_type"], px["resolution"], px["minimum_image_size"]) == ("pixel_area", 480, 480)
    side = 1025  # sqrt(1.05e6) = 1024.7: SimpleTuner's megapixels are 1000**2 pixels (its pixel_area conversion)
    assert (mp["resolution_type"], mp["resolution"], mp["minimum_image_size"]) == ("area", side, side)
    assert not imported.unmapped and sum("megapixels" in note for note in imported.notes) == 2
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    assert [d.minimum_image_size for d in config.datasets] == [480, side]


def test_aspect_limits_are_carried_under_simpletuners_names() -> None:
    backend = [{"id": "v", "type": "local", "dataset_type": "video", "instance_data_dir": "a",
                "minimum_aspect_ratio": 0.5, "maximum_aspect_ratio": 2.4}]
    imported = import_simpletuner({"model_family": "kandinsky5-video"}, backend)
    (dataset,) = imported.config["datasets"]
    assert (dataset["minimum_aspect_ratio"], dataset["maximum_aspect_ratio"]) == (0.5, 2.4)
    assert not imported.unmapped
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    assert (config.datasets[0].minimum_aspect_ratio, config.datasets[0].maximum_aspect_ratio) == (0.5, 2.4)


def test_the_guides_training_features_import_under_their_names() -> None:
    """CREPA, scheduled sampling, the optimizer and report_to keep SimpleTuner's names; unipc rolls out with Euler;
    values loraflow lacks are reported."""
    guide = {"model_family": "kandinsky5-video", "crepa_enabled": True, "crepa_block_index": 8, "crepa_lambda": 0.5,
             "crepa_adjacent_distance": 1, "crepa_adjacent_tau": 1.0, "crepa_encoder": "dinov2_vitg14",
             "crepa_encoder_image_size": 518, "scheduled_sampling_max_step_offset": 10,
             "scheduled_sampling_probability": 0.5, "scheduled_sampling_sampler": "unipc", "optimizer": "adamw_bf16",
             "report_to": "wandb"}
    imported = import_simpletuner(guide, K5_IMAGE_BACKEND)
    assert imported.config["scheduled_sampling_sampler"] == "euler"
    assert imported.unmapped == []  # every guide key here, and the backend's crop_aspect, carried over
    assert {k: imported.config[k] for k in guide if k != "scheduled_sampling_sampler"} == {
        k: v for k, v in guide.items() if k != "scheduled_sampling_sampler"}
    assert any("crepa_encoder_path" in note for note in imported.notes)
    assert any("'unipc' became 'euler'" in note for note in imported.notes)
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m",
                                            "output_dir": "o", "crepa_encoder_path": "teacher"})
    assert (config.crepa_block_index, config.optimizer, config.report_to) == (8, "adamw_bf16", "wandb")
    other = import_simpletuner({"model_family": "kandinsky5-video", "optimizer": "optimi-lion"}, [])
    assert other.unmapped[0][:2] == ("optimizer", "optimi-lion") and "adamw_bf16" in other.unmapped[0][2]


def test_the_peers_memory_switches_import_onto_loraflows() -> None:
    """SimpleTuner's interval and regional compile keep their names, musubi-tuner's activation offload too; block
    swap (SimpleTuner's musubi_blocks_to_swap, musubi's blocks_to_swap) becomes loraflow's blocks_to_swap, 0 stays
    off, and beside enable_group_offload (every block) is left out."""
    guide = {"model_family": "kandinsky5-video", "gradient_checkpointing": True, "gradient_checkpointing_interval": 2,
             "gradient_checkpointing_cpu_offload": True, "dynamo_use_regional_compilation": True,
             "musubi_blocks_to_swap": 8}
    imported = import_simpletuner(guide, K5_IMAGE_BACKEND)
    assert imported.unmapped == []
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m",
                                            "output_dir": "o"})
    assert (config.gradient_checkpointing_interval, config.gradient_checkpointing_cpu_offload,
            config.dynamo_use_regional_compilation) == (2, True, True)
    assert (config.blocks_to_swap, config.enable_group_offload) == (8, False)
    assert any("musubi_blocks_to_swap 8 became blocks_to_swap 8" in note for note in imported.notes)
    assert "blocks_to_swap" not in import_simpletuner({"blocks_to_swap": 0}, []).config
    both = import_simpletuner({"blocks_to_swap": 4, "enable_group_offload": True}, [])
    assert "blocks_to_swap" not in both.config and both.unmapped[0][:2] == ("blocks_to_swap", 4)
    assert import_simpletuner({"blocks_to_swap": -1}, []).unmapped[0][:2] == ("blocks_to_swap", -1)


# The peers' names for issue 33's releases -> loraflow's flavour: musubi-tuner's `--task` (kandinsky5/configs.py)
# and SimpleTuner's hunyuanvideo flavours (helpers/models/hunyuanvideo/model.py), which are loraflow's own.
PEER_NAMES = [
    ("kandinsky5-video", "k5-lite-t2v-5s-distil-sd", "t2v-lite-distilled16steps-5s"),
    ("kandinsky5-video", "k5-lite-t2v-10s-distil-sd", "t2v-lite-distilled16steps-10s"),
    ("kandinsky5-video", "k5-lite-t2v-5s-nocfg-sd", "t2v-lite-nocfg-5s"),
    ("kandinsky5-video", "k5-lite-t2v-10s-nocfg-sd", "t2v-lite-nocfg-10s"),
    ("kandinsky5-video", "k5-lite-t2v-5s-sd", "t2v-lite-sft-5s"),
    ("kandinsky5-video", "k5-lite-i2v-5s-sd", "i2v-lite-5s"),
    ("hunyuanvideo", "t2v-480p-distilled", "t2v-480p-distilled"),
    ("hunyuanvideo", "i2v-480p-distilled", "i2v-480p-distilled"),
    ("hunyuanvideo", "i2v-720p-distilled", "i2v-720p-distilled"),
]


@pytest.mark.parametrize("family, peer, flavour", PEER_NAMES, ids=[p[1] for p in PEER_NAMES])
def test_the_peers_flavour_names_import_as_loraflows(family: str, peer: str, flavour: str) -> None:
    imported = import_simpletuner({"model_family": family, "model_flavour": peer}, HV_BACKEND)
    assert imported.config["model_flavour"] == flavour
    assert (peer != flavour) == any("musubi-tuner" in note for note in imported.notes)
    config = LoraflowConfig.model_validate({**imported.config, "output_dir": "o"})  # the flavour's repository
    assert config.flavour.name == flavour and config.pretrained_model_name_or_path == config.flavour.repo
    if peer != flavour:  # written straight into a loraflow config, the peer's name is refused with loraflow's
        with pytest.raises(ValueError, match=f"musubi-tuner's name for '{flavour}'"):
            LoraflowConfig.model_validate({**imported.config, "model_flavour": peer, "output_dir": "o"})




def test_loss_optimizer_and_flow_schedule_options_import_under_their_names() -> None:
    """Issue 32 B: SimpleTuner's loss, optimizer and flow-schedule keys carried as they are (musubi-tuner's
    loraplus_lr_ratio and min/max_timestep too); a static shift beside the auto shift keeps the one SimpleTuner
    applies; optimizer variants loraflow lacks are named with what to set instead."""
    guide = {"model_family": "kandinsky5-video", "loss_type": "huber", "huber_c": 0.05, "huber_schedule": "exponential",
             "optimizer": "adamw_schedulefree", "flow_use_beta_schedule": True, "flow_beta_schedule_alpha": 1.5,
             "flow_beta_schedule_beta": 3.0, "loraplus_lr_ratio": 16, "min_timestep": 100, "max_timestep": 900}
    imported = import_simpletuner(guide, K5_IMAGE_BACKEND)
    assert imported.unmapped == [] and {k: imported.config[k] for k in guide} == guide
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    assert (config.loss_type, config.huber_schedule, config.flow_beta_schedule_beta) == ("huber", "exponential", 3.0)
    assert trained_with(config) == {"optimizer": "adamw_schedulefree + LoRA+ (lora_B at 16 x the learning rate)",
                                    "loss_type": "huber (huber_c 0.05, exponential schedule)"}  # the lora asset's
    for optimizer in ("prodigy", "muon"):
        assert import_simpletuner({"optimizer": optimizer}, []).config["optimizer"] == optimizer
    auto = import_simpletuner({"flow_schedule_auto_shift": True, "flow_schedule_shift": 0}, [])
    assert auto.config["flow_schedule_auto_shift"] is True and "flow_schedule_shift" not in auto.config
    assert auto.unmapped[0][0] == "flow_schedule_shift" and "auto shift" in auto.unmapped[0][2]
    static = import_simpletuner({"flow_schedule_auto_shift": True, "flow_schedule_shift": 2.0}, [])
    assert static.config["flow_schedule_shift"] == 2.0 and "flow_schedule_auto_shift" not in static.config
    assert static.unmapped[0][0] == "flow_schedule_auto_shift"
    for variant in ("sdnq-muon", "adamw_schedulefree+no_kahan", "adamw_schedulefree+aggressive"):
        (key, value, why), = import_simpletuner({"optimizer": variant}, []).unmapped
        assert (key, value) == ("optimizer", variant) and "set optimizer: " in why


def test_check_names_the_attention_kernel_and_what_hunyuanvideo_t2v_leaves_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """HunyuanVideo 1.5 720p t2v by its repository id, not downloaded: check says which attention kernel `auto`
    takes on the card, and the attention FLOPs a step saves by leaving out the 729 zero image tokens (no mask at
    batch 1: pipelines/hunyuanvideo15/attention.py), by the SDPA formula over the released config's 54 blocks of 16
    heads of 128 (released/hv15-720p-t2v.transformer.json), computed here on its own."""
    from loraflow.pipelines import family_flavour

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: the model is not on disk
    monkeypatch.setenv("LORAFLOW_ESTIMATES_CACHE", str(tmp_path / "estimates"))
    config = write_config(tmp_path / "hv.yaml", {
        "model_family": "hunyuanvideo-1.5", "model_flavour": "t2v-720p",
        "pretrained_model_name_or_path": family_flavour("hunyuanvideo-1.5", "t2v-720p").repo,
        "base_model_precision": "fp8-layerwise", "gradient_checkpointing": True, "validation_resolution": "768x512",
        "datasets": [{"id": "clips", "instance_data_dir": str(tmp_path / "clips"), "resolution": 512,
                      "video": {"num_frames": 61, "min_frames": 61}}]})
    assert main(["check", str(config)]) == 2  # the model is not in the cache, the dataset folder is not there
    out = capsys.readouterr().out.split("estimates (no model loads")[1]
    assert "attention kernel: auto: on CUDA the first of sdpa_cudnn, sdpa_flash" in out
    video = 16 * 32 * 32  # 61 frames -> 16 latent frames; 512 / 16 = 32 patches a side
    kept = video + 1000 + 256  # the caption's tokens (check's largest text) and the glyphs'
    saved = 3 * 4 * 16 * 128 * 54 * ((kept + 729) ** 2 - kept ** 2)
    assert f"t2v's 729 zero image tokens are left out: {saved / 1e12:.4g} TFLOP of attention a step saved" in out
    assert f"{video} video + 1256 text tokens" in out


def test_check_says_which_stages_the_cache_holds_for_these_settings(own_caches: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """After a change of settings (`latent_sampling`), check says the latents are not cached for them, the clips
    are, and what makes them (the lists are named by what they are made from: docs/caches.md)."""
    shutil.copytree(own_caches["root"] / "cache", tmp_path / "cache")
    settings = demo_dict(own_caches["model"], own_caches["data"], tmp_path)
    for name, update in (("same", {}), ("sampled", {"latent_sampling": "distribution"})):
        config = write_config(tmp_path / f"{name}.yaml", {**settings, **update})
        assert main(["check", "--no-estimates", str(config)]) == 0
        out = capsys.readouterr().out
        assert "  clips: 1 of 1 dataset(s)\n" in out and "  text_embeds: made" in out, out
        latents = "1 of 1 dataset(s)\n" if not update else "0 of 1 dataset(s); not for demo-videos"
        assert f"  latents: {latents}" in out, out
