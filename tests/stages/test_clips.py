"""The clips stage on real files (PyAV-written videos whose frames carry their index): captions, buckets,
frame-rate resampling, the bucket plan with its latent estimate, and incremental re-processing."""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, PngImagePlugin

from loraflow.config import ConfigError
from loraflow.contracts.clip_rows import ClipRow
from loraflow.contracts.renders import condition_frame
from loraflow.media.frames import MediaError
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips import buckets
from loraflow.stages.clips.buckets import latent_geometry
from loraflow.stages.clips.clips import decode_clip
from tests.factory import clips_config, run_clips, videos
from tests.media_factory import read_index, write_h264, write_image, write_video

# ---------------------------------------------------------------------------------------------- captions


def test_caption_rules_textfile(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    a, b, c, d = videos(data, 4, captions=False)
    a.with_suffix(".txt").write_text("first caption\n\nsecond caption\n", encoding="utf-8")
    b.with_suffix(".txt").write_text("", encoding="utf-8")  # empty: the empty prompt
    c.with_suffix(".txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    # d has no caption file
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    captions = {Path(r["path"]).name: r["captions"] for r in store.read_manifest("clips")}
    assert captions == {a.name: ["first caption", "second caption"], b.name: [""]}
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert reasons == {c.name: "caption_not_utf8", d.name: "missing_caption"}
    assert {(r.reason, r.files) for r in report.dropped} == {("caption_not_utf8", 1),
                                                                           ("missing_caption", 1)}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_metadata_file_maps_files_to_captions(tiny_k5: Path, tmp_path: Path, fmt: str) -> None:
    data = tmp_path / "data"
    a, b, c = videos(data / "sub", 2, captions=False) + videos(data, 1, captions=False)
    rows = [{"file_name": "sub/clip_0.mp4", "caption": "by relative path"},
            {"file_name": "clip_1.mp4", "caption": "by name"},  # sub/clip_1.mp4 found by its bare name
            {"file_name": "clip_1.mp4", "caption": "a second caption"}]  # repeated rows add captions
    # clip_0.mp4 at the top level has no row: missing_caption
    meta = data / f"captions.{fmt}"
    if fmt == "jsonl":
        rows[1]["caption"] = ["by name", "a second caption"]  # jsonl may hold a list instead
        meta.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n", encoding="utf-8")
    elif fmt == "csv":
        meta.write_text("file_name,caption\n" + "".join(f"{r['file_name']},{r['caption']}\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), meta)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "caption_strategy": "metadata",
                                               "metadata_file": meta.name}])
    report, store = run_clips(config)
    captions = {r["source"]: r["captions"] for r in store.read_manifest("clips")}
    assert captions == {"sub/clip_0.mp4": ["by relative path"], "sub/clip_1.mp4": ["by name", "a second caption"]}
    assert [(Path(q.file).name, q.reason) for q in report.quarantined] == [(c.name, "missing_caption")]


def test_metadata_file_that_is_not_utf8_quarantines_its_files(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 2, captions=False)
    (data / "meta.csv").write_bytes("file_name,caption\nclip_0.mp4,caf\xe9\n".encode("latin-1"))
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "caption_strategy": "metadata",
                                               "metadata_file": "meta.csv"}])
    report, store = run_clips(config)
    assert store.read_manifest("clips") == []
    assert {q.reason for q in report.quarantined} == {"caption_not_utf8"}
    assert "meta.csv" in report.quarantined[0].detail


@pytest.mark.parametrize("content", [
    '[{"file_name": "clip_0.mp4", "caption": "a"}]',  # one JSON array on one line, not one object per line
    '{"file_name": "clip_0.mp4", "caption": "a"}\n{"caption": "no file column"}',
    "not parquet at all",  # as captions.parquet
])
def test_a_broken_metadata_file_quarantines_its_files_with_a_reason(tiny_k5: Path, tmp_path: Path,
                                                                    content: str) -> None:
    data = tmp_path / "data"
    videos(data, 2, captions=False)
    meta = data / ("captions.parquet" if content.startswith("not") else "captions.jsonl")
    meta.write_text(content)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "caption_strategy": "metadata",
                                               "metadata_file": meta.name}])
    report, store = run_clips(config)  # before: TypeError, KeyError, ArrowInvalid out of the stage
    assert store.read_manifest("clips") == [] and {q.reason for q in report.quarantined} == {"bad_metadata"}


