"""Every entry of a dataset folder is accounted for: a clip, or a quarantine row with a reason (the clips stage and
`loraflow check` alike); sources far smaller than their bucket; frame rates near the target; captions by BOM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loraflow.cli import main
from loraflow.config import ConfigError
from loraflow.pipelines import get_family
from loraflow.stages.clips.bucket_plan import plan_buckets
from tests.factory import clips_config, demo_dict, run_clips, videos, write_config
from tests.media_factory import read_index, write_h264, write_text_as_video, write_video


def animated_gif(path: Path, frames: int = 4) -> Path:
    images = [Image.fromarray(np.full((64, 96, 3), 40 * i, np.uint8)) for i in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=40, loop=0)
    return path


def odd_folder(tmp_path: Path) -> Path:
    """One good clip beside every kind of entry that is not one."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    (good,) = videos(data, 1)
    animated_gif(data / "wave.gif").with_suffix(".txt").write_text("a wave")
    os.symlink(data / "gone.mp4.orig", data / "gone.mp4")  # dangling
    os.symlink("loop.mp4", data / "loop.mp4")  # a link to itself
    (data / "folder.mp4").mkdir()  # a folder named like a video
    videos(outside, 1)
    os.symlink(outside, data / "linked")  # a link to a folder of videos: not followed
    os.symlink(outside / "clip_0.mp4", data / "alias.mp4")  # a link out of the dataset: not read
    (data / "alias.txt").write_text("the linked video")
    os.symlink("clip_0.mp4", data / "inner.mp4")  # a link to a video of the dataset is that video
    (data / "inner.txt").write_text("the same video")
    (data / "orphan.txt").write_text("a caption whose video was deleted")
    (data / "notes.json").write_text("{}")
    (data / ".DS_Store").write_bytes(b"\0")  # hidden, not a media name: not data, no row
    (data / ".hidden.mp4").write_bytes(good.read_bytes())  # hidden but named like media: a row
    return data


EXPECTED = {"wave.gif": "unsupported_format", "gone.mp4": "broken_link", "loop.mp4": "broken_link",
            "folder.mp4": "not_a_file", "linked": "linked_folder", "orphan.txt": "not_used",
            "notes.json": "not_used", ".hidden.mp4": "hidden_file", "alias.mp4": "link_outside"}


def test_every_entry_that_is_not_a_clip_has_a_row_in_the_stage_and_the_plan(tiny_k5: Path, tmp_path: Path) -> None:
    data = odd_folder(tmp_path)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    report, store = run_clips(config)
    assert sorted(r["source"] for r in store.read_manifest("clips")) == ["clip_0.mp4", "inner.mp4"]
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert reasons == EXPECTED
    details = {Path(q.file).name: q.detail for q in report.quarantined}
    assert "symlink loop" in details["loop.mp4"] and "gone.mp4.orig" in details["gone.mp4"]
    assert ".mp4" in details["wave.gif"] and "ffmpeg" in details["wave.gif"]  # what is read, and how to convert
    assert {q["file"] for q in store.read_manifest("quarantine")} == {q.file for q in report.quarantined}
    plan = plan_buckets(config, get_family(config), None, progress=False)
    assert {Path(d.file).name: d.reason for d in plan.dropped} == EXPECTED


