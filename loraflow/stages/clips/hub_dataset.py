"""Hugging Face datasets (`type: huggingface`): a Hub dataset's rows as a dataset folder the clips stage reads.

The `datasets` library loads the split (`load_dataset(dataset_name, split=, revision=)`) into its cache (HF_HOME,
HF_DATASETS_CACHE); with HF_HUB_OFFLINE=1 it reads that cache only (a split loaded once before). Each row's video or
image (its `video_column` / `image_column`, read undecoded: the bytes as stored) is written into the dataset's folder
(`DatasetConfig.as_folder`: cache_dir/huggingface/<id> unless `instance_data_dir` says) as
`<row>-<sha256 of the bytes, 16 hex>.<ext>`, its caption (`caption_column`: a string, or a list of strings) into
that folder's metadata.jsonl; then the folder is read as any other (`dataset_folder.list_folder`, the same probe,
quarantine rows and reasons: a file the decoders refuse is `unreadable`/`corrupt` as a local one, a GIF
`unsupported_format`). Content-keyed like local files: a file's identity is its path, size and mtime, and here the
path holds the bytes' hash and the mtime is fixed (0), so the same row gives the same clip keys after the folder is
written again. A row that yields no file gets its quarantine row here: `missing_media` (no bytes, or a path that is
not a local file), `missing_caption` (no caption in the caption column), `caption_not_text` (neither text nor a list
of texts). Files of rows no longer in the split are removed from the folder (only files of this naming).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from loraflow.atomic import write_atomic
from loraflow.config.dataset import HUB_METADATA, DatasetConfig
from loraflow.media.types import IMAGE_EXTENSIONS, MediaError
from loraflow.stages.clips.dataset_folder import MEDIA_EXTENSIONS, OTHER_MEDIA_EXTENSIONS, Listing, list_folder

ROW_FILE = re.compile(r"\d{6,}-[0-9a-f]{16}\.[A-Za-z0-9]+")  # what `_write_row` names; nothing else is removed
FIXED_MTIME_NS = 0  # the written files' mtime: their identity is their bytes (module docstring)


class HubDatasetUnavailable(FileNotFoundError):
    """The split is neither in the datasets cache nor downloadable (offline, no network, no such dataset)."""


def readable(dataset: DatasetConfig, cache_dir: str, sound_captions: bool = False) -> tuple[DatasetConfig, Listing]:
    """The dataset as a folder (`DatasetConfig.as_folder`) and its listing (`sound_captions`: as `list_folder`); a
    Hugging Face dataset's rows are written there first, and the rows that yield no file are among the listing's
    `others`."""
    folder_dataset = dataset.as_folder(cache_dir)
    if dataset.type != "huggingface":
        return folder_dataset, list_folder(folder_dataset, sound_captions)
    problems = export_rows(dataset, Path(folder_dataset.instance_data_dir or ""))
    listing = list_folder(folder_dataset, sound_captions)
    listing.others = sorted(listing.others + problems, key=lambda item: item[0])
    return folder_dataset, listing


def load_split(dataset: DatasetConfig) -> Any:
    """The split through the datasets library (and its cache), the media column undecoded."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"dataset '{dataset.id}' is `type: huggingface`, which reads Hub datasets through the "
                          "`datasets` library: pip install 'loraflow[hub]'") from None
    split = dataset.split or "train"
    try:
        rows = datasets.load_dataset(dataset.dataset_name, split=split, revision=dataset.revision)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        offline = " (HF_HUB_OFFLINE is set: only the cache is read)" if datasets.config.HF_HUB_OFFLINE else ""
        raise HubDatasetUnavailable(
            f"dataset '{dataset.id}': the Hugging Face dataset {dataset.dataset_name!r} (split {split!r}"
            f"{f', revision {dataset.revision!r}' if dataset.revision else ''}) is not in the "
            f"datasets cache ({datasets.config.HF_DATASETS_CACHE}) and could not be downloaded{offline}: {exc}. "
            "Load it once where the Hub is reachable (the same HF_HOME), or check `dataset_name`") from None
    except ValueError as exc:  # an unknown split
        raise ValueError(f"dataset '{dataset.id}': `split` {split!r} of {dataset.dataset_name!r}: {exc}") from None
    columns = [dataset.media_column] + ([dataset.caption_column] if dataset.caption_strategy == "huggingface" else [])
    for key, column in zip(("video_column" if dataset.dataset_type == "video" else "image_column", "caption_column"),
                           columns):
        if column not in rows.column_names:
            raise ValueError(f"dataset '{dataset.id}': `{key}` {column!r} is no column of {dataset.dataset_name!r} "
                             f"(its columns: {', '.join(rows.column_names)})")
    feature = rows.features[dataset.media_column]
    if isinstance(feature, (datasets.Video, datasets.Image)):
        rows = rows.cast_column(dataset.media_column, type(feature)(decode=False))
    return rows


