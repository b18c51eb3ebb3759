"""Typed rows and reports (issue 31): each record's fields are the columns or keys of what it is written to, and the
files keep the keys they had before the records were typed (history.json, result.json, the launched trainer's
summary that becomes Dagster metadata)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pyarrow.parquet as pq

from loraflow.contracts.latent_rows import LatentRow, read_latent_rows
from loraflow.contracts.reports import LoraReport, PromptRenders, TrainStep
from loraflow.contracts.text_set import TextSetRow, read_text_set, text_lookup
from loraflow.store import Store


def test_latent_and_text_rows_are_their_manifests_columns_and_read_back_equal(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "cache"))  # the layout is store.py's: <stage>/manifest[/<part>].parquet
    latents = [LatentRow("l0", "c0", "64x48@5", "d"), LatentRow("l1", "c1", "64x48@5", "d", approximate=True)]
    store.write_manifest("latents", [r.to_row() for r in latents], part="d")
    columns = pq.read_schema(tmp_path / "cache" / "latents" / "manifest" / "d.parquet").names
    assert columns == [f.name for f in fields(LatentRow)]
    assert read_latent_rows(store) == latents
    texts = [TextSetRow("t0", "a cat", "", 3, False), TextSetRow("t1", "a cat", "src1", 9, True)]
    store.write_manifest("text_embeds", [r.to_row() for r in texts])
    columns = pq.read_schema(tmp_path / "cache" / "text_embeds" / "manifest.parquet").names
    assert columns == [f.name for f in fields(TextSetRow)]
    assert read_text_set(store) == texts
    assert text_lookup(store) == {("a cat", ""): "t0", ("a cat", "src1"): "t1"}


def test_manifests_from_before_a_column_was_added_read_with_its_meaning(tmp_path: Path) -> None:
    """A text manifest from before i2i has no `image` (every item is text alone); a latents manifest from before
    the out-of-memory fallback has no `approximate` (none was tiled)."""
    store = Store(str(tmp_path / "cache"))
    store.write_manifest("text_embeds", [{"key": "t0", "text": "a cat", "n_tokens": 3, "truncated": False}])
    assert read_text_set(store) == [TextSetRow("t0", "a cat", "", 3, False)]
    store.write_manifest("latents", [{"key": "l0", "clip_key": "c0", "bucket": "b", "dataset": "d"}])
    assert read_latent_rows(store) == [LatentRow("l0", "c0", "b", "d", approximate=False)]


def test_a_tiled_fallback_is_listed_under_its_tiled_key_as_approximate() -> None:
    from loraflow.stages.latents.latents import PlannedLatent

    planned = PlannedLatent(key="exact", tiled_key="tiled", clip_key="c0", bucket="b", dataset="d", source="0.mp4",
                            frames="0-0")
    assert planned.listed(False) == LatentRow("exact", "c0", "b", "d", approximate=False)
    assert planned.listed(True) == LatentRow("tiled", "c0", "b", "d", approximate=True)


def test_history_rows_keep_the_keys_a_run_measured() -> None:
    """history.json and the report_to sink: a CPU run without CREPA logs no peak_gib and no crepa_loss (no nulls)."""
    import torch

    from loraflow.training.flops import MicroStepFlops, StepRate
    from loraflow.training.loop import _log_step

    class Sink:
        def log(self, values: dict[str, float], step: int) -> None:
            self.logged = (values, step)

    sink = Sink()
    rate = StepRate.of([MicroStepFlops(model=10**12, recompute=0)], 0.2, None)  # the CPU: no peak, no MFU
    row = _log_step(3, 10, 0.5, 1e-4, 0.25, 0.2, 4, torch.device("cpu"), sink, {}, rate, None)
    assert row == TrainStep(step=3, loss=0.5, lr=1e-4, grad_norm=0.25, ms=200.0, samples_per_s=20.0, tflops=5.0)
    assert list(row.json_row()) == ["step", "loss", "lr", "grad_norm", "ms", "samples_per_s", "tflops"]
    assert sink.logged == ({"loss": 0.5, "lr": 1e-4, "grad_norm": 0.25, "ms": 200.0, "samples_per_s": 20.0,
                            "tflops": 5.0}, 3)
    crepa = _log_step(3, 10, 0.5, 1e-4, 0.25, 0.2, 4, torch.device("cpu"), None, {"crepa_loss": -0.125}, rate, None)
    assert crepa.json_row()["crepa_loss"] == -0.125 and TrainStep(**crepa.json_row()) == crepa


def test_the_trainers_summary_keeps_its_keys(tmp_path: Path) -> None:
    """What a launched trainer hands to Dagster as metadata (and prints as JSON): no history, no data version."""
    history = (TrainStep(step=1, loss=0.75, lr=1e-4, grad_norm=1.0, ms=10.0),)
    report = LoraReport(data_version="v", computed=1, reused=0, history=history, lora_path="a.safetensors",
                        run_dir="run", inputs={"latents": "x"}, resumed_at_step=0, samples_per_s=2.0, peak_gib=0.0)
    keys = ["computed", "reused", "lora_path", "run_dir", "inputs", "resumed_at_step", "samples_per_s", "peak_gib"]
    assert report.summary() == {**{k: getattr(report, k) for k in keys}, "final_loss": 0.75}
    exported = LoraReport(**{**vars(report), "comfyui_lora_path": "c.safetensors"})
    assert list(exported.summary()) == [*keys, "comfyui_lora_path", "final_loss"]
    both = LoraReport(**{**vars(exported), "musubi_lora_path": "m.safetensors"})
    assert list(both.summary()) == [*keys, "comfyui_lora_path", "musubi_lora_path", "final_loss"]


def test_a_prompts_result_json_has_adapters_only_where_they_rendered() -> None:
    renders = PromptRenders(name="cat", prompt="a cat", base="b.mp4", lora="l.mp4", contact_sheet="s.png",
                            mean_abs_pixel_change=1.5)
    keys = ["name", "prompt", "base", "lora", "contact_sheet", "animation", "mean_abs_pixel_change"]
    assert list(renders.json_row()) == keys and PromptRenders(**renders.json_row()) == renders
    other = PromptRenders(**{**renders.json_row(), "adapters": {"style": "a.mp4"}})
    assert list(other.json_row()) == [*keys, "adapters"]