def test_odd_files_are_quarantined_and_the_rest_proceeds(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (good,) = videos(data, 1)
    bad_name = data / os.fsdecode(b"caf\xe9.mp4")  # a Latin-1 name from an old archive
    bad_name.write_bytes(good.read_bytes())
    bad_name.with_suffix(".txt").write_text("caption")
    chunky = data / "chunky.png"  # a PNG whose text chunk Pillow refuses (ValueError, not OSError)
    image = Image.fromarray(np.zeros((64, 96, 3), np.uint8))
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (3 * 2**20), zip=True)
    image.save(chunky, pnginfo=info)
    chunky.with_suffix(".txt").write_text("caption")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    assert [r["path"] for r in store.read_manifest("clips")] == [str(good)]
    reasons = {q.file.rsplit("/", 1)[1]: q.reason for q in report.quarantined}
    assert reasons == {"caf\\xe9.mp4": "bad_filename", "chunky.png": "unreadable"}  # the manifest could be written


def test_a_caption_file_the_os_will_not_read_is_that_files_problem(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    good, bad = videos(data, 2)
    bad.with_suffix(".txt").unlink()
    bad.with_suffix(".txt").symlink_to("/proc/self/mem")  # a regular file whose read fails (EIO), as a vanished
    dataset = {"instance_data_dir": str(data), "allow_links_outside": True}  # one would (a link out of the dataset)
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [dataset]))
    assert [r["path"] for r in store.read_manifest("clips")] == [str(good)]
    assert [(q.reason, "Input/output error" in q.detail) for q in report.quarantined] == [("unreadable", True)]


def test_a_file_changed_after_planning_is_quarantined(tmp_path: Path) -> None:
    (video,) = videos(tmp_path, 1, num_frames=12)
    row = ClipRow(key="k", dataset="d0", source=video.name, path=str(video), bucket="96x64@2", height=64, width=96,
                  num_frames=2, indices=(0, 11), resize=(64, 96), box=(0, 0, 64, 96), captions=(), repeats=0)
    write_h264(video, num_frames=6, width=96, height=64)  # replaced by a shorter take after the plan
    with pytest.raises(MediaError) as caught:
        decode_clip(row)
    assert caught.value.reason == "changed_during_run"


def test_new_keys_are_validated_naming_the_key(tiny_k5: Path, tmp_path: Path) -> None:
    cases = [({"caption_strategy": "metadata"}, "metadata_file"),
             ({"crop_aspect": "closest"}, "crop_aspect_buckets"),
             ({"crop_aspect_buckets": [1.0]}, "crop_aspect_buckets"),
             ({"resolution_type": "area", "resolution": 1}, "resolution"),
             ({"crop_aspect": "wide"}, "crop_aspect")]
    for entry, key in cases:
        with pytest.raises(ConfigError, match=key):
            clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(tmp_path), **entry}])


# ---------------------------------------------------------------------------------------------- buckets


