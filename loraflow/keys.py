"""Content keys: a hash of everything that determines an item, so a key changes exactly when its content would; and
the shard a key falls in when N workers split a dataset (stages/shard_worker.py); the fingerprint of tensors' bytes.

Each stage bumps its CODE_VERSION when its numbers change; the version is part of every key it makes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import quote

if TYPE_CHECKING:  # annotations only: keys stay free of torch at import
    import torch


def content_key(**fields: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace); 32 hex chars is plenty for a cache."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# A dataset id names files (the store's manifest part and lock of that dataset): file systems allow 255 bytes per name,
# and the store adds at most 45 to the stem (".parquet", then an atomic write's ".tmp-<host>-<pid>-<random>", at
# most 32: atomic.tmp_name).
PART_STEM_LIMIT = 255 - 45


def part_file_stem(part: str) -> str:
    """A store part's name (a dataset id) as the stem of its files: any id, reversibly (`unquote`)."""
    return quote(part, safe="")


@dataclass(frozen=True)
class ManifestNames:
    """The names a config's manifests have in a store shared by configs: per stage, each dataset id -> a digest of
    everything that stage's list of the dataset is made from (`LoraflowConfig.manifest_names`). Two configs whose
    lists would differ write and read files of other names; a config that changes one stage's settings re-lists that
    stage and those made from it, and keeps the rest.

    `aliases`: a list written beside a stage's own (its quarantine) has that stage's names. `every_stage`: the names of
    a stage `by_stage` does not know (a store opened with one mapping for all, as the store's tests do); without it
    such a stage raises, so a new caching stage cannot list unnamed."""

    by_stage: Mapping[str, Mapping[str, str]]
    aliases: Mapping[str, str] = field(default_factory=dict)
    every_stage: Mapping[str, str] | None = None

    def of(self, stage: str) -> Mapping[str, str]:
        """Dataset id -> the name of its list of `stage`."""
        named = self.by_stage.get(self.aliases.get(stage, stage), self.every_stage)
        if named is None:
            raise KeyError(f"stage '{stage}' has no manifest names: say what its list is made from in STAGE_INPUTS "
                           "(loraflow/config/loraflow_config.py)")
        return named

    def whole(self, stage: str) -> str:
        """The name of the stage's one manifest of every dataset (the text set): a digest of its parts' names."""
        return content_key(parts=dict(self.of(stage)))[:16]


def hash_seed(**fields: Any) -> int:
    """The one seed derived from a hash: a torch/random seed that is a pure function of `fields` (15 hex digits of
    their content key: < 2**60, a valid torch seed)."""
    return int(content_key(**fields)[:15], 16)


def data_version(keys: Iterable[str]) -> str:
    """A stage's data version: hash of its sorted item keys, so lineage follows content, not time."""
    return content_key(keys=sorted(keys))


def file_identity(path: str | Path, root: str | Path, content_hash: bool = False) -> dict[str, Any]:
    """A source file's identity: dataset-relative path, size and mtime (and its bytes' hash when asked)."""
    path = Path(path)
    stat = path.stat()
    identity: dict[str, Any] = {
        "path": path.relative_to(root).as_posix(),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    if content_hash:
        identity["sha256"] = file_sha256(path)
    return identity


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return _rest_sha256(f, hashlib.sha256())


def safetensors_sha256(path: str | Path) -> str:
    """sha256 of what a safetensors file holds: its header as canonical JSON, then the tensor bytes. Not of the file's
    bytes: safetensors writes the header's `__metadata__` map in a Rust HashMap's order, which is new per process, so
    the same LoRA exported twice differs in bytes (and validation rendered again for nothing)."""
    from loraflow.safetensors_header import read_header

    header = read_header(path)  # a file that is no safetensors fails here, naming it
    with open(path, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        return _rest_sha256(f, hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode()))


def _rest_sha256(f: BinaryIO, digest: Any, chunk: int = 1 << 20) -> str:
    while block := f.read(chunk):
        digest.update(block)
    return digest.hexdigest()


def directory_fingerprint(path: str | Path) -> str:
    """A checkpoint folder's fingerprint from its files' names, sizes and mtimes (cheap: no weights read).

    Config files are hashed by content: editing a config changes the model even when its size does not.
    """
    root = Path(path)
    entries = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = file.stat()
        entry: dict[str, Any] = {"path": file.relative_to(root).as_posix(), "size": stat.st_size}
        if file.suffix == ".json":
            entry["sha256"] = file_sha256(file)
        else:
            entry["mtime_ns"] = stat.st_mtime_ns
        entries.append(entry)
    return content_key(files=entries)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based): the clips whose key hashes to `index` modulo `count`."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: the count must be >= 1 and the index in 0..count-1 "
                             f"(shards of 4 are 0/4, 1/4, 2/4 and 3/4)")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'2/4' -> Shard(2, 4)."""
        index, _, count = text.partition("/")
        if not (index.isdigit() and count.isdigit()):
            raise ValueError(f"shard '{text}': write INDEX/COUNT, e.g. 2/4 for the third of 4 shards")
        return cls(int(index), int(count))

    def owns(self, key: str) -> bool:
        """Whether this shard's worker encodes the clip with this key. sha256 again rather than the key's own hex
        digits: any string key spreads evenly."""
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def tensors_fingerprint(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order."""
    import torch

    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
