"""The typed clips and quarantine rows (contracts/clip_rows.py) are the manifests' columns: a field added to a record
without its column, or a column written without its field, fails here; the layout itself is pinned (stored manifests
are read by every later run)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from loraflow.config import parse_config
from loraflow.contracts.clip_rows import PAIRED_COLUMNS, ClipRow, DroppedFile, PairedImage, read_clips
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.store import Store
from tests.media_factory import write_h264

INTS = "list<element: int64>"
CLIP_COLUMNS = {"key": "string", "dataset": "string", "source": "string", "path": "string", "bucket": "string",
                "height": "int64", "width": "int64", "num_frames": "int64", "indices": INTS, "resize": INTS,
                "box": INTS, "captions": "list<element: string>", "repeats": "int64",
                "source_version": "string"}  # added by issue 42 (a manifest without it reads as before)
MASK_COLUMNS = {"mask": "string", "mask_path": "string", "mask_resize": INTS, "mask_box": INTS}
# with `video.scene_cuts: detect` only (issue 60; tests/stages/test_scene_cuts.py): ClipRow.scene, after the others
SCENE_COLUMNS = {"scene": "int64", "start_s": "double", "end_s": "double"}
QUARANTINE_COLUMNS = {"dataset": "string", "file": "string", "reason": "string", "detail": "string"}


def columns(path: Path) -> dict[str, str]:
    return {field.name: str(field.type) for field in pq.read_schema(path)}


def test_the_typed_rows_are_the_manifest_columns(tiny_k5: Path, tmp_path: Path) -> None:
    videos, masks = tmp_path / "videos", tmp_path / "masks"
    videos.mkdir()
    masks.mkdir()
    for name in ("a", "b"):
        write_h264(videos / f"{name}.mp4", num_frames=6, width=96, height=64)
        (videos / f"{name}.txt").write_text(f"caption {name}\n", encoding="utf-8")
    Image.fromarray(np.full((64, 96, 3), 255, np.uint8)).save(masks / "a.png")  # b.mp4 has none: quarantined
    config = parse_config({
        "model_family": "kandinsky5-video", "model_flavour": "t2v-lite-sft-5s",
        "pretrained_model_name_or_path": str(tiny_k5), "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "datasets": [{"id": "v", "dataset_type": "video", "instance_data_dir": str(videos), "resolution": 64,
                      "video": {"num_frames": 5}, "conditioning_data": "masks"},
                     {"id": "masks", "dataset_type": "conditioning", "conditioning_type": "mask",
                      "instance_data_dir": str(masks)}]})
    store = Store(config.cache_dir, config.manifest_names)
    report = build_clips(config, get_family(config), model_source(config), store)

    manifest = store.manifest_file("clips", "v")  # keyed by the dataset's sources (docs/caches.md)
    assert columns(manifest) == {**CLIP_COLUMNS, **MASK_COLUMNS}  # names, order and types as always written
    # audio_caption: a column only where a family composes it (Kandinsky 6); scene: SCENE_COLUMNS
    assert [f.name for f in fields(ClipRow)] == [*CLIP_COLUMNS, *PAIRED_COLUMNS, "audio_caption", "scene"]
    assert [f"mask_{f.name}" if f.name != "key" else "mask" for f in fields(PairedImage)] == [*MASK_COLUMNS]
    rows = store.read_manifest("clips")
    assert [clip.to_row() for clip in read_clips(store)] == rows and len(rows) == 1  # nothing lost either way
    assert rows[0]["mask_path"] == str(masks / "a.png") and rows[0]["captions"] == ["caption a"]

    quarantine = store.manifest_file("quarantine", "v")
    assert columns(quarantine) == QUARANTINE_COLUMNS == {f.name: "string" for f in fields(DroppedFile)}
    assert store.read_manifest("quarantine") == [q.to_row() for q in report.quarantined]
    assert [q.reason for q in report.quarantined] == ["missing_mask"]


def test_a_manifest_written_before_source_versions_reads_without_one() -> None:
    from tests.factory import clip_row

    row = clip_row("k", "v").to_row()
    del row["source_version"]  # the manifests of every run before issue 42
    assert ClipRow.from_row(row).source_version == ""  # not judged by changed_sources
