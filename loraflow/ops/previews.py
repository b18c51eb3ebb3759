"""Small pictures for the UI: people would rather look at their clips than read about them."""

from __future__ import annotations

import numpy as np
from PIL import Image

from loraflow.store import Store

THUMB = 96


def clip_preview(store: Store, limit: int = 12) -> Image.Image:
    """First frame of up to `limit` clips side by side, each fitted into a THUMB x THUMB cell; i2i: each clip's
    source image in a second row below it."""
    keys = [row["key"] for row in store.read_manifest("clips")][:limit]
    stored = store.get("clips", keys)
    rows = [[np.asarray(stored[k]["frames"][0]) for k in keys]]
    if keys and stored[keys[0]].get("condition_frames") is not None:
        rows.append([np.asarray(stored[k]["condition_frames"][0]) for k in keys])
    canvas = Image.new("RGB", (THUMB * max(1, len(keys)), THUMB * len(rows)), "black")
    for r, frames in enumerate(rows):
        for i, frame in enumerate(frames):
            thumb = Image.fromarray(frame)
            thumb.thumbnail((THUMB, THUMB))
            canvas.paste(thumb, (i * THUMB + (THUMB - thumb.width) // 2, r * THUMB + (THUMB - thumb.height) // 2))
    return canvas
