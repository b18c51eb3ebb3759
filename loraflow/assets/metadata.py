"""Turning op reports into Dagster metadata: counts, rounded numbers, tables, and pictures.

Dagster 1.13 shows markdown metadata inline only under 1,000 characters (ui-core MetadataEntry.tsx); an embedded
image is longer, so it opens from its row's [Show Markdown]."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dagster import MetadataValue
from PIL import Image

IMAGE_TYPES = {".png": "image/png", ".webp": "image/webp"}  # the files md_image embeds

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.contracts.reports import StageReport
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.sources import ModelSource
    from loraflow.store import Store


def counts(report: StageReport) -> dict[str, Any]:
    status = "cached: nothing to compute" if report.computed == 0 else f"computed {report.computed}"
    return {"computed": report.computed, "reused": report.reused, "status": status}


def md_table(rows: Sequence[Any], limit: int = 50) -> MetadataValue:
    """Rows as a markdown table: mappings, or dataclasses (a report's rows) whose fields are the columns."""
    rows = [asdict(row) if is_dataclass(row) else row for row in rows]
    if not rows:
        return MetadataValue.md("_none_")
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row.get(h, "")) for h in header) + " |" for row in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"\n_{len(rows) - limit} more rows_")
    return MetadataValue.md("\n".join(lines))


def number(value: float) -> MetadataValue:
    """A float for reading and for the Plots tab, which charts it across materializations: 4 significant digits
    (the run's files keep every digit)."""
    return MetadataValue.float(float(f"{value:.4g}"))


def readable(facts: dict[str, Any]) -> dict[str, Any]:
    """`facts` with every float as a `number`, and the floats as they were under `raw_numbers`."""
    raw = {k: v for k, v in facts.items() if isinstance(v, float)}
    rounded = {k: number(v) for k, v in raw.items()}
    return {**facts, **rounded, **({"raw_numbers": MetadataValue.json(raw)} if raw else {})}


def md_image(image: Image.Image | str | Path, alt: str) -> MetadataValue:
    """An embedded image (data URI), so the asset page shows it without opening files: a PIL image as PNG, a
    file (PNG, animated WebP) as it is."""
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data, mime = buffer.getvalue(), "image/png"
    else:
        data, mime = Path(image).read_bytes(), IMAGE_TYPES[Path(image).suffix]
    return MetadataValue.md(f"![{alt}](data:{mime};base64,{base64.b64encode(data).decode()})")


def loss_words(history: list[dict[str, Any]]) -> str:
    """First and last training loss in words: short text, which the UI shows without a click."""
    if not history:
        return "no steps"
    first, last = history[0], history[-1]
    return f"{first['loss']:.4g} at step {first['step']} → {last['loss']:.4g} at step {last['step']}"


def estimated_peak(config: LoraflowConfig, family: ModelFamily, model: ModelSource, stage: str, store: Store,
                   device: str, datasets: list[str] | None = None) -> dict[str, Any]:
    """The estimate (loraflow/estimates/) beside a stage's measured `peak_gib`: `est_peak_gib` and its parts in
    GiB, for the largest bucket of these datasets' clips (None: every dataset) on `device` ("cpu", "cuda:0")."""
    from loraflow.contracts.clip_rows import read_clips
    from loraflow.estimates.fit import GIB
    from loraflow.estimates.table import stage_estimate

    buckets = {clip.bucket for clip in read_clips(store, parts=datasets)}
    if not buckets:
        return {}
    estimate = stage_estimate(config, family, model, stage, buckets, device.split(":")[0])
    if not estimate.parts:
        return {"est_peak_gib": estimate.note}
    return {"est_peak_gib": number(estimate.peak_gib),
            "est_peak_parts_gib": MetadataValue.json({k: float(f"{v / GIB:.4g}") for k, v in estimate.parts.items()})}