def test_bucket_rules_set_the_stored_size(tiny_k5: Path, tmp_path: Path) -> None:
    wide, tall = tmp_path / "wide", tmp_path / "tall"
    videos(wide, 1, width=128, height=64)
    videos(tall, 1, width=64, height=128)
    sets = [{"id": "square", "instance_data_dir": str(wide), "crop_aspect": "square"},
            {"id": "area", "instance_data_dir": str(wide), "resolution_type": "area"},
            {"id": "closest", "instance_data_dir": str(tall), "crop_aspect": "closest",
             "crop_aspect_buckets": [1.0, 0.75, 1.5]}]
    report, store = run_clips(clips_config(tiny_k5, tmp_path, sets))
    clips = {r["dataset"]: r for r in store.read_manifest("clips")}
    sizes = {k: (r["height"], r["width"]) for k, r in clips.items()}
    assert sizes == {"square": (64, 64), "area": (48, 96), "closest": (80, 64)}  # area: 4608 px ~ 64**2
    stored = store.get("clips", [r["key"] for r in clips.values()])
    for name, row in clips.items():
        # the bucket is what the latents stage encodes: label, manifest size and stored frames agree
        assert stored[row["key"]]["frames"].shape == (5, row["height"], row["width"], 3)
        assert row["bucket"] == buckets.bucket_label(row["height"], row["width"], 5)


def test_bucket_plan_estimates_latent_bytes_and_i2v_first_frame(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 2, num_frames=12)
    write_image(data / "still.png", width=96, height=64, index=7)
    (data / "still.txt").write_text("a still", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    report, store = run_clips(config)
    geometry = latent_geometry(tiny_k5, get_family(config))
    table = {r.bucket: r for r in report.buckets}
    assert {b: r.clips for b, r in table.items()} == {"96x64@5": 2, "96x64@1": 1}
    assert table["96x64@5"].latent_bytes == 2 * geometry.nbytes(5, 64, 96)
    assert report.est_latent_bytes == sum(r.latent_bytes for r in table.values())
    c, t, h, w = geometry.shape(5, 64, 96)
    assert (t, h, w) == (2, 8, 12)  # 4k+1 frames -> k+1 latent frames, 8x spatial
    for row in store.read_manifest("clips"):
        image = condition_frame(store, row["key"])
        assert image.shape == (row["height"], row["width"], 3)
        if row["num_frames"] > 1:
            assert read_index(image) == row["indices"][0] == 0


def test_an_image_among_i2v_videos_is_quarantined_not_trained_into_a_nan_loss(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 1, num_frames=12)
    write_image(data / "still.png", width=96, height=64)
    (data / "still.txt").write_text("a still", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}], model_flavour="i2v-lite-5s")
    report, store = run_clips(config)
    assert [(Path(q.file).name, q.reason) for q in report.quarantined] == [("still.png", "single_image")]
    assert [Path(c["source"]).name for c in store.read_manifest("clips")] == ["clip_0.mp4"]


def test_a_full_extraction_too_short_for_i2v_is_quarantined(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    short, long = videos(data, 2, num_frames=3)[0], write_h264(data / "long.mp4", num_frames=12, width=96, height=64)
    long.with_suffix(".txt").write_text("long", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "video": {
        "num_frames": 5, "frame_extraction": "full"}}], model_flavour="i2v-lite-5s")
    report, store = run_clips(config)
    assert {(Path(q.file).name, q.reason) for q in report.quarantined} == {
        (short.name, "too_short"), ("clip_1.mp4", "too_short")}
    assert [len(c["indices"]) > 1 for c in store.read_manifest("clips")] == [True]


# ---------------------------------------------------------------------------------------------- frame rate


@pytest.mark.parametrize(("fps", "expected"), [(48, [0, 2, 4, 6, 8]), (12, [0, 1, 2, 3, 4])])
def test_frame_rate_keeps_every_nth_frame_and_never_upsamples(tiny_k5: Path, tmp_path: Path, fps: int,
                                                               expected: list[int]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "v.mp4", 24, 96, 64, fps=fps)
    (data / "v.txt").write_text("v", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                               "video": {"num_frames": 5, "frame_rate": 24}}])
    _, store = run_clips(config)
    (row,) = store.read_manifest("clips")
    assert list(row["indices"]) == expected
    frames = store.get("clips", [row["key"]])[row["key"]]["frames"]
    assert [read_index(f) for f in frames] == expected  # the decoded frames are those source frames


