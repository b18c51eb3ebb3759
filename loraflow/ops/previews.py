"""Small pictures for the UI: people would rather look at their clips than read about them."""

from __future__ import annotations

import numpy as np
from PIL import Image

from loraflow.store import Store

THUMB = 96


def clip_preview(store: Store, limit: int = 12) -> Image.Image:
    """First frame of up to `limit` clips side by side, each fitted into a THUMB x THUMB cell."""
    keys = [row["key"] for row in store.read_manifest("clips")][:limit]
    canvas = Image.new("RGB", (THUMB * max(1, len(keys)), THUMB), "black")
    for i, (key, row) in enumerate(store.get("clips", keys).items()):
        frame = Image.fromarray(np.asarray(row["frames"][0]))
        frame.thumbnail((THUMB, THUMB))
        canvas.paste(frame, (i * THUMB + (THUMB - frame.width) // 2, (THUMB - frame.height) // 2))
    return canvas