def test_check_lists_every_entry_that_is_not_a_clip(tiny_k5: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = odd_folder(tmp_path)
    settings = demo_dict(tiny_k5, data, tmp_path)
    settings["datasets"][0]["video"] = {"num_frames": 5}  # the folder's videos are 12 frames long
    config = write_config(tmp_path / "config.yaml", settings)
    assert main(["check", str(config)]) == 0
    listed = capsys.readouterr().out.split(f"dropped {len(EXPECTED)} file(s):")[1].splitlines()[2:]
    assert {line.split()[1]: line.split()[2] for line in listed} == EXPECTED


def test_a_caption_strategy_that_reads_no_text_files_says_so(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 1)  # clip_0.txt beside it, which caption_strategy filename never reads
    dataset = {"instance_data_dir": str(data), "caption_strategy": "filename"}
    report, _ = run_clips(clips_config(tiny_k5, tmp_path, [dataset]))
    (row,) = report.quarantined
    assert (Path(row.file).name, row.reason) == ("clip_0.txt", "not_used")
    assert "caption_strategy filename" in row.detail


def test_screen_recordings_camcorder_files_and_tiff_stills_become_clips(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_h264(data / "obs.ts", num_frames=12)  # OBS's recording format
    write_h264(data / "camcorder.m2ts", num_frames=12, container_options={"mpegts_m2ts_mode": "1"})  # AVCHD
    Image.fromarray(np.full((64, 96, 3), 128, np.uint8)).save(data / "scan.tif")
    (data / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic")  # no HEIC decoder here: still refused, with a way out
    os.mkfifo(data / "live.ts")  # a pipe named like a recording would block a decoder: never opened
    for name in ("obs", "camcorder", "scan", "phone"):
        (data / name).with_suffix(".txt").write_text(name)
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    clips = store.read_manifest("clips")
    assert {r["source"] for r in clips} == {"obs.ts", "camcorder.m2ts", "scan.tif"}
    assert {r["num_frames"] for r in clips if r["source"] != "scan.tif"} == {5}
    rows = {Path(q.file).name: q for q in report.quarantined}
    assert {name: q.reason for name, q in rows.items()} == {"phone.heic": "unsupported_format", "live.ts": "not_a_file"}
    row = rows["phone.heic"]
    assert ".ts" in row.detail and ".tif" in row.detail and ".png" in row.detail  # what is taken, what to convert to


# ---------------------------------------------------------------------------------------------- aspect ratio


def aspect_folder(tmp_path: Path) -> Path:
    """A 3:2 clip, a 16:1 banner too short for 5-frame clips (issue 35) and a 1:3 portrait strip."""
    data = tmp_path / "data"
    data.mkdir()
    for name, (width, height, frames) in {"plain.mp4": (96, 64, 12), "banner.mp4": (256, 16, 3),
                                          "strip.mp4": (32, 96, 12)}.items():
        write_h264(data / name, num_frames=frames, width=width, height=height)
        (data / name).with_suffix(".txt").write_text(name)
    return data


def test_aspect_limits_drop_sources_naming_the_ratio_and_the_limit(tiny_k5: Path, tmp_path: Path) -> None:
    data = aspect_folder(tmp_path)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "minimum_aspect_ratio": 0.5,
                                               "maximum_aspect_ratio": 2}])
    report, store = run_clips(config)
    assert [r["source"] for r in store.read_manifest("clips")] == ["plain.mp4"]
    rows = {Path(q.file).name: q for q in report.quarantined}
    assert {name: q.reason for name, q in rows.items()} == {"banner.mp4": "aspect_too_wide",
                                                            "strip.mp4": "aspect_too_tall"}
    assert "256x16" in rows["banner.mp4"].detail and "16 > maximum_aspect_ratio 2" in rows["banner.mp4"].detail
    assert "0.333 < minimum_aspect_ratio 0.5" in rows["strip.mp4"].detail
    plan = plan_buckets(config, get_family(config), None, progress=False)  # `loraflow buckets` says the same
    assert {Path(d.file).name: d.reason for d in plan.dropped} == {n: q.reason for n, q in rows.items()}


def test_without_aspect_limits_every_aspect_is_kept(tiny_k5: Path, tmp_path: Path) -> None:
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(aspect_folder(tmp_path))}]))
    assert [r["source"] for r in store.read_manifest("clips")] == ["plain.mp4", "strip.mp4"]
    assert [(Path(q.file).name, q.reason) for q in report.quarantined] == [("banner.mp4", "too_short")]


# ---------------------------------------------------------------------------------------------- source size


def test_a_source_far_smaller_than_its_bucket_is_quarantined(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 1, width=96, height=64)
    write_video(data / "tiny.mp4", 8, 2, 2)  # 2x2 px: a 64 px bucket would upscale it 32x
    (data / "tiny.txt").write_text("a tiny video")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    assert [r["source"] for r in store.read_manifest("clips")] == ["clip_0.mp4"]
    (row,) = report.quarantined
    assert (Path(row.file).name, row.reason) == ("tiny.mp4", "source_too_small")
    assert "2x2" in row.detail and "minimum_image_size" in row.detail


@pytest.mark.parametrize(("resolution_type", "kept"), [("pixel", {"big.mp4"}), ("area", {"big.mp4", "wide.mp4"})])
def test_minimum_image_size_is_the_shorter_side_or_the_area_edge(tiny_k5: Path, tmp_path: Path,
                                                                 resolution_type: str, kept: set[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name, (width, height) in {"big.mp4": (96, 64), "wide.mp4": (128, 48), "small.mp4": (64, 48)}.items():
        write_h264(data / name, num_frames=6, width=width, height=height)
        (data / name).with_suffix(".txt").write_text(name)
    # pixel: shorter side >= 64 (128x48 is out); area: sqrt(w*h) >= 64 (128x48 = 78 px edge is in, 64x48 = 55 out)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "minimum_image_size": 64,
                                               "resolution_type": resolution_type}])
    report, store = run_clips(config)
    assert {r["source"] for r in store.read_manifest("clips")} == kept
    assert {q.reason for q in report.quarantined} == {"source_too_small"}


