"""The one store: content-addressed rows in Parquet shards, through fsspec (local path, memory://, s3://).

Layout under the root:
    <stage>/shards/<uuid>.parquet     committed rows; every row has a `key` column
    <stage>/manifest.parquet          the stage's current item set (what downstream stages read)

A shard is written to a temporary name and renamed into place, so a reader never sees half a shard: the
set of keys in committed shards is the resume point of a killed run. Tensors are stored as Arrow
fixed-shape tensor columns when every row has the same shape (a bucket's latents: zero-copy to torch)
and as flat lists with a shape column otherwise (text embeddings of different token counts).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SHAPE_SUFFIX = "__shape"


def tensor_column(arrays: Sequence[np.ndarray]) -> tuple[pa.Array, pa.Array | None]:
    """Arrow column for same-dtype arrays: fixed-shape tensor if shapes agree, else flat list + shapes."""
    shapes = {a.shape for a in arrays}
    dtype = pa.from_numpy_dtype(arrays[0].dtype)
    if len(shapes) == 1 and arrays[0].size:  # Arrow fixed-size lists must be non-empty
        shape = arrays[0].shape
        flat = pa.array(np.stack(arrays).reshape(-1), type=dtype)
        storage = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape)))
        return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(dtype, shape), storage), None
    flat = pa.array(np.concatenate([a.reshape(-1) for a in arrays]), type=dtype)
    offsets = np.cumsum([0] + [a.size for a in arrays]).astype(np.int64)
    values = pa.LargeListArray.from_arrays(pa.array(offsets), flat)
    return values, pa.array([list(a.shape) for a in arrays], type=pa.list_(pa.int64()))


def column_to_arrays(table: pa.Table, name: str) -> list[np.ndarray]:
    """Inverse of tensor_column: one numpy array per row (views into Arrow buffers where possible)."""
    column = table.column(name).combine_chunks()
    if isinstance(column.type, pa.FixedShapeTensorType):
        return list(column.to_numpy_ndarray())
    shapes = table.column(name + SHAPE_SUFFIX).to_pylist()
    return [np.asarray(column[i].values).reshape(shape) for i, shape in enumerate(shapes)]


def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows of scalars and numpy arrays -> a table (numpy arrays become tensor columns)."""
    columns: dict[str, pa.Array] = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if isinstance(values[0], np.ndarray):
            columns[name], shapes = tensor_column(values)
            if shapes is not None:
                columns[name + SHAPE_SUFFIX] = shapes
        else:
            columns[name] = pa.array(values)
    return pa.table(columns)


def table_to_rows(table: pa.Table) -> list[dict[str, Any]]:
    tensor_names = [n for n in table.column_names if _is_tensor(table, n)]
    plain = [n for n in table.column_names if n not in tensor_names and not n.endswith(SHAPE_SUFFIX)]
    rows = table.select(plain).to_pylist()
    for name in tensor_names:
        for row, array in zip(rows, column_to_arrays(table, name)):
            row[name] = array
    return rows


def _is_tensor(table: pa.Table, name: str) -> bool:
    return isinstance(table.schema.field(name).type, pa.FixedShapeTensorType) or (
        name + SHAPE_SUFFIX in table.column_names
    )


class Store:
    """put/get/keys over Parquet shards under one fsspec root."""

    def __init__(self, root: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.url = root

    def _dir(self, stage: str) -> str:
        return f"{self.root.rstrip('/')}/{stage}"

    def _shards(self, stage: str) -> list[str]:
        pattern = f"{self._dir(stage)}/shards/*.parquet"
        return sorted(self.fs.glob(pattern))

    def _write_atomic(self, table: pa.Table, path: str) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(tmp, "wb") as f:
            # no dictionary pages for tensor columns: float values rarely repeat, and the dictionary
            # costs more than it saves (text_embeds shards: about a third smaller without it)
            plain = [n for n in table.column_names if not _is_tensor(table, n) and not n.endswith(SHAPE_SUFFIX)]
            pq.write_table(table, f, compression="zstd", use_dictionary=plain)
        self.fs.mv(tmp, path)

    def put(self, stage: str, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """Commit rows (each with a unique `key`) as one shard; return its path."""
        if not rows:
            return None
        path = f"{self._dir(stage)}/shards/{uuid.uuid4().hex}.parquet"
        self._write_atomic(rows_to_table(rows), path)
        return path

    def keys(self, stage: str) -> set[str]:
        """Every committed key of a stage: the resume point."""
        found: set[str] = set()
        for shard in self._shards(stage):
            with self.fs.open(shard, "rb") as f:
                found.update(pq.read_table(f, columns=["key"]).column("key").to_pylist())
        return found

    def get(self, stage: str, keys: Iterable[str], columns: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Rows for the given keys, by key. Missing keys raise: reading a cache that is not there is a bug."""
        wanted = set(keys)
        rows: dict[str, dict[str, Any]] = {}
        for shard in self._shards(stage):
            with self.fs.open(shard, "rb") as f:
                shard_keys = pq.read_table(f, columns=["key"]).column("key").to_pylist()
                hits = [i for i, k in enumerate(shard_keys) if k in wanted and k not in rows]
                if not hits:
                    continue
                f.seek(0)
                table = pq.read_table(f, columns=_with_shapes(f, columns)).take(hits)
            for row in table_to_rows(table):
                rows[row["key"]] = row
        missing = wanted - rows.keys()
        if missing:
            raise KeyError(f"{stage}: {len(missing)} key(s) not in the store at {self.url}, e.g. {sorted(missing)[0]}")
        return rows

    def write_manifest(self, stage: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Replace the stage's manifest (its current item set) atomically."""
        self._write_atomic(pa.Table.from_pylist(list(rows)), f"{self._dir(stage)}/manifest.parquet")

    def read_manifest(self, stage: str) -> list[dict[str, Any]]:
        path = f"{self._dir(stage)}/manifest.parquet"
        if not self.fs.exists(path):
            raise FileNotFoundError(f"stage '{stage}' has no manifest at {self.url}: materialize it first")
        with self.fs.open(path, "rb") as f:
            return pq.read_table(f).to_pylist()

    def clean(self, stage: str, keep: set[str]) -> int:
        """Delete shards none of whose keys are in `keep` (explicit clean-up; never automatic)."""
        removed = 0
        for shard in self._shards(stage):
            with self.fs.open(shard, "rb") as f:
                shard_keys = set(pq.read_table(f, columns=["key"]).column("key").to_pylist())
            if not shard_keys & keep:
                self.fs.rm(shard)
                removed += 1
        return removed


def _with_shapes(f: Any, columns: list[str] | None) -> list[str] | None:
    if columns is None:
        return None
    names = pq.read_schema(f).names
    f.seek(0)
    wanted = {"key", *columns}
    return [n for n in names if n in wanted or (n.endswith(SHAPE_SUFFIX) and n.removesuffix(SHAPE_SUFFIX) in wanted)]
