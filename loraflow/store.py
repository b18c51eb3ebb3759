"""The one store: content-addressed rows in Parquet shards, through fsspec (local path, memory://, s3://).

Layout under the root:
    <stage>/shards/<uuid>.parquet     committed rows; every row has a `key` column
    <stage>/manifest-<name>.parquet   the stage's current item set (what downstream stages read), named by what it is
                                      made from (`ManifestNames`: the text set, one per config sharing the store), or
    <stage>/manifest/<part>/<name>.parquet
                                      the same, one file per part: clips and latents keep one per dataset, so
                                      two datasets cached at once never replace each other's list; named by what
                                      the stage's list of that dataset is made from (its files, its entry's and the
                                      stage's settings), so two configs sharing the store with one dataset id never
                                      read each other's list, whatever differs between them
    <stage>/manifest.parquet,
    <stage>/manifest/<part>.parquet   the same, written before manifests were named, or by a store that was not
                                      given the names: read by such a store only (which config wrote it is unknown:
                                      a config's store makes its named list anew, from the shards), replaced by it

A shard is written to a temporary name and renamed into place, so a reader never sees half a shard: the
set of keys in committed shards is the resume point of a killed run. A write that fails removes its temporary file
(a full disk raises `DiskFull`, naming the folder and the key that moves it); one whose process was killed leaves
it, and the next write into that folder from this machine removes it (`tmp_name` records which process wrote it).

A tensor column whose rows share one shape (a bucket's latents or frames) holds each tensor's raw bytes in one cell,
its dtype and shape in the column's field metadata (TENSOR_META); a batch reads each cell as a numpy view without
decoding. Tensors of different shapes (text embeddings of different token counts) are flat lists with a shape
column. Shards written before raw-bytes cells hold Arrow fixed-shape tensor columns; they are read as they were
written (nothing to re-encode).

Reads fetch only the row groups holding the wanted keys: a shard's rows are grouped by about ROW_GROUP_BYTES
(one latent per group at real sizes, many text rows per group), and each shard's keys and footer are read once per
Store (shards are immutable, so neither goes stale). A get finds its keys' shards in that index and lists the stage's
shards again only for a key it has not seen, so a loop of one-key gets costs no listing per key. A local shard is
read memory-mapped.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loraflow.atomic import disk_full_named, fsync_file, left_by_dead_writer, tmp_name
from loraflow.keys import ManifestNames, part_file_stem

SHAPE_SUFFIX = "__shape"
ROW_GROUP_BYTES = 4 << 20  # a training batch reads a few rows of a shard: groups small enough to skip the rest
# Rows of one file the store writes: a shard is one stage's commit (a batch of latents, a few thousand text or probe
# rows), a manifest part one row per item of a dataset. A Parquet file past it is not the store's own and is refused
# from its footer, unread (a stray 10^7-row file cost 2 GB and 40 s, read whole).
MAX_FILE_ROWS = 1_000_000
SHARD_NAME = re.compile(r"[0-9a-f]{32}\.parquet")  # `put`'s names (uuid4 hex): any other file in shards/ is not read


class CacheFileRefused(ValueError):
    """A file in the cache that the store did not write or can no longer read (truncated, another schema, tensor
    metadata that does not fit its cells): the message names it and what to do."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} in the cache {why}: delete it (the stage that wrote it rebuilds what is missing: "
                         "`loraflow cache CONFIG --dataset ID`, or the stage's job)")


TENSOR_META = b"loraflow.tensor"  # field metadata of a raw-bytes tensor column: {"dtype": "<f4", "shape": [...]}


def tensor_column(name: str, arrays: Sequence[np.ndarray]) -> list[tuple[pa.Field, pa.Array]]:
    """Arrow column(s) for same-dtype arrays: raw-bytes cells if shapes agree, else a flat list + a shape column."""
    shapes = {a.shape for a in arrays}
    if len(shapes) == 1 and arrays[0].size:  # an empty cell would be indistinguishable from a missing one
        meta = json.dumps({"dtype": arrays[0].dtype.str, "shape": list(arrays[0].shape)})  # .str names byte order
        cells = pa.array([np.ascontiguousarray(a).tobytes() for a in arrays], type=pa.large_binary())
        return [(pa.field(name, pa.large_binary(), metadata={TENSOR_META: meta}), cells)]
    dtype = pa.from_numpy_dtype(arrays[0].dtype)
    flat = pa.array(np.concatenate([a.reshape(-1) for a in arrays]), type=dtype)
    offsets = np.cumsum([0] + [a.size for a in arrays]).astype(np.int64)
    values = pa.LargeListArray.from_arrays(pa.array(offsets), flat)
    shapes_column = pa.array([list(a.shape) for a in arrays], type=pa.list_(pa.int64()))
    return [(pa.field(name, values.type), values), (pa.field(name + SHAPE_SUFFIX, shapes_column.type), shapes_column)]