@pytest.mark.parametrize(("entry", "message"), [
    ({"minimum_image_size": -1}, "minimum_image_size: .*greater than or equal to 0"),
    ({"minimum_image_size": 1, "resolution_type": "area"}, "minimum_image_size.*megapixels"),
    ({"maximum_aspect_ratio": 0}, "maximum_aspect_ratio: .*greater than 0"),
    ({"minimum_aspect_ratio": 2, "maximum_aspect_ratio": 1.5}, "minimum_aspect_ratio` 2.0 is above `maximum"),
])
def test_a_bad_size_or_aspect_limit_fails_at_load_naming_the_key(tiny_k5: Path, tmp_path: Path, entry: dict,
                                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(tmp_path), **entry}])


# ---------------------------------------------------------------------------------------------- frame rate


def test_a_49_frame_25_fps_clip_is_kept_at_24_fps(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "pal.mp4", 49, 96, 64, fps=25)
    (data / "pal.txt").write_text("a PAL clip")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                               "video": {"num_frames": 49, "min_frames": 49}}])  # flavour: 24 fps
    report, store = run_clips(config)
    assert report.quarantined == ()
    (row,) = store.read_manifest("clips")
    assert list(row["indices"]) == list(range(49))  # 25 fps is within 5% of 24: every frame, 1:1
    assert [read_index(f) for f in store.get("clips", [row["key"]])[row["key"]]["frames"]] == list(range(49))


@pytest.mark.parametrize(("frames", "fps", "video", "words"), [
    (45, 25, {"num_frames": 49}, ["45 frames", "25 fps", "24 fps", "1:1"]),  # near the target: not resampled
    (60, 48, {"num_frames": 5, "min_frames": 49}, ["60 frames at 48 fps", "30 frames at 24 fps"]),  # resampled
    (60, 48, {"num_frames": 5, "max_frames": 25}, ["60 frames at 48 fps", "30 frames at 24 fps"]),
])
def test_every_rate_related_drop_names_both_rates_and_both_counts(tiny_k5: Path, tmp_path: Path, frames: int,
                                                                  fps: int, video: dict, words: list[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "v.mp4", frames, 96, 64, fps=fps)
    (data / "v.txt").write_text("v")
    report, _ = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "video": video}]))
    (row,) = report.quarantined
    assert row.reason in ("too_short", "too_long")
    assert all(w in row.detail for w in words), row.detail


# ---------------------------------------------------------------------------------------------- captions


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])  # (a UTF-8 BOM was read before)
def test_captions_with_a_byte_order_mark_are_read(tiny_k5: Path, tmp_path: Path, encoding: str) -> None:
    data = tmp_path / "data"
    (video,) = videos(data, 1, captions=False)
    bom = {"utf-16-be": "\ufeff"}.get(encoding, "")  # Python writes the BOM itself for utf-16
    video.with_suffix(".txt").write_text(bom + "café au lait\nsecond line\n", encoding=encoding)
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    assert report.quarantined == ()
    assert store.read_manifest("clips")[0]["captions"] == ["café au lait", "second line"]


# ------------------------------------------------------------------ hostile and careless input (issue 42)


