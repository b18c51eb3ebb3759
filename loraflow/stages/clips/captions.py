"""Captions of a source file, by the dataset's `caption_strategy`.

`textfile` reads NAME.txt beside the file, one caption per non-empty line;
`filename` uses the file's stem; `instanceprompt` the dataset's `instance_prompt`; `metadata` looks the file
up in `metadata_file` (.jsonl, .csv or .parquet with a file column - file_name, file, filename or path -
holding the dataset-relative path or the bare name, and a caption column - caption, captions, text or
prompt - holding a string or a list; repeated rows add captions). Rules, the same for every strategy: an
empty caption trains on the empty prompt; a missing caption (no .txt, not in the metadata) quarantines the
file as `missing_caption`; a caption file that is not UTF-8 quarantines it as `caption_not_utf8` (a byte-order
mark is read: UTF-16 as Windows editors save "Unicode" text, and UTF-8).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from loraflow.config.dataset import DatasetConfig
from loraflow.stages.clips.dataset_folder import read_or_quarantine
from loraflow.media.types import MediaError


def read_captions(path: Path, dataset: DatasetConfig) -> list[str]:
    """Captions for a file. Rule: textfile = one caption per non-empty line; an empty file is the empty
    prompt; a missing or non-UTF-8 file quarantines the source (MediaError)."""
    if dataset.caption_strategy == "instanceprompt":
        return [dataset.instance_prompt or ""]
    if dataset.caption_strategy == "filename":
        return [path.stem.replace("_", " ").replace("-", " ").strip()]
    if dataset.caption_strategy == "metadata":
        return _metadata_captions(path, dataset)
    caption_file = path.with_suffix(".txt")
    if not caption_file.is_file():
        raise MediaError("missing_caption", f"{path.name}: no caption file {caption_file.name} (caption_strategy textfile)")
    return _clean(_text(_read(caption_file), caption_file).splitlines())


def _clean(captions: list[str]) -> list[str]:
    return [c.strip() for c in captions if c and c.strip()] or [""]


# Windows editors save "Unicode" text as UTF-16 with a byte-order mark: the mark says how to read the file.
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _text(data: bytes, path: Path) -> str:
    """A caption or metadata file's text: UTF-16 or UTF-8 by its byte-order mark, else UTF-8."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise MediaError("caption_not_utf8", f"{path.name} is not {encoding.upper().removesuffix('-SIG')} "
                         f"({exc.reason}); re-save it as UTF-8") from None


FILE_COLUMNS = ("file_name", "file", "filename", "path")
CAPTION_COLUMNS = ("caption", "captions", "text", "prompt")


def _metadata_captions(path: Path, dataset: DatasetConfig) -> list[str]:
    root = Path(dataset.instance_data_dir or "")
    meta = Path(dataset.metadata_file or "")
    meta = meta if meta.is_absolute() else root / meta
    if not meta.is_file():
        raise MediaError("missing_caption", f"dataset '{dataset.id}': metadata_file {meta} does not exist")
    stat = read_or_quarantine(meta.stat, meta)
    table, error = _load_metadata(str(meta), stat.st_size, stat.st_mtime_ns)
    if error:
        raise MediaError(*error)
    relative = path.relative_to(root).as_posix()
    for name in (relative, path.name):
        if name in table:
            return _clean(list(table[name]))
    raise MediaError("missing_caption", f"{relative}: not in metadata_file {meta.name}; add a row for it")


@lru_cache(maxsize=8)
def _load_metadata(path: str, size: int, mtime_ns: int) -> tuple[dict[str, tuple[str, ...]], tuple[str, str] | None]:
    """file -> captions, read once per file version; a broken file is an error every source reports."""
    meta = Path(path)
    try:
        rows = _metadata_rows(meta)
    except MediaError as exc:
        return {}, (exc.reason, str(exc))
    except (pa.ArrowException, OSError) as exc:  # a .parquet file that is not one
        return {}, ("bad_metadata", f"{meta.name} cannot be read as Parquet ({exc}); re-export it")
    if not all(isinstance(row, dict) for row in rows):
        return {}, ("bad_metadata", f"{meta.name}: each row must be an object with a file and a caption column "
                                    "(.json/.jsonl: one object per line)")
    columns = set(rows[0]) if rows else set()
    file_col = next((c for c in FILE_COLUMNS if c in columns), None)
    caption_col = next((c for c in CAPTION_COLUMNS if c in columns), None)
    if rows and (file_col is None or caption_col is None):
        return {}, ("bad_metadata", f"{meta.name}: needs a file column ({', '.join(FILE_COLUMNS)}) and a caption "
                                    f"column ({', '.join(CAPTION_COLUMNS)}); found {sorted(columns)}")
    table: dict[str, list[str]] = {}
    for number, row in enumerate(rows, 1):
        if row.get(file_col) is None:
            return {}, ("bad_metadata", f"{meta.name}: row {number} has no `{file_col}` (the file column row 1 "
                                        "uses); give every row one")
        value = row.get(caption_col)
        items = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        captions = [str(c) for c in items if c is not None]
        table.setdefault(str(row[file_col]).removeprefix("./"), []).extend(captions)
    return {k: tuple(v) for k, v in table.items()}, None


def _metadata_rows(meta: Path) -> list[dict[str, Any]]:
    suffix = meta.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(meta).to_pylist()
    text = _text(meta.read_bytes(), meta)
    if suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    if suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as exc:
                raise MediaError("bad_metadata", f"{meta.name} line {number} is not JSON ({exc.msg})") from None
        return rows
    raise MediaError("bad_metadata", f"metadata_file {meta.name}: use .jsonl, .csv or .parquet")


def _read(path: Path) -> bytes:
    return read_or_quarantine(path.read_bytes, path)
