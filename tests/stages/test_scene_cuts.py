"""Long recordings (`video.scene_cuts: detect`, docs/footage.md): PySceneDetect finds the hard cuts, clips are chosen
inside scenes only, the cut list is cached with the file's version, per-scene captions, and the picture of the cuts.

The footage is real H.264 (tests/media_factory.write_footage): a blue source cut hard to a pale yellow one, which
dissolves over 16 frames into a green one (a fade, not a cut). The left half of each frame is its source's colour,
the right half its frame index.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import loraflow.media.frames as frames
from loraflow.contracts.clip_rows import read_clips
from loraflow.media.frames import ProbeCache
from loraflow.stages.clips import buckets
from loraflow.store import Store
from tests.contracts.test_clip_rows import CLIP_COLUMNS, SCENE_COLUMNS
from tests.factory import clips_config, run_clips
from tests.media_factory import read_index, write_footage

BLUE, YELLOW, GREEN = (20, 30, 120), (240, 230, 180), (60, 200, 90)
CUT = 40  # the first frame of the yellow source: the one hard cut
FADE = range(64, 80)  # yellow dissolving into green: no cut


def footage(folder: Path, name: str = "long.mp4") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_footage(folder / name, [(CUT, BLUE), (40, YELLOW), (40, GREEN)], fades={1: len(FADE)})


def scene_config(model: Path, root: Path, data: Path, **video: object):
    return clips_config(model, root, [{"instance_data_dir": str(data), "caption_strategy": "instanceprompt",
                                       "instance_prompt": "a recording",
                                       "video": {"num_frames": 17, "frame_extraction": "chunk", **video}}])


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ProbeCache, "_memory", OrderedDict())  # nothing probed or detected in this process yet


def test_clips_lie_inside_scenes_on_both_sides_of_the_cut_and_the_fade_is_no_cut(
        tiny_k5: Path, tmp_path: Path, fresh_process: None) -> None:
    footage(tmp_path / "data")
    config = scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect")
    report, store = run_clips(config)
    clips = read_clips(store)
    assert [(c.indices[0], c.indices[-1], c.scene.number) for c in clips] == [
        (0, 16, 1), (17, 33, 1),  # scene 1: frames 0-39, two chunks of 17
        (40, 56, 2), (57, 73, 2), (74, 90, 2), (91, 107, 2)]  # scene 2: 40-119, through the fade
    for clip in clips:
        assert (clip.indices[0] < CUT) == (clip.indices[-1] < CUT), f"{clip.indices} spans the cut at {CUT}"
    # the span in the source: frame / 24 fps, to the end of the last frame
    assert [(c.scene.start_s, c.scene.end_s) for c in clips][2] == (round(40 / 24, 6), round(57 / 24, 6))
    # the frames stored are those frames, of one source each
    stored = store.get("clips", [c.key for c in clips])
    for clip in clips:
        frames_ = stored[clip.key]["frames"]
        assert [read_index(f) for f in frames_] == list(clip.indices)
    assert [source_of(stored[c.key]["frames"][0]) for c in clips[:3]] == [BLUE, BLUE, YELLOW]
    (row,) = report.scenes
    assert (row.file, row.scenes, row.used, row.cuts) == ("long.mp4", 2, 2, (CUT,))
    manifest = pq.read_schema(Store(config.cache_dir, config.manifest_names).manifest_file("clips", "d0"))
    assert {f.name: str(f.type) for f in manifest} == {**CLIP_COLUMNS, **SCENE_COLUMNS}  # the columns, pinned


def test_without_scene_cuts_a_chunk_spans_the_cut(tiny_k5: Path, tmp_path: Path, fresh_process: None) -> None:
    """What `detect` prevents: the same recording chunked as one video (the default, `off`)."""
    footage(tmp_path / "data")
    _, store = run_clips(scene_config(tiny_k5, tmp_path, tmp_path / "data"))
    clips = read_clips(store)
    assert any(c.indices[0] < CUT <= c.indices[-1] for c in clips)
    assert all(c.scene is None for c in clips) and "scene" not in store.read_manifest("clips")[0]


def test_a_rerun_reuses_the_cut_list(tiny_k5: Path, tmp_path: Path, fresh_process: None,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    footage(tmp_path / "data")
    config = scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect")
    _, store = run_clips(config)
    first = read_clips(store)
    assert len(store.keys("scenes")) == 1

    original = frames._run_in_worker

    def no_detection(request: tuple, path: Path, timeout_s: float) -> dict:
        assert request[0] != "scenes", f"{path}: scenes detected again"
        return original(request, path, timeout_s)

    monkeypatch.setattr(ProbeCache, "_memory", OrderedDict())  # the next run: a new process
    monkeypatch.setattr(frames, "_run_in_worker", no_detection)
    report, store = run_clips(config)
    assert read_clips(store) == first and report.computed == 0
    # another threshold is another cut list: detected, and stored beside the first
    monkeypatch.setattr(frames, "_run_in_worker", original)
    _, other = run_clips(scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect", scene_threshold=200.0))
    assert len(store.keys("scenes")) == 2
    assert {c.scene.number for c in read_clips(other)} == {1}  # nothing changes that much: one scene
    assert read_clips(store) == first  # the first threshold's list stands beside it


def test_the_picture_shows_each_cut_between_its_two_sources(tiny_k5: Path, tmp_path: Path,
                                                            fresh_process: None) -> None:
    from loraflow.media.previews import CUT_FRAMES, cut_strips

    footage(tmp_path / "data")
    report, _ = run_clips(scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect"))
    sheet = np.asarray(cut_strips(report.scenes))
    tiles = strip_tiles(sheet)
    assert len(tiles) == 2 * CUT_FRAMES  # the frames before the cut, then those after it
    assert [source_of(tile) for tile in tiles] == [BLUE] * CUT_FRAMES + [YELLOW] * CUT_FRAMES


def source_of(frame: np.ndarray) -> tuple[int, int, int]:
    """Which source's colour the frame's left quarter is nearest (coding moves dark blue by up to ~20 levels)."""
    colour = frame[:, : frame.shape[1] // 4].reshape(-1, 3).mean(0)
    return min((BLUE, YELLOW, GREEN), key=lambda c: float(np.abs(colour - c).sum()))


def strip_tiles(sheet: np.ndarray) -> list[np.ndarray]:
    """The frame tiles of a one-cut strip: runs of columns that are not background white, below the label line."""
    from loraflow.media.previews import TEXT_HEIGHT

    body = sheet[TEXT_HEIGHT + 2:]
    filled = (body < 250).any(axis=2).any(axis=0)
    edges = np.flatnonzero(np.diff(np.r_[0, filled.astype(int), 0]))
    return [body[:, a:b] for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a > 8]


def test_a_scene_of_its_own_caption_file_takes_it_the_others_the_files(tiny_k5: Path, tmp_path: Path,
                                                                        fresh_process: None) -> None:
    data = tmp_path / "data"
    video = footage(data)
    video.with_suffix(".txt").write_text("a long recording\n", encoding="utf-8")
    (data / "long.0002.txt").write_text("the yellow scene\n", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                               "video": {"num_frames": 17, "scene_cuts": "detect"}}])
    report, store = run_clips(config)
    assert {(c.scene.number, c.captions) for c in read_clips(store)} == {
        (1, ("a long recording",)), (2, ("the yellow scene",))}
    assert report.quarantined == ()  # long.0002.txt is read, not `not_used`

    video.with_suffix(".txt").unlink()  # scene 1 has no caption now: the file's is needed, and named
    report, store = run_clips(config)
    (dropped,) = report.quarantined
    assert dropped.reason == "missing_caption" and "long.0001.txt" in dropped.detail and "long.txt" in dropped.detail


def test_a_scene_caption_without_scene_cuts_is_reported_unused(tiny_k5: Path, tmp_path: Path,
                                                                fresh_process: None) -> None:
    data = tmp_path / "data"
    footage(data).with_suffix(".txt").write_text("a long recording\n", encoding="utf-8")
    (data / "long.0002.txt").write_text("the yellow scene\n", encoding="utf-8")
    report, _ = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}]))
    (row,) = report.quarantined
    assert (row.reason, Path(row.file).name) == ("not_used", "long.0002.txt") and "scene_cuts" in row.detail


def test_scenes_too_short_for_a_clip_yield_none_and_a_file_of_only_those_is_dropped_saying_so(
        tiny_k5: Path, tmp_path: Path, fresh_process: None) -> None:
    footage(tmp_path / "data")
    _, store = run_clips(scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect", num_frames=45))
    assert [(c.scene.number, c.indices[0]) for c in read_clips(store)] == [(2, 40)]  # scene 1 has 40 frames < 45
    report, store = run_clips(scene_config(tiny_k5, tmp_path, tmp_path / "data", scene_cuts="detect",
                                           num_frames=85))
    (row,) = report.quarantined
    assert row.reason == "too_short" and "none of its 2 scenes" in row.detail and "40 < num_frames 85" in row.detail


@pytest.mark.parametrize(("timeline", "cuts", "expected"), [
    ([0, 1, 2, 3, 4, 5], [3], [[0, 1, 2], [3, 4, 5]]),
    ([0, 2, 4, 6, 8], [3, 5], [[0, 2], [4], [6, 8]]),  # resampled: a cut between two kept frames
    ([0, 2, 4], [1, 2, 3], [[0], [], [2], [4]]),  # a scene without a kept frame is empty, not dropped
    ([0, 1, 2], [], [[0, 1, 2]]),
])
def test_scene_timelines_split_at_each_cut(timeline: list[int], cuts: list[int], expected: list[list[int]]) -> None:
    assert buckets.scene_timelines(timeline, cuts) == expected


def test_cut_times_become_the_first_frames_of_their_scenes() -> None:
    probe = frames.Probe(width=8, height=8, num_frames=50, fps=24.0, is_vfr=False, duration_s=50 / 24, rotation=0,
                         pix_fmt="yuv420p", bit_depth=8, has_audio=False, codec="h264", is_image=False)
    assert frames.cut_frames([40 / 24 + 0.004, 0.0, 49.9 / 24, 3.0], probe) == (40,)  # 0, the end, past it: no cut


def test_the_clips_asset_shows_the_scenes_and_the_cut(tiny_k5: Path, tmp_path: Path, fresh_process: None) -> None:
    import base64
    import io

    from dagster import DagsterInstance, materialize
    from PIL import Image

    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.stages import clips
    from loraflow.media.previews import CUT_FRAMES
    from tests.factory import demo_dict, write_config

    data = tmp_path / "data"
    footage(data).with_suffix(".txt").write_text("a long recording\n", encoding="utf-8")
    settings = demo_dict(tiny_k5, data, tmp_path)
    settings["datasets"][0]["video"] |= {"frame_extraction": "chunk", "scene_cuts": "detect"}
    config = write_config(tmp_path / "config.yaml", settings)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("datasets", ["demo-videos"])
        done = materialize([clips], partition_key="demo-videos", instance=instance,
                           resources={"loraflow": LoraflowResource(config_path=str(config))})
    meta = {k: v.value for k, v in done.asset_materializations_for_node("clips")[0].metadata.items()}
    assert meta["clips"] == 6
    assert "| long.mp4 | 2 | 2 | 40 |" in meta["scenes"]
    png = base64.b64decode(meta["scene_cuts"].split("base64,", 1)[1].rstrip(")"))
    tiles = strip_tiles(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")))
    assert [source_of(tile) for tile in tiles] == [BLUE] * CUT_FRAMES + [YELLOW] * CUT_FRAMES


def test_a_caption_for_a_scene_the_file_lacks_is_reported_and_the_file_kept(tiny_k5: Path, tmp_path: Path,
                                                                             fresh_process: None) -> None:
    data = tmp_path / "data"
    footage(data).with_suffix(".txt").write_text("a long recording\n", encoding="utf-8")
    (data / "long.0003.txt").write_text("a third scene\n", encoding="utf-8")  # there are two
    report, store = run_clips(clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data),
                                                                "video": {"num_frames": 17, "scene_cuts": "detect"}}]))
    (row,) = report.quarantined
    assert (row.reason, Path(row.file).name) == ("not_used", "long.0003.txt") and "has 2 scenes" in row.detail
    assert {c.scene.number for c in read_clips(store)} == {1, 2}


def test_an_image_beside_the_footage_is_one_scene(tiny_k5: Path, tmp_path: Path, fresh_process: None) -> None:
    from tests.media_factory import write_image

    data = tmp_path / "data"
    footage(data)
    write_image(data / "still.png", 96, 64)
    report, store = run_clips(scene_config(tiny_k5, tmp_path, data, scene_cuts="detect"))
    rows = {(Path(c.path).name, c.scene.number) for c in read_clips(store)}
    assert ("still.png", 1) in rows and ("long.mp4", 2) in rows and report.quarantined == ()
    assert [r.file for r in report.scenes] == ["long.mp4"]  # an image has no cuts to show