def test_links_out_of_the_dataset_are_quarantined_unread_unless_the_dataset_allows_them(tiny_k5: Path,
                                                                                        tmp_path: Path) -> None:
    data, library = tmp_path / "data", tmp_path / "library"
    good, stolen, latin = videos(data, 3)
    stolen.with_suffix(".txt").unlink()
    stolen.with_suffix(".txt").symlink_to("/etc/passwd")  # from someone else's archive
    (far,) = videos(library, 1, captions=False)
    (library / "notes.txt").write_bytes(b"caf\xe9")  # read, it would be caption_not_utf8
    latin.with_suffix(".txt").unlink()
    latin.with_suffix(".txt").symlink_to(library / "notes.txt")
    write_text_as_video(library / "text.mp4")  # probed, it would be a media error
    for name, target in {"far.mp4": far, "text.mp4": library / "text.mp4", "inner.mp4": Path(good.name)}.items():
        (data / name).symlink_to(target)  # inner.mp4: a link inside the dataset is that file
        (data / name).with_suffix(".txt").write_text(name)
    dataset = {"instance_data_dir": str(data)}
    config = clips_config(tiny_k5, tmp_path, [dataset])
    report, store = run_clips(config)
    clips = store.read_manifest("clips")
    assert sorted(r["source"] for r in clips) == [good.name, "inner.mp4"]
    assert not any("root:" in c for r in clips for c in r["captions"])  # /etc/passwd was not read
    rows = {Path(q.file).name: q for q in report.quarantined}
    assert {name: q.reason for name, q in rows.items()} == {
        stolen.name: "link_outside", latin.name: "link_outside", "far.mp4": "link_outside", "text.mp4": "link_outside"}
    assert "/etc/passwd" in rows[stolen.name].detail and "allow_links_outside: true" in rows[stolen.name].detail
    plan = plan_buckets(config, get_family(config), None, progress=False)  # `check` reads nothing outside either
    assert {Path(d.file).name: d.reason for d in plan.dropped} == {n: q.reason for n, q in rows.items()}

    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{**dataset, "allow_links_outside": True}]))
    assert sorted(r["source"] for r in store.read_manifest("clips")) == sorted(
        [good.name, "inner.mp4", stolen.name, "far.mp4"])
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert reasons[latin.name] == "caption_not_utf8" and reasons["text.mp4"] not in ("link_outside", None)


def test_a_metadata_file_or_a_mask_linked_from_outside_is_not_read(tiny_k5: Path, tmp_path: Path) -> None:
    data, masks, library = tmp_path / "data", tmp_path / "masks", tmp_path / "library"
    first, second = videos(data, 2, captions=False)
    library.mkdir()
    (library / "captions.jsonl").write_text("".join(json.dumps({"file_name": v.name, "caption": "from far away"}) + "\n"
                                                    for v in (first, second)))
    (data / "captions.jsonl").symlink_to(library / "captions.jsonl")
    masks.mkdir()
    Image.fromarray(np.full((64, 96, 3), 255, np.uint8)).save(masks / f"{first.stem}.png")
    Image.fromarray(np.full((64, 96, 3), 255, np.uint8)).save(library / "mask.png")
    (masks / f"{second.stem}.png").symlink_to(library / "mask.png")
    mask_set = {"id": "masks", "dataset_type": "conditioning", "conditioning_type": "mask",
                "instance_data_dir": str(masks)}
    videos_set = {"instance_data_dir": str(data), "conditioning_data": "masks"}
    report, _ = run_clips(clips_config(tiny_k5, tmp_path, [
        {**videos_set, "caption_strategy": "metadata", "metadata_file": "captions.jsonl"}, mask_set]))
    assert {(Path(q.file).name, q.reason) for q in report.quarantined} == {
        (first.name, "link_outside"), (second.name, "link_outside")}
    (data / "captions.jsonl").unlink()
    for video in (first, second):
        video.with_suffix(".txt").write_text("a caption")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [videos_set, mask_set]))
    assert [r["source"] for r in store.read_manifest("clips")] == [first.name]
    (row,) = report.quarantined
    assert (Path(row.file).name, row.reason) == (second.name, "link_outside") and "mask.png" in row.detail
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [videos_set, {**mask_set, "allow_links_outside": True}]))
    assert report.quarantined == () and len(store.read_manifest("clips")) == 2


