"""Atomic writes of local files and folders: the one `write_atomic` of a file, the one `publish_folder` of a folder,
`write_json`; a full disk named (`DiskFull`, with the config key that moves the folder); the temporary names a killed
writer leaves (`tmp_name`, `left_by_dead_writer`), removed by the next write into that folder. The store's shards
(loraflow/store.py) go through the same names and the same fsync."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """The one atomic write of a local file: `write(tmp)` fills a hidden name beside `path` (same suffix, so writers
    that pick the format by extension still do), its bytes reach the disk, then a rename publishes it. A kill or a
    power cut leaves the old file or none under `path`, never a half one; a failed write leaves no temporary file (a
    full disk: `DiskFull`), a killed one's goes at the next write into that folder."""
    path = Path(path)
    tmp = path.with_name(f".{tmp_name()}-{path.name}")
    for name in os.listdir(path.parent):
        if left_by_dead_writer(name):
            (path.parent / name).unlink(missing_ok=True)
    try:
        with disk_full_named(path.parent):
            write(tmp)
            with open(tmp, "rb") as f:
                fsync_file(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def publish_folder(staging: Path, final: Path) -> Path:
    """The one atomic publish of a local folder (a checkpoint, a tiny model, the tokenizer): `staging`, filled beside
    `final` on the same disk, reaches the disk (its files, then its folders), then one rename makes it `final`. A
    kill or a power cut leaves no `final` or the whole folder, never part of it. `final` must be absent or an empty
    folder: where it holds anything the rename raises (OSError) and `staging` stays, the caller's to remove."""
    for path in sorted(Path(staging).rglob("*"), key=lambda p: (p.is_dir(), -len(p.parts))):
        fsync_path(path)
    fsync_path(staging)
    os.replace(staging, final)
    return Path(final)


def fsync_path(path: Path) -> None:
    """A local file's or folder's bytes (a folder's: its entries) on disk before a rename publishes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def temporary_folder(tmp: Path) -> Iterator[Path]:
    """An empty folder `tmp` a write fills before publishing (a checkpoint, by `publish_folder`; an export): removed
    when the write fails (a full disk: `DiskFull`). Whatever a killed write left under that name goes first."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with disk_full_named(tmp.parent):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- a full disk, and what failed writes leave ----------------------------------------------------------------
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # no space left, over quota
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TMP_NAME = re.compile(r"tmp-([0-9a-f]{8})-([0-9a-f]+)-[0-9a-f]{8}")


class DiskFull(OSError):
    """A write that found its disk full or its quota used: the message names the folder, the space left there and
    the config key that moves it. The write's temporary file is gone."""


@contextlib.contextmanager
def disk_full_named(folder: str | Path, key: str | None = None) -> Iterator[None]:
    """A full disk met inside becomes `DiskFull`; every other error passes as it is. `key`: the config key that
    places `folder`, where the writer knows it (the store: cache_dir)."""
    try:
        yield
    except Exception as exc:
        code = _errno(exc)
        if code not in FULL_DISK or isinstance(exc, DiskFull):
            raise
        free = ""
        with contextlib.suppress(OSError):
            free = f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free)"
        keys = f"`{key}`" if key else "the config key that places it (`output_dir`: runs, renders; `cache_dir`: caches)"
        raise DiskFull(code, f"the disk holding {folder} is full{free} ({os.strerror(code)}): free space "
                       f"there, or set {keys} to a folder on a disk with room; nothing half-written was kept, so "
                       "running again resumes") from None


def _errno(exc: Exception) -> int | None:
    """An OSError's errno, or that of a Rust io::Error safetensors wraps ("... (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno
    match = re.search(r"\(os error (\d+)\)", str(exc))
    return int(match[1]) if match else None


def tmp_name() -> str:
    """A temporary name's tag: this machine (a hash of its host name), this process, a random part."""
    return f"tmp-{_HOST}-{os.getpid():x}-{uuid.uuid4().hex[:8]}"


def left_by_dead_writer(name: str) -> bool:
    """A temporary file that a process of this machine, no longer running, was writing (a kill, a power cut)."""
    match = _TMP_NAME.search(name.rsplit("/", 1)[-1])
    if match is None or match[1] != _HOST:
        return False
    try:
        os.kill(int(match[2], 16), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON, atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def fsync_file(f: Any) -> None:
    """A local file's bytes on disk before the rename publishes it (a power cut must not leave an empty shard
    under a committed name); object stores commit whole objects, so there is nothing to do there."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return
    f.flush()
    os.fsync(fd)
