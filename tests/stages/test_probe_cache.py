"""The one probe cache (media/frames.ProbeCache): each file version probed once per process, and with a store once
ever; written in batches, read in one pass."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import pytest

import loraflow.media.frames as frames
from loraflow.keys import file_identity
from loraflow.store import Store


def media(demo_data: Path) -> list[Path]:
    return sorted(p for p in demo_data.iterdir() if p.suffix in (".mp4", ".png"))


def no_probe(request: tuple, path: Path, timeout_s: float) -> None:
    raise AssertionError(f"{path} probed again")


def test_probes_are_committed_in_batches_and_reused_from_one_read(demo_data: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "PROBE_BATCH", 3)
    monkeypatch.setattr(frames.ProbeCache, "_memory", OrderedDict())  # this process has probed nothing yet
    files = media(demo_data)
    frames.probe(files[0])  # in memory only (a decode), before the pass: the pass stores it all the same
    store = Store(str(tmp_path / "cache"))
    first = frames.ProbeCache(store)
    probed = [first.probe(p, file_identity(p, demo_data)) for p in files]
    assert len(store.shard_paths("probes")) == len(files) // 3  # full batches only, until the pass commits
    first.commit()
    assert len(store.shard_paths("probes")) == -(-len(files) // 3) and len(store.keys("probes")) == len(files)

    reads: list[int] = []
    original = Store.get
    monkeypatch.setattr(frames, "_run_in_worker", no_probe)
    monkeypatch.setattr(frames.ProbeCache, "_memory", OrderedDict())  # the next run: a new process
    monkeypatch.setattr(Store, "get",
                        lambda self, stage, keys, **kw: reads.append(1) or original(self, stage, keys, **kw))
    again = frames.ProbeCache(Store(str(tmp_path / "cache")))
    assert [again.probe(p, file_identity(p, demo_data)) for p in files] == probed
    assert len(reads) == 1  # every cached probe in one read, not a store read per file
    assert [frames.probe(p) for p in files] == probed  # what the pass read is in memory: decoding probes nothing


def test_a_changed_file_is_probed_again(demo_data: Path, tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(media(demo_data)[0].read_bytes())
    store = Store(str(tmp_path / "cache"))
    cache = frames.ProbeCache(store)
    cache.probe(path, file_identity(path, tmp_path))
    cache.commit()
    os.utime(path, ns=(1, 1))  # same bytes, another mtime: another identity
    again = frames.ProbeCache(store)
    again.probe(path, file_identity(path, tmp_path))
    assert len(again.pending) == 1