def export_rows(dataset: DatasetConfig, folder: Path) -> list[tuple[Path, MediaError]]:
    """Write the split's rows into `folder` (module docstring); the rows that yield no file, with why."""
    rows = load_split(dataset)
    folder.mkdir(parents=True, exist_ok=True)
    problems, captions, written = [], [], set()
    for index, row in enumerate(rows):
        where = folder / f"row {index:06d}"  # what a row without a file is named in its quarantine row
        try:
            caption = _caption(row, dataset, index)
            name = _write_row(folder, index, _media(row[dataset.media_column], dataset, index))
        except MediaError as exc:
            problems.append((where, exc))
            continue
        written.add(name)
        if caption is not None:
            captions.append({"file_name": name, "caption": caption})
    if dataset.caption_strategy == "huggingface":
        text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in captions)
        metadata = folder / HUB_METADATA
        if not metadata.is_file() or metadata.read_text(encoding="utf-8") != text:
            write_atomic(metadata, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    for stale in folder.iterdir():  # rows the split no longer has
        if ROW_FILE.fullmatch(stale.name) and stale.name not in written:
            stale.unlink()
    return problems


def _caption(row: dict[str, Any], dataset: DatasetConfig, index: int) -> str | list[str] | None:
    if dataset.caption_strategy != "huggingface":
        return None
    value = row[dataset.caption_column]
    if value is None:
        raise MediaError("missing_caption", f"row {index} of {dataset.dataset_name!r}: no caption in column "
                         f"{dataset.caption_column!r}")
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise MediaError("caption_not_text", f"row {index} of {dataset.dataset_name!r}: its {dataset.caption_column!r} is "
                     f"{type(value).__name__}, not text or a list of texts: give `caption_column` the captions' column")


def _media(value: Any, dataset: DatasetConfig, index: int) -> tuple[bytes, str]:
    """(the row's file bytes, its extension): from the feature's {"bytes", "path"}, raw bytes, or a local path."""
    data, path = None, None
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str):
        path = value
    if data is None and path and Path(path).is_file():
        data = Path(path).read_bytes()
    if not data:
        what = f"a path {path!r} that is not a local file" if path else "no bytes"
        raise MediaError("missing_media", f"row {index} of {dataset.dataset_name!r}: its {dataset.media_column!r} has "
                         f"{what}; nothing to train on")
    suffix = Path(path or "").suffix.lower()
    if suffix not in MEDIA_EXTENSIONS | OTHER_MEDIA_EXTENSIONS:  # kept where known: a GIF is reported as one
        suffix = ".png" if dataset.dataset_type == "image" else ".mp4"
    if dataset.dataset_type == "image" and suffix not in IMAGE_EXTENSIONS | OTHER_MEDIA_EXTENSIONS:
        suffix = ".png"
    return bytes(data), suffix


def _write_row(folder: Path, index: int, media: tuple[bytes, str]) -> str:
    """The row's file, written once (its name holds its bytes' hash), its mtime fixed; returns its name."""
    data, suffix = media
    name = f"{index:06d}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    path = folder / name
    if not path.is_file() or path.stat().st_size != len(data):
        write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))
    if path.stat().st_mtime_ns != FIXED_MTIME_NS:
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    return name