def column_to_arrays(table: pa.Table, name: str) -> list[np.ndarray]:
    """Inverse of tensor_column: one numpy array per row (read-only views into Arrow buffers where possible)."""
    meta = table.schema.field(name).metadata or {}
    if TENSOR_META in meta:
        return _cells(table.column(name), json.loads(meta[TENSOR_META]), name)
    column = table.column(name).combine_chunks()
    if isinstance(column.type, pa.FixedShapeTensorType):  # a shard written before raw-bytes cells
        return list(column.to_numpy_ndarray())
    shapes = table.column(name + SHAPE_SUFFIX).to_pylist()
    return [np.asarray(column[i].values).reshape(shape) for i, shape in enumerate(shapes)]


def _cells(column: pa.ChunkedArray, meta: dict[str, Any], name: str) -> list[np.ndarray]:
    """Raw-bytes cells as arrays of the recorded dtype and shape; a cell of any other length raises."""
    dtype, shape = np.dtype(meta["dtype"]), tuple(meta["shape"])
    nbytes = dtype.itemsize * int(np.prod(shape))
    arrays = []
    for chunk in column.chunks:
        _, offsets, data = chunk.buffers()
        starts = np.frombuffer(offsets, np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
        for start, end in zip(starts[:-1], starts[1:]):
            if end - start != nbytes:
                raise ValueError(f"column '{name}': a cell of {end - start} bytes, but {dtype} {shape} is {nbytes}")
            arrays.append(np.frombuffer(data, dtype, int(np.prod(shape)), int(start)).reshape(shape))
    return arrays


def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows of scalars and numpy arrays -> a table (numpy arrays become tensor columns)."""
    columns: list[tuple[pa.Field, pa.Array]] = []
    for name in rows[0]:
        values = [row[name] for row in rows]
        if isinstance(values[0], np.ndarray):
            columns += tensor_column(name, values)
        else:
            array = pa.array(values)
            columns.append((pa.field(name, array.type), array))
    return pa.Table.from_arrays([a for _, a in columns], schema=pa.schema([f for f, _ in columns]))


def table_to_rows(table: pa.Table) -> list[dict[str, Any]]:
    tensor_names = [n for n in table.column_names if _is_tensor(table, n)]
    plain = [n for n in table.column_names if n not in tensor_names and not n.endswith(SHAPE_SUFFIX)]
    rows = table.select(plain).to_pylist()
    for name in tensor_names:
        for row, array in zip(rows, column_to_arrays(table, name)):
            row[name] = array
    return rows


def _is_tensor(table: pa.Table, name: str) -> bool:
    field = table.schema.field(name)
    return (TENSOR_META in (field.metadata or {}) or isinstance(field.type, pa.FixedShapeTensorType)
            or name + SHAPE_SUFFIX in table.column_names)


def _compression(table: pa.Table, name: str) -> str:
    """zstd, except for raw-bytes float cells: a float's random low mantissa bits leave zstd about 8% to save
    on latents, and decompressing cost most of a batch's read time (benchmarks/bench_latents.py)."""
    meta = table.schema.field(name).metadata or {}
    floating = TENSOR_META in meta and np.dtype(json.loads(meta[TENSOR_META])["dtype"]).kind == "f"
    return "none" if floating else "zstd"


class Store:
    """put/get/keys over Parquet shards under one fsspec root."""

    def __init__(self, root: str, names: ManifestNames | Mapping[str, str] | None = None) -> None:
        """`names`: a config's manifest names (`LoraflowConfig.manifest_names`), or one mapping of dataset id -> name
        for every stage: this store reads and writes the manifests of those datasets under those names only, and
        lists no other part. A store shared by configs is safe this way: shards are keyed by content, a config's
        manifests by what they are made from. None (a store that knows no config): every part, by id."""
        # no listing cache (s3fs keeps one per client): other processes and hosts commit shards to the same folders
        self.fs, self.root = fsspec.core.url_to_fs(root, use_listings_cache=False)
        self.url = root
        if names is not None and not isinstance(names, ManifestNames):
            names = ManifestNames({}, every_stage=dict(names))
        self.names = names
        self.parts: frozenset[str] | None = None  # see only_parts
        self._index: dict[str, list[list[str]]] = {}  # shard path -> its keys, per row group
        self._footers: dict[str, pq.FileMetaData] = {}  # shard path -> its Parquet footer
        self._where: dict[str, dict[str, tuple[str, int]]] = {}  # stage -> key -> (shard, row group) holding it
        self._swept: set[str] = set()  # folders whose temporary files of dead writers are gone

    def _dir(self, stage: str) -> str:
        return f"{self.root.rstrip('/')}/{stage}"

    def shard_paths(self, stage: str) -> list[str]:
        """The stage's committed shards, sorted: the files named as `put` names them (any other is not read)."""
        return [p for p in self._parquet_files(f"{self._dir(stage)}/shards") if SHARD_NAME.fullmatch(p.rsplit("/")[-1])]

    def _parquet_files(self, folder: str) -> list[str]:
        # listed, not globbed: a cache_dir with [ or * in its name is a name, not a pattern
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.endswith(".parquet"))  # never a .tmp-* file being written

    def _write_atomic(self, table: pa.Table, path: str) -> None:
        folder = path.rsplit("/", 1)[0]
        tmp = f"{path}.{tmp_name()}"
        self.fs.makedirs(folder, exist_ok=True)
        if folder not in self._swept:  # once per folder: what killed writers of this machine left there
            self._swept.add(folder)
            with contextlib.suppress(FileNotFoundError):  # an object store has no empty folders
                for name in self.fs.ls(folder, detail=False):
                    if left_by_dead_writer(name):
                        self._remove(name)
        rows_per_group = max(1, int(ROW_GROUP_BYTES * table.num_rows // max(table.nbytes, 1)))
        try:
            with disk_full_named(folder, "cache_dir"), self.fs.open(tmp, "wb") as f:
                # no dictionary pages or statistics for tensor columns: float values rarely repeat, and the dictionary
                # costs more than it saves (text_embeds shards: about a third smaller without it)
                plain = [n for n in table.column_names if not _is_tensor(table, n) and not n.endswith(SHAPE_SUFFIX)]
                compression = {n: _compression(table, n) for n in table.column_names}
                pq.write_table(table, f, compression=compression, use_dictionary=plain, write_statistics=plain,
                               row_group_size=rows_per_group)
                fsync_file(f)
            self.fs.mv(tmp, path)
        except BaseException:
            self._remove(tmp)  # the partial file
            raise

    def _shard_keys(self, stage: str, shard: str) -> list[list[str]]:
        """The shard's keys, one list per row group (read once: a committed shard never changes)."""
        if shard not in self._index:
            with _reading(shard), self._open(shard) as parquet:
                _own_file(shard, parquet, key=True)
                keys = parquet.read(columns=["key"]).column("key").to_pylist()
                sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
                self._footers[shard] = parquet.metadata
            starts = np.cumsum([0, *sizes])
            self._index[shard] = [keys[a:b] for a, b in zip(starts[:-1], starts[1:])]
            where = self._where.setdefault(stage, {})
            for group, group_keys in enumerate(self._index[shard]):
                for key in group_keys:
                    where.setdefault(key, (shard, group))  # a key in two shards (two writers) is read from one
        return self._index[shard]

    def _index_stage(self, stage: str) -> dict[str, tuple[str, int]]:
        """List the stage's shards, index the new ones; where each committed key is."""
        for shard in self.shard_paths(stage):
            self._shard_keys(stage, shard)
        return self._where.get(stage, {})

    @contextlib.contextmanager
    def _open(self, shard: str) -> Iterator[pq.ParquetFile]:
        """A shard for reading: memory-mapped when local (Arrow reads the pages in place, no Python file calls),
        else through fsspec; with its footer from the index once read."""
        footer = self._footers.get(shard)
        if self._is_local():
            yield pq.ParquetFile(shard, metadata=footer, memory_map=True)
            return
        with self.fs.open(shard, "rb") as f:
            yield pq.ParquetFile(f, metadata=footer)

    def put(self, stage: str, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """Commit rows (each with a unique `key`) as one shard; return its path."""
        if not rows:
            return None
        path = f"{self._dir(stage)}/shards/{uuid.uuid4().hex}.parquet"
        self._write_atomic(rows_to_table(rows), path)
        return path

    def keys(self, stage: str) -> set[str]:
        """Every committed key of a stage: the resume point."""
        return set(self._index_stage(stage))

    def get(self, stage: str, keys: Iterable[str], columns: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Rows for the given keys, by key. Missing keys raise: reading a cache that is not there is a bug."""
        wanted = set(keys)
        where = self._where.get(stage, {})
        if not wanted <= where.keys():  # committed since this Store last looked, or not there at all
            where = self._index_stage(stage)
        groups_of: dict[str, set[int]] = {}
        for key in wanted & where.keys():
            shard, group = where[key]
            groups_of.setdefault(shard, set()).add(group)
        rows: dict[str, dict[str, Any]] = {}
        for shard in sorted(groups_of):
            groups = sorted(groups_of[shard])
            with _reading(shard):
                with self._open(shard) as parquet:
                    table = parquet.read_row_groups(groups, columns=_with_shapes(parquet.schema_arrow, columns))
                hits = [i for i, k in enumerate(table.column("key").to_pylist()) if k in wanted and k not in rows]
                if len(hits) < table.num_rows:  # most reads want every row they read: take() would copy them all
                    table = table.take(hits)
                for row in table_to_rows(table):
                    rows[row["key"]] = row
        missing = wanted - rows.keys()
        if missing:
            raise KeyError(f"{stage}: {len(missing)} key(s) not in the store at {self.url}, e.g. {sorted(missing)[0]}")
        return rows

    def write_manifest(self, stage: str, rows: Sequence[Mapping[str, Any]], part: str | None = None) -> None:
        """Replace the stage's manifest (its current item set), or one part of it, atomically.

        A manifest is one file or a set of parts, never both: writing one kind removes the other. The whole
        manifest goes after the parts are removed (a crash in between leaves no manifest, which fails loudly, never
        a mix); a part goes before the whole file is removed (readers prefer parts).
        """
        table = pa.Table.from_pylist(list(rows))
        whole = {self._manifest_path(stage), self._legacy_path(stage)}
        if part is None:
            for path in filter(None, (self._part_file(stage, name) for name in self.manifest_parts(stage))):
                self._remove(path)
            path = self._manifest_path(stage) if self.names is not None else self._whole_file(stage)  # what it reads
            self._write_atomic(table, path)
            for other in whole - {path}:  # the named file replaces the one of no name
                self._remove(other)
        else:
            path = self._manifest_path(stage, part)
            if part not in self._names(stage):  # the file a read of this part reads
                path = self._part_file(stage, part) or path
            self._write_atomic(table, path)
            if path != self._legacy_path(stage, part):  # the named part replaces the one of no name
                self._remove(self._legacy_path(stage, part))
            for path in whole:
                self._remove(path)

    def read_manifest(self, stage: str, parts: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The stage's current items: its parts' rows in part order (the whole file if it has no parts).

        `parts` reads those parts only, and a missing one raises; a view from `only_parts` does the same for the
        stages that have parts.
        """
        names = self.manifest_parts(stage)
        if parts is None and not names:
            return self._read_table(stage, self._whole_file(stage))
        if parts is None:  # a config's store reads every dataset of the config: one not cached for it raises
            parts = self.parts if self.parts is not None or self.names is None else frozenset(self._names(stage))
        else:
            parts = frozenset(parts)
        if parts is not None:
            missing = sorted(set(parts) - set(names))
            if missing:
                made = " made with this config's settings" if self.names is not None else ""
                raise FileNotFoundError(f"stage '{stage}' has no manifest for {', '.join(missing)}{made} at "
                                        f"{self.url}: cache them first (`loraflow cache CONFIG --dataset ID`, or the "
                                        "`cache_dataset` job)")
            names = [n for n in names if n in parts]
        paths = [self._part_file(stage, name) or self._manifest_path(stage, name) for name in names]
        return [row for path in paths for row in self._read_table(stage, path)]

    def manifest_parts(self, stage: str) -> list[str]:
        """Names of the stage's manifest parts, sorted: with `names`, those of its datasets only (a part another
        config wrote into a shared store, or one of a dataset taken out of the config, is not this store's)."""
        if self.names is not None:
            return sorted(part for part in self._names(stage) if self._part_file(stage, part) is not None)
        return sorted(self._listed_parts(stage))

    def _names(self, stage: str) -> Mapping[str, str]:
        """Dataset id -> the name of its list of `stage` ({}: a store that knows no config)."""
        return {} if self.names is None else self.names.of(stage)

    def _listed_parts(self, stage: str) -> dict[str, list[str]]:
        """Every part file of the stage by part name, whoever wrote it: the unkeyed file first, then the keyed ones."""
        folder = f"{self._dir(stage)}/manifest"
        try:
            entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return {}
        found: dict[str, list[str]] = {}
        for entry in sorted(entries, key=lambda e: e["type"] == "directory"):  # files (unkeyed) first
            name = unquote(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if entry["type"] == "directory":
                found.setdefault(name, []).extend(self._parquet_files(entry["name"]))
            elif name.endswith(".parquet"):
                found.setdefault(name.removesuffix(".parquet"), []).append(entry["name"])
        return {name: files for name, files in found.items() if files}

    def _part_file(self, stage: str, part: str) -> str | None:
        """The file holding one part's rows (None: none). With `names`: the file of the part's name, or an unnamed
        one (a cache written before parts were named) until the stage writes the named one. Without (a store that
        knows no config): the unnamed file, else the one named file; several names raise (which is current is the
        config's to say: an object store's times are too coarse to tell the last written)."""
        if part in self._names(stage):  # its own name only: an unnamed file may be any config's
            path = self._manifest_path(stage, part)
            return path if self.fs.exists(path) else None
        files = self._listed_parts(stage).get(part, [])
        if len(files) > 1 and not files[0].endswith(f"/{part_file_stem(part)}.parquet"):
            raise ValueError(f"stage '{stage}' of the store at {self.url} holds {len(files)} manifests of dataset "
                             f"'{part}' (configs sharing the store, or other settings): open it with one config's "
                             "names, Store(cache_dir, config.manifest_names)")
        return files[0] if files else None

    @contextlib.contextmanager
    def part_lock(self, part: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold this host's lock on one part (a dataset) of this store, in every stage; call `on_wait` first if another
        process holds it. Two runs of one dataset then write its parts one after the other, each from inputs it read
        under the lock, so the last writer's list is computed from the newest state, never an older one written over
        it. A file lock (flock): the kernel releases it when the holder dies, so a killed run never keeps it."""
        import fcntl

        folder = self._lock_folder()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{part_file_stem(part)}.lock", "a") as f:  # released when the file is closed
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _is_local(self) -> bool:
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        return "file" in protocols

    def _lock_folder(self) -> Path:
        """Beside the data for a local store (whoever may write the store may lock it); for a remote one, this
        machine's temporary folder, one subfolder per store URL."""
        if self._is_local():
            return Path(self.root) / ".locks"
        return Path(tempfile.gettempdir()) / "loraflow-locks" / _digest(self.fs.unstrip_protocol(self.root))

    def named(self, names: ManifestNames) -> Store:
        """This store with its manifests named by `names` (a config's, `LoraflowConfig.manifest_names`). What each
        stage does first, so it reads and writes its config's lists whoever opened the store, or with whose names."""
        view = copy.copy(self)
        view.names = names
        return view

    def only_parts(self, parts: Iterable[str]) -> Store:
        """This store, with `read_manifest` restricted to the given parts (one dataset's view of its clips)."""
        view = copy.copy(self)
        view.parts = frozenset(parts)
        return view

    def _manifest_path(self, stage: str, part: str | None = None) -> str:
        """Where this store writes the stage's manifest, or one part of it (named when the names are known)."""
        if part is None:
            return self._legacy_path(stage) if self.names is None else \
                f"{self._dir(stage)}/manifest-{self.names.whole(stage)}.parquet"
        if part in self._names(stage):
            return f"{self._dir(stage)}/manifest/{part_file_stem(part)}/{self._names(stage)[part]}.parquet"
        return self._legacy_path(stage, part)

    def _legacy_path(self, stage: str, part: str | None = None) -> str:
        """The file of no name: the whole manifest, or one part (any dataset id is a file name)."""
        if part is None:
            return f"{self._dir(stage)}/manifest.parquet"
        return f"{self._dir(stage)}/manifest/{part_file_stem(part)}.parquet"

    def _read_table(self, stage: str, path: str) -> list[dict[str, Any]]:
        if not self.fs.exists(path):
            made = " made with this config's settings" if self.names is not None else ""
            raise FileNotFoundError(f"stage '{stage}' has no manifest{made} at {self.url}: make it first (`loraflow "
                                    "cache CONFIG`, or the `cache_dataset` and `train_and_validate` jobs)")
        with _reading(path), self.fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            _own_file(path, parquet)
            return parquet.read().to_pylist()

    def manifest_file(self, stage: str, part: str | None = None) -> str:
        """Where the stage's manifest (or its `part`) is, for messages."""
        return self._manifest_path(stage, part)

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except FileNotFoundError:  # another writer removed it first: the outcome is the same
            pass

    def manifest_keys(self, stage: str) -> set[str]:
        """Every key the stage's manifest lists, in all its parts, of every name (neither a view's restriction nor
        `names` applies here: `clean` keeps what any config sharing the store lists)."""
        paths = [p for files in self._listed_parts(stage).values() for p in files] or self._whole_manifests(stage)
        return {row["key"] for path in paths if self.fs.exists(path) for row in self._read_table(stage, path)}

    def _whole_file(self, stage: str) -> str:
        """The whole manifest this store reads: the one of its name, else the unnamed one (a cache written before
        whole manifests were named). A store of no names reads the unnamed one, else the one named file, and raises
        where there are several, as `_part_file` does."""
        if self.names is not None:  # its own name only: an unnamed file may be any config's
            return self._manifest_path(stage)
        files = self._whole_manifests(stage)
        if len(files) > 1 and self._legacy_path(stage) not in files:
            raise ValueError(f"stage '{stage}' of the store at {self.url} holds {len(files)} manifests (configs "
                             "sharing the store, or other settings): open it with one config's names, "
                             "Store(cache_dir, config.manifest_names)")
        return self._legacy_path(stage) if len(files) != 1 else files[0]

    def _whole_manifests(self, stage: str) -> list[str]:
        """Every whole manifest of the stage, of any name and of none."""
        return [p for p in self._parquet_files(self._dir(stage))
                if re.fullmatch(r"manifest(-[0-9a-f]{16})?\.parquet", p.rsplit("/", 1)[-1])]

    def clean(self, stage: str, keep: set[str] | None = None) -> int:
        """Delete shards none of whose keys are in `keep` (default: what any manifest part lists).
        Explicit clean-up, never automatic: a dataset removed from the config keeps its shards until then."""
        keep = self.manifest_keys(stage) if keep is None else keep
        removed = 0
        for shard in self.shard_paths(stage):
            if not any(k in keep for group in self._shard_keys(stage, shard) for k in group):
                self.fs.rm(shard)
                removed += 1
        for shard in [s for s in self._index if s.startswith(f"{self._dir(stage)}/")]:  # re-read what is left
            self._index.pop(shard)
            self._footers.pop(shard, None)
        self._where.pop(stage, None)
        return removed


def _with_shapes(schema: pa.Schema, columns: list[str] | None) -> list[str] | None:
    if columns is None:
        return None
    names = schema.names
    wanted = {"key", *columns}
    return [n for n in names if n in wanted or (n.endswith(SHAPE_SUFFIX) and n.removesuffix(SHAPE_SUFFIX) in wanted)]


def _digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Reading a cache file: what a truncated or foreign file raises inside pyarrow (or in `_cells`) names it."""
    try:
        yield
    except CacheFileRefused:
        raise
    except (pa.ArrowException, ValueError, KeyError, IndexError) as exc:
        raise CacheFileRefused(path, f"is not readable ({type(exc).__name__}: {str(exc)[:200]})") from None


def _own_file(path: str, parquet: pq.ParquetFile, key: bool = False) -> None:
    """Refuse, from its footer alone, a Parquet file the store did not write: more rows than it writes to one file,
    or (`key`: a shard) no string `key` column."""
    rows = parquet.metadata.num_rows
    if rows > MAX_FILE_ROWS:
        raise CacheFileRefused(path, f"holds {rows} rows, more than the {MAX_FILE_ROWS} of any file loraflow writes: "
                               "it is not the store's own, and was not read")
    schema = parquet.schema_arrow
    if key and ("key" not in schema.names or not pa.types.is_string(schema.field("key").type)
                and not pa.types.is_large_string(schema.field("key").type)):
        raise CacheFileRefused(path, "has no string `key` column: it is not a shard loraflow wrote")
