"""The clips stage's probe cache: each file identity probed once, ever; written in batches, read in one pass."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import loraflow.stages.clips.clips as clips
from loraflow.keys import file_identity
from loraflow.store import Store


def media(demo_data: Path) -> list[Path]:
    return sorted(p for p in demo_data.iterdir() if p.suffix in (".mp4", ".png"))


def test_probes_are_committed_in_batches_and_reused_from_one_read(demo_data: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clips, "PROBE_BATCH", 3)
    files = media(demo_data)
    store = Store(str(tmp_path / "cache"))
    first = clips.ProbeCache(store)
    probed = [first.probe(p, file_identity(p, demo_data)) for p in files]
    assert len(store.shard_paths("probes")) == len(files) // 3  # full batches only, until the pass commits
    first.commit()
    assert len(store.shard_paths("probes")) == -(-len(files) // 3) and len(store.keys("probes")) == len(files)

    def no_probe(path: Path) -> None:
        raise AssertionError(f"{path} probed again")

    reads: list[int] = []
    original = Store.get
    monkeypatch.setattr(clips, "probe", no_probe)
    monkeypatch.setattr(Store, "get", lambda self, stage, keys, **kw: reads.append(1) or original(self, stage, keys, **kw))
    again = clips.ProbeCache(Store(str(tmp_path / "cache")))
    assert [again.probe(p, file_identity(p, demo_data)) for p in files] == probed
    assert len(reads) == 1  # every cached probe in one read, not a store read per file


def test_a_changed_file_is_probed_again(demo_data: Path, tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(media(demo_data)[0].read_bytes())
    store = Store(str(tmp_path / "cache"))
    cache = clips.ProbeCache(store)
    cache.probe(path, file_identity(path, tmp_path))
    cache.commit()
    os.utime(path, ns=(1, 1))  # same bytes, another mtime: another identity
    again = clips.ProbeCache(store)
    again.probe(path, file_identity(path, tmp_path))
    assert len(again.pending) == 1