def test_a_variable_frame_rate_video_is_resampled_by_time(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    # 12 frames 1/30 s apart, then 12 frames 1/15 s apart (a phone dropping its rate in the dark), in ms
    pts = [round(1000 * i / 30) for i in range(12)] + [400 + round(1000 * i / 15) for i in range(12)]
    write_video(data / "v.mp4", 24, 96, 64, fps=30, pts=pts, time_base=Fraction(1, 1000))
    (data / "v.txt").write_text("v", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                               "video": {"num_frames": 13, "frame_rate": 15}}])
    _, store = run_clips(config)
    (row,) = store.read_manifest("clips")
    expected = [0, 2, 4, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18]  # every 1/15 s; by frame number: 0, 2, 3, 4, 6, ...
    assert list(row["indices"]) == expected
    assert [read_index(f) for f in store.get("clips", [row["key"]])[row["key"]]["frames"]] == expected


# ---------------------------------------------------------------------------------------------- incremental


def test_one_changed_or_removed_file_is_all_that_is_redone(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    paths = videos(data, 3)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    first, store = run_clips(config)
    assert (first.computed, first.reused) == (3, 0)
    assert (run_clips(config)[0].computed, run_clips(config)[0].reused) == (0, 3)
    write_h264(paths[0], num_frames=14, width=96, height=64)  # new bytes, same name
    changed, _ = run_clips(config)
    assert (changed.computed, changed.reused) == (1, 2)
    paths[1].unlink()
    removed, _ = run_clips(config)
    assert (removed.computed, removed.reused) == (0, 2)
    assert sorted(r["source"] for r in store.read_manifest("clips")) == ["clip_0.mp4", "clip_2.mp4"]
    paths[2].with_suffix(".txt").write_text("a new caption\n", encoding="utf-8")
    recaptioned, _ = run_clips(config)  # captions are not in the frames: nothing is decoded again
    assert recaptioned.computed == 0
    assert recaptioned.data_version != removed.data_version  # but downstream text_embeds is stale
    assert run_clips(config)[0].data_version == recaptioned.data_version
    assert ["a new caption"] in [r["captions"] for r in store.read_manifest("clips")]


def test_changed_resolution_redecodes_only_that_dataset(tiny_k5: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    videos(a, 2)
    videos(b, 1)
    sets = [{"id": "a", "instance_data_dir": str(a)}, {"id": "b", "instance_data_dir": str(b)}]
    first, store = run_clips(clips_config(tiny_k5, tmp_path, sets))
    assert first.computed == 3
    sets[1]["resolution"] = 32
    second, changed = run_clips(clips_config(tiny_k5, tmp_path, sets))
    assert (second.computed, second.reused) == (1, 2)
    assert {r["dataset"]: r["height"] for r in changed.read_manifest("clips")} == {"a": 64, "b": 32}
    assert {r["dataset"]: r["height"] for r in store.read_manifest("clips")} == {"a": 64, "b": 64}  # the first's list


def test_file_mtime_alone_changes_identity(tiny_k5: Path, tmp_path: Path) -> None:
    """Touching a file without changing its bytes re-decodes it (identity is path + size + mtime)."""
    data = tmp_path / "data"
    (path,) = videos(data, 1)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    run_clips(config)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again, store = run_clips(config)
    assert again.computed == 1 and len(store.read_manifest("clips")) == 1
    assert np.array_equal(*[store.get("clips", [k])[k]["frames"] for k in store.keys("clips")])


def test_latent_estimate_equals_what_the_latents_stage_writes(tiny_k5: Path, tmp_path: Path) -> None:
    from loraflow.stages.latents.latents import encode_latents

    data = tmp_path / "data"
    videos(data, 1, width=96, height=64)
    videos(data / "tall", 1, width=64, height=112)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    report, store = run_clips(config)
    encode_latents(config, get_family(config), model_source(config), store)
    latents = store.get("latents", [r["key"] for r in store.read_manifest("latents")])
    assert len(latents) == 2
    assert sum(v["latent"].nbytes for v in latents.values()) == report.est_latent_bytes
