"""Turning op reports into Dagster metadata: counts, tables, and pictures the UI shows inline."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from dagster import MetadataValue
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from loraflow.ops.report import StageReport, TrainStep


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


def md_image(image: Image.Image, alt: str) -> MetadataValue:
    """An inline PNG (data URI) so the asset page shows it without opening files."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return MetadataValue.md(f"![{alt}](data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()})")


def loss_curve(history: Sequence[TrainStep], size: tuple[int, int] = (480, 200)) -> Image.Image:
    """A plain line plot of loss per step (no plotting library needed)."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    losses = [h.loss for h in history]
    if len(losses) < 2:
        return image
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    pad = 20
    points = [(pad + i * (size[0] - 2 * pad) / (len(losses) - 1), size[1] - pad - (v - low) / span * (size[1] - 2 * pad))
              for i, v in enumerate(losses)]
    draw.line(points, fill=(200, 40, 40), width=2)
    draw.text((pad, 2), f"loss {high:.4f} .. {low:.4f} over {len(losses)} steps", fill="black")
    return image