def test_caption_files_are_found_whatever_the_case_of_their_extension(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    upper, mixed, both, plain = videos(data, 4, captions=False)
    upper.with_suffix(".TXT").write_text("from a camera")
    mixed.with_suffix(".Txt").write_text("from a Windows tool")
    both.with_suffix(".txt").write_text("one")
    both.with_suffix(".TXT").write_text("the other")
    plain.with_suffix(".txt").write_text("plain")
    (data / "orphan.TXT").write_text("a caption whose video was deleted")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    captions = {r["source"]: r["captions"] for r in store.read_manifest("clips")}
    assert captions == {upper.name: ["from a camera"], mixed.name: ["from a Windows tool"], plain.name: ["plain"]}
    rows = {Path(q.file).name: q for q in report.quarantined}
    assert {name: q.reason for name, q in rows.items()} == {both.name: "ambiguous_caption", "orphan.TXT": "not_used"}
    assert f"{both.stem}.txt" in rows[both.name].detail and f"{both.stem}.TXT" in rows[both.name].detail
    assert "no video or image" in rows["orphan.TXT"].detail


def test_runaway_captions_are_quarantined_by_limits_the_dataset_can_raise(tiny_k5: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    many, most, long, huge, fine = videos(data, 5, captions=False)
    many.with_suffix(".txt").write_text("".join(f"caption {i}\n" for i in range(101)))  # a log saved as a caption
    most.with_suffix(".txt").write_text("".join(f"caption {i}\n\n" for i in range(100)))  # blank lines do not count
    long.with_suffix(".txt").write_text("word " * 2000 + "w\n")  # 10,001 characters
    huge.with_suffix(".txt").write_bytes(b"x" * (5 << 20))  # 5 MiB on one line: not read whole
    fine.with_suffix(".txt").write_text("w" * 10_000)
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    assert sorted(r["source"] for r in store.read_manifest("clips")) == [most.name, fine.name]
    rows = {Path(q.file).name: q for q in report.quarantined}
    assert {name: q.reason for name, q in rows.items()} == {
        many.name: "too_many_captions", long.name: "caption_too_long", huge.name: "caption_too_long"}
    assert "101" in rows[many.name].detail and "max_captions_per_file (100)" in rows[many.name].detail
    assert "10001" in rows[long.name].detail and "max_caption_chars (10000)" in rows[long.name].detail
    assert all(len(q.detail) < 400 for q in rows.values())  # the caption itself is never in the row

    dataset = {"instance_data_dir": str(data), "max_captions_per_file": 101, "max_caption_chars": 6 << 20}
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [dataset]))
    assert report.quarantined == () and len(store.read_manifest("clips")) == 5

    settings = demo_dict(tiny_k5, data, tmp_path)  # `check` shows the limits and what they drop
    settings["datasets"][0].update(video={"num_frames": 5}, max_caption_chars=5000)
    assert main(["check", "--no-estimates", str(write_config(tmp_path / "config.yaml", settings))]) == 0
    out = capsys.readouterr().out
    assert "at most 100 caption(s) per file (max_captions_per_file), 5000 characters each (max_caption_chars)" in out
    dropped = {line.split()[1]: line.split()[2] for line in out.split("dropped 4 file(s):")[1].splitlines()[2:]}
    assert dropped == {many.name: "too_many_captions", long.name: "caption_too_long", huge.name: "caption_too_long",
                       fine.name: "caption_too_long"}


@pytest.mark.parametrize(("caption", "named"), [
    ("a cat\x00", "U+0000 at character 6 (a NUL mostly means UTF-16"),
    ("a \x1b[31mred\x1b[0m cat", "U+001B at character 3 (an ESC begins a terminal colour"),  # it spoke of NUL
    ("a\x7fcat", "U+007F"),
    # issue 62 item 4: bidi controls and zero-width characters were stored as written (a shown caption spoofed)
    ("a cat \u202eyrev\u202c", "U+202E at character 7 (a bidi control reorders"),
    ("a \u2066dog\u2069", "U+2066"),
    ("a c\u200bat", "U+200B at character 4 (a zero-width character is invisible"),
    ("a\u200dcat", "U+200D"), ("a\u2060cat", "U+2060"), ("a cat\ufeff", "U+FEFF at character 6"),
])
def test_a_caption_with_control_characters_is_quarantined(tiny_k5: Path, tmp_path: Path, caption: str,
                                                          named: str) -> None:
    data = tmp_path / "data"
    bad, tabbed = videos(data, 2, captions=False)
    bad.with_suffix(".txt").write_text(f"a fine caption\n{caption}\n")
    # a tab and Windows line ends are text; a byte-order mark at a caption's start is the mark, dropped
    tabbed.with_suffix(".txt").write_text("a cat\tsitting\r\n\ufeffon a mat\n")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    assert {r["source"]: r["captions"] for r in store.read_manifest("clips")} == {
        tabbed.name: ["a cat\tsitting", "on a mat"]}
    (row,) = report.quarantined
    assert (Path(row.file).name, row.reason) == (bad.name, "caption_control_chars")
    assert named in row.detail and "caption 2" in row.detail


def test_a_metadata_caption_with_a_nul_is_quarantined(tiny_k5: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    bad, good = videos(data, 2, captions=False)
    (data / "captions.jsonl").write_text(json.dumps({"file_name": bad.name, "caption": "a\u0000cat"}) + "\n"
                                         + json.dumps({"file_name": good.name, "caption": "two\nlines"}) + "\n")
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                                                "caption_strategy": "metadata",
                                                                "metadata_file": "captions.jsonl"}]))
    assert {r["source"]: r["captions"] for r in store.read_manifest("clips")} == {good.name: ["two\nlines"]}
    assert [(Path(q.file).name, q.reason) for q in report.quarantined] == [(bad.name, "caption_control_chars")]
