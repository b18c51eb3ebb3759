"""Clips-manifest rows for tests that need a few of their fields (a fake store, the hold-out split, CREPA's rows)."""

from __future__ import annotations

from typing import Any

from loraflow.contracts.clip_rows import ClipRow


def clip_row(key: str, dataset: str, source: str = "s.mp4", num_frames: int = 1, **fields: Any) -> ClipRow:
    """A clip of `source` whose other fields are those of a 64x64 clip of its first `num_frames` frames."""
    return ClipRow(**{"key": key, "dataset": dataset, "source": source, "path": f"/data/{source}",
                      "bucket": f"64x64@{num_frames}", "height": 64, "width": 64, "num_frames": num_frames,
                      "indices": tuple(range(num_frames)), "resize": (64, 64), "box": (0, 0, 64, 64),
                      "captions": ("a cat",), "repeats": 1, **fields})
