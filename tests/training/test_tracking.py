"""report_to: real TensorBoard event files and a real offline W&B run, read back; a missing package is named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loraflow.training.options.tracking import open_sink

ROWS = [{"loss": 0.5, "crepa_loss": -0.25}, {"loss": 0.375, "crepa_loss": -0.5}]


def test_tensorboard_series_apart(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = open_sink("tensorboard", tmp_path, start=0)
    for step, row in enumerate(ROWS, 1):
        sink.log(row, step)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/crepa_loss", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/crepa_loss")] == [(1, -0.25), (2, -0.5)]


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's offline run under the run folder, its id the run key; its record file (protobuf, what `wandb sync`
    uploads; wandb ships no reader for it) holds the series' names, both steps' values and the config."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = open_sink("wandb", tmp_path / "run-key", start=0, config={"lora_rank": 4})
    for step, row in enumerate(ROWS, 1):
        sink.log(row, step)
    sink.close()
    (records,) = (tmp_path / "run-key" / "wandb").glob("offline-run-*-run-key/run-run-key.wandb")
    data = records.read_bytes()
    assert all(token in data
               for token in (b"train/loss", b"train/crepa_loss", b"-0.25", b"-0.5", b"0.375", b"lora_rank"))


def test_missing_package_and_unknown_value_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"report_to: wandb needs the wandb package.*`pip install wandb`"):
        open_sink("wandb", tmp_path, start=0)
    with pytest.raises(ValueError, match="report_to 'comet_ml' is not known; allowed: tensorboard, wandb, none"):
        open_sink("comet_ml", tmp_path, start=0)
    open_sink("none", tmp_path, start=0).log(ROWS[0], 1)
    assert not any(tmp_path.iterdir())
