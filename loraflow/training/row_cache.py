"""Reading training rows: an in-memory row cache over the store, and a one-ahead prefetch thread."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from loraflow.store import Store

ROW_CACHE_BYTES = 4 << 30  # latents and text embeddings kept in RAM between epochs
T = TypeVar("T")


class RowCache:
    """`Store.get` with rows kept in memory (least recently used out first past `max_bytes`): epochs, repeats
    and caption dropout read the same rows again, and a Parquet read costs more than a small model's step."""

    def __init__(self, store: Store, max_bytes: int = ROW_CACHE_BYTES) -> None:
        self.store, self.max_bytes, self.bytes = store, max_bytes, 0
        self.rows: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    def get(self, stage: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        keys = set(keys)
        missing = [k for k in keys if (stage, k) not in self.rows]
        for key, row in (self.store.get(stage, missing) if missing else {}).items():
            self.rows[(stage, key)] = row
            self.bytes += _nbytes(row)
        for key in keys:
            self.rows.move_to_end((stage, key))
        while self.bytes > self.max_bytes and len(self.rows) > len(keys):
            self.bytes -= _nbytes(self.rows.popitem(last=False)[1])
        return {k: self.rows[(stage, k)] for k in keys}


def _nbytes(row: dict[str, Any]) -> int:
    return sum(v.nbytes for v in row.values() if isinstance(v, np.ndarray))


def prefetched(load: Callable[[int], T], steps: range) -> Iterator[T]:
    """load(k) for k in steps, loading k+1 on a thread while k trains (loading is pure: order cannot matter)."""
    with ThreadPoolExecutor(1, thread_name_prefix="lora-prefetch") as pool:
        ahead = pool.submit(load, steps[0]) if steps else None
        for k in steps:
            batch = ahead.result()
            ahead = pool.submit(load, k + 1) if k + 1 < steps.stop else None
            yield batch
