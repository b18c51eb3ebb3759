"""Probe and decode REAL files written by tests/media_factory.py (PyAV encoders, no mocks).

Every video frame encodes its own index (see media_factory), so each test checks that the
decoded frame is exactly the requested source frame, not just that something came back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import signal
import sys
import threading
import tracemalloc
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds media_factory

import media_factory as mf  # noqa: E402

from loraflow.media import decode_worker as media_decode  # noqa: E402
from loraflow.media import frames as media
from loraflow.media.frames import MediaError, Probe, decode_frames, probe  # noqa: E402

LOGGER = "loraflow.media.frames"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind of file once per module: encoding is the slow part."""
    d = tmp_path_factory.mktemp("media")
    return {
        "h264": mf.write_h264(d / "clip.mp4"),
        "vfr": mf.write_vfr(d / "vfr.mp4"),
        "rot90": mf.write_rotated(d / "rot90.mp4", 90),
        "rot180": mf.write_rotated(d / "rot180.mp4", 180),
        "rot270": mf.write_rotated(d / "rot270.mp4", 270),
        "10bit": mf.write_10bit(d / "tenbit.mp4"),
        "odd": mf.write_odd_size(d / "odd.mp4"),
        "mov": mf.write_mov(d / "clip.mov"),
        "webm": mf.write_webm_vp9(d / "clip.webm"),
        "audio_only": mf.write_audio_only(d / "speech.m4a"),
        "truncated": mf.write_truncated(d / "cut.mp4"),
        "truncated_faststart": mf.write_truncated(d / "cut_faststart.mp4", faststart=True),
        "zero": mf.write_zero_bytes(d / "zero.mp4"),
        "text": mf.write_text_as_video(d / "caption.mp4"),
        "unknown_codec": mf.write_unknown_codec(d / "zzzz.mp4"),
        "corrupt_header": mf.write_corrupt_header(d / "badavcc.mp4"),
        "broken_audio": mf.write_video(d / "broken_audio.mp4", 20, 96, 64, audio="broken"),
        "edit_list": mf.write_edit_list(d / "trimmed.mp4"),
        "long": mf.write_long(d / "long.mp4"),
        "png": mf.write_image(d / "still.png", 64, 48, index=7),
        "jpg": mf.write_image(d / "still.jpg", 80, 60, index=9),
        "jpg_exif90": mf.write_image(d / "portrait.jpg", 80, 60, index=3, exif_rotation_cw=90),
        "png16": mf.write_png16(d / "deep.png"),
        "rgba": mf.write_rgba_png(d / "alpha.png"),
    }


def indices_of(frames: np.ndarray, rotation: int = 0) -> list[int]:
    """Read back the index drawn in each frame, after undoing a display rotation."""
    return [mf.read_index(np.rot90(f, k=rotation // 90)) for f in frames]


def backend_used(caplog: pytest.LogCaptureFixture) -> str:
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER and " via " in r.getMessage()][-1]
    return line.split(" via ")[1].split()[0]


# ------------------------------------------------------------------------------------ probe


def test_probe_plain_h264(files: dict[str, Path]) -> None:
    assert probe(files["h264"]) == Probe(
        width=96, height=64, num_frames=30, fps=24.0, is_vfr=False, duration_s=1.25, rotation=0,
        pix_fmt="yuv420p", bit_depth=8, has_audio=False, codec="h264", is_image=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("key", "frames", "size", "codec"),
    [("mov", 14, (80, 80), "h264"), ("webm", 16, (96, 64), "vp9"), ("odd", 10, (97, 55), "mpeg4"),
     ("long", 2000, (96, 64), "h264")],
)  # fmt: skip
def test_probe_counts_and_sizes(files: dict[str, Path], key: str, frames: int, size: tuple[int, int],
                                codec: str) -> None:
    info = probe(files[key])
    assert (info.num_frames, (info.width, info.height), info.codec) == (frames, size, codec)
    assert info.fps == pytest.approx(24.0) and not info.is_vfr
    assert info.duration_s == pytest.approx(frames / 24.0)


def test_probe_vfr(files: dict[str, Path]) -> None:
    info = probe(files["vfr"])
    assert info.is_vfr and info.num_frames == 30
    assert len(info.frame_times) == 30 and info.frame_times[:4] == (0.0, 0.06, 0.08, 0.14)  # seconds
    assert info.fps == pytest.approx(25.0, rel=0.05)  # 20 ms / 60 ms alternating = 25 fps average
    assert info.duration_s == pytest.approx(30 / info.fps)


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_probe_rotation_swaps_display_size(files: dict[str, Path], rotation: int) -> None:
    info = probe(files[f"rot{rotation}"])
    assert info.rotation == rotation
    assert (info.width, info.height) == ((80, 128) if rotation in (90, 270) else (128, 80))


def test_probe_10bit(files: dict[str, Path]) -> None:
    info = probe(files["10bit"])
    assert (info.pix_fmt, info.bit_depth, info.num_frames) == ("yuv420p10le", 10, 12)


def test_probe_edit_list_counts_only_shown_frames(files: dict[str, Path]) -> None:
    # 30 frames stored, the first 5 hidden by the edit list: players show 25.
    info = probe(files["edit_list"])
    assert info.num_frames == 25 and not info.is_vfr and info.fps == pytest.approx(24.0)


def test_probe_broken_audio_still_usable(files: dict[str, Path]) -> None:
    info = probe(files["broken_audio"])
    assert info.has_audio and info.num_frames == 20


@pytest.mark.parametrize("key", ["h264", "edit_list", "rot90", "10bit", "broken_audio", "long"])
def test_mp4_index_count_matches_reading_every_packet(files: dict[str, Path], key: str) -> None:
    # probe counts MP4 frames from the sample table without reading them; check it against
    # actually demuxing every packet.
    with media_decode._open_container(files[key]) as container:
        stream = media_decode._video_stream(container, files[key])
        from_index = media_decode._timestamps_from_index(stream, files[key])
    with media_decode._open_container(files[key]) as container:
        from_packets = media_decode._timestamps_from_demux(container, media_decode._video_stream(container, files[key]),
                                                           files[key])
    assert from_index is not None and from_index[0] == from_packets[0]


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("audio_only", "no_video_stream"),
        ("truncated", "truncated"),
        ("truncated_faststart", "truncated"),
        ("zero", "empty_file"),
        ("text", "not_media"),
        ("unknown_codec", "unsupported_codec"),
        ("corrupt_header", "unreadable"),
    ],
)
def test_probe_rejects_bad_files_with_a_reason(files: dict[str, Path], key: str, reason: str) -> None:
    with pytest.raises(MediaError) as caught:
        probe(files[key])
    assert caught.value.reason == reason
    assert str(files[key]) in str(caught.value)  # the message names the file


def test_probe_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MediaError) as caught:
        probe(tmp_path / "nope.mp4")
    assert caught.value.reason == "unreadable"


def test_media_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(MediaError("truncated", "x.mp4: cut short")))
    assert (err.reason, str(err)) == ("truncated", "x.mp4: cut short")


# ----------------------------------------------------------------------------------- decode


def test_decode_exact_frames_full_size(files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    wanted = [0, 1, 2, 15, 28, 29]
    frames = decode_frames(files["h264"], wanted, (64, 96))
    assert frames.dtype == np.uint8 and frames.shape == (6, 64, 96, 3)
    assert indices_of(frames) == wanted
    assert backend_used(caplog) == "decord"
    # RGB order: the marker is pure red, in the top-left corner.
    assert mf.marker_corner(frames[0]) == "tl"
    assert frames[0, 2, 2].tolist() == pytest.approx([255, 0, 0], abs=12)


def test_decode_resizes_repeats_and_keeps_order(files: dict[str, Path]) -> None:
    frames = decode_frames(files["h264"], [20, 3, 3, 7], (48, 72))
    assert frames.shape == (4, 48, 72, 3)
    assert indices_of(frames) == [20, 3, 3, 7]


@pytest.mark.parametrize("key", ["vfr", "mov", "webm", "odd", "broken_audio", "10bit"])
def test_decode_content_matches_source(files: dict[str, Path], key: str) -> None:
    info = probe(files[key])
    wanted = sorted({0, 1, info.num_frames // 2, info.num_frames - 2, info.num_frames - 1})
    frames = decode_frames(files[key], wanted, (info.height, info.width))
    assert indices_of(frames) == wanted


def test_decode_odd_target_size(files: dict[str, Path]) -> None:
    frames = decode_frames(files["odd"], [4], (33, 65))
    assert frames.shape == (1, 33, 65, 3) and indices_of(frames) == [4]


def test_decode_10bit_levels_are_scaled_not_wrapped(files: dict[str, Path]) -> None:
    # A 10-bit sample read as 8-bit would be 4x too bright or wrap; check the grey levels.
    frame = decode_frames(files["10bit"], [5], (64, 96))[0]
    band = frame[5:15, 60:90].astype(float)  # top band holds digit 5 % 14 = 5
    assert band.mean() == pytest.approx(mf.level(5), abs=4)


@pytest.mark.parametrize(("rotation", "corner"), [(90, "tr"), (180, "br"), (270, "bl")])
def test_decode_applies_rotation(files: dict[str, Path], rotation: int, corner: str) -> None:
    # The coded top-left marker ends where a player shows it after turning clockwise.
    info = probe(files[f"rot{rotation}"])
    frames = decode_frames(files[f"rot{rotation}"], [0, 5, 11], (info.height, info.width))
    assert frames.shape == (3, info.height, info.width, 3)
    assert [mf.marker_corner(f) for f in frames] == [corner] * 3
    assert indices_of(frames, rotation) == [0, 5, 11]


@pytest.mark.parametrize("rotation", [90, 270])
def test_pyav_path_rotates_like_decord(files: dict[str, Path], rotation: int) -> None:
    path = files[f"rot{rotation}"]
    info = probe(path)
    via_decord, _ = media_decode._decode_decord(path, [0, 6], (128, 80), info)
    via_pyav = media_decode._decode_pyav(path, [0, 6], (128, 80), info.rotation)
    assert via_decord is not None
    assert np.abs(via_decord.astype(int) - via_pyav).mean() < 2.0


def test_edit_list_goes_to_pyav_and_skips_hidden_frames(files: dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # decord counts the 5 hidden frames and pads the tail with copies of the last frame.
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    frames = decode_frames(files["edit_list"], [0, 12, 24], (64, 96))
    assert indices_of(frames) == [5, 17, 29]  # shown frame i is stored frame i + 5
    assert backend_used(caplog) == "pyav"


def test_narrow_output_avoids_decord_padding_bug(files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    frames = decode_frames(files["h264"], [3, 9], (32, 48))
    assert frames.shape == (2, 32, 48, 3) and indices_of(frames) == [3, 9]
    assert backend_used(caplog) == "pyav"


def test_decord_and_pyav_agree(files: dict[str, Path]) -> None:
    info = probe(files["h264"])
    via_decord, _ = media_decode._decode_decord(files["h264"], [0, 4, 17], (40, 88), info)
    via_pyav = media_decode._decode_pyav(files["h264"], [0, 4, 17], (40, 88), 0)
    assert via_decord is not None
    assert np.abs(via_decord.astype(int) - via_pyav).mean() < 2.0


def test_decode_long_video_few_frames(files: dict[str, Path]) -> None:
    wanted = [0, 499, 1000, 1500, 1999]
    frames = decode_frames(files["long"], wanted, (64, 96))
    assert indices_of(frames) == wanted


def test_decord_batches_across_chunks(files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    wanted = [*range(0, 40, 2), 1000, 1001, 1999]  # 23 frames: several get_batch chunks, seeks between
    assert indices_of(decode_frames(files["long"], wanted, (64, 96))) == wanted
    assert backend_used(caplog) == "decord"


def test_pyav_path_memory_is_bounded_by_kept_frames(files: dict[str, Path]) -> None:
    # All 2000 frames as RGB would be 36.9 MB of numpy arrays; 5 kept frames are 92 kB.
    tracemalloc.start()
    try:
        frames = media_decode._decode_pyav(files["long"], [100, 101, 102, 103, 104], (64, 96), 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert indices_of(frames) == [100, 101, 102, 103, 104]
    assert peak < 2_000_000


def test_pyav_path_stops_after_last_kept_frame(files: dict[str, Path], tmp_path: Path) -> None:
    # Cut the tail off a long faststart file: the early frames still decode because the PyAV
    # path stops at the last wanted frame and never reads the missing part.
    moov_first = mf.write_video(
        tmp_path / "fs.mp4", 600, 64, 64, options={"preset": "ultrafast", "g": "50"},
        container_options={"movflags": "faststart"},
    )  # fmt: skip
    data = moov_first.read_bytes()
    moov_first.write_bytes(data[: len(data) // 3])
    frames = media_decode._decode_pyav(moov_first, [0, 1, 2, 3, 4], (64, 96), 0)
    assert indices_of(frames) == [0, 1, 2, 3, 4]
    with pytest.raises(MediaError) as caught:
        media_decode._decode_pyav(moov_first, [590], (64, 96), 0)
    assert caught.value.reason in {"truncated", "unreadable"}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_worker_peak_memory_stays_small(files: dict[str, Path]) -> None:
    media._close_all_workers()
    media.ProbeCache._memory.clear()
    decode_frames(files["h264"], [0], (64, 96))  # a fresh worker, decord imported and warmed up
    baseline = _worker_peak_kb()
    decode_frames(files["long"], [0, 400, 800, 1200, 1999], (64, 96))
    assert _worker_peak_kb() - baseline < 16_000  # decoding all 2000 frames would need > 36 MB


def _worker_peak_kb() -> int:
    (worker,) = media._IDLE
    status = Path(f"/proc/{worker.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))


# ------------------------------------------------------------------------- bounds and errors


def test_timeout_kills_the_worker_and_the_pool_recovers(files: dict[str, Path]) -> None:
    probe(files["long"])  # cached, so the timeout applies to decoding only
    with pytest.raises(MediaError) as caught:
        decode_frames(files["long"], list(range(1900, 2000)), (64, 96), timeout_s=0.001)
    assert caught.value.reason == "decode_timeout"
    assert indices_of(decode_frames(files["long"], [1999], (64, 96))) == [1999]


def test_decoder_crash_is_reported_as_unreadable(files: dict[str, Path]) -> None:
    # Simulate a segfault: the request reaches the worker, then the worker dies.
    worker = media._Worker()
    os.kill(worker.proc.pid, signal.SIGSTOP)
    threading.Timer(0.2, os.kill, (worker.proc.pid, signal.SIGKILL)).start()
    with pytest.raises(MediaError) as caught:
        worker.call(("probe", str(files["h264"])), files["h264"], timeout_s=30)
    assert caught.value.reason == "unreadable" and not worker.alive


def test_dead_idle_worker_is_replaced(files: dict[str, Path]) -> None:
    probe(files["png"])
    for worker in media._IDLE:
        worker.proc.kill()
        worker.proc.wait()
    media.ProbeCache._memory.clear()
    assert probe(files["h264"]).num_frames == 30


def test_concurrent_callers_get_their_own_workers(files: dict[str, Path]) -> None:
    results: dict[int, list[int]] = {}

    def work(start: int) -> None:
        results[start] = indices_of(decode_frames(files["long"], list(range(start, start + 8)), (64, 96)))

    threads = [threading.Thread(target=work, args=(s,)) for s in (10, 700, 1400)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {s: list(range(s, s + 8)) for s in (10, 700, 1400)}


@pytest.mark.parametrize(
    ("indices", "size"),
    [([30], (64, 96)), ([-1], (64, 96)), ([0], (0, 96)), ([0], (64,)), ([0], (64.5, 96))],
)
def test_bad_arguments_raise_value_error(files: dict[str, Path], indices: list[int], size: tuple) -> None:
    with pytest.raises(ValueError):
        decode_frames(files["h264"], indices, size)


def test_empty_index_list(files: dict[str, Path]) -> None:
    assert decode_frames(files["h264"], [], (8, 8)).shape == (0, 8, 8, 3)


def test_decode_bad_file_raises_media_error(files: dict[str, Path]) -> None:
    with pytest.raises(MediaError) as caught:
        decode_frames(files["truncated_faststart"], [0], (64, 96))
    assert caught.value.reason == "truncated"


# ----------------------------------------------------------------------------------- images


def test_png_and_jpg(files: dict[str, Path]) -> None:
    png, jpg = probe(files["png"]), probe(files["jpg"])
    assert (png.width, png.height, png.num_frames, png.is_image, png.codec) == (64, 48, 1, True, "png")
    assert (jpg.width, jpg.height, jpg.codec) == (80, 60, "jpeg")
    assert indices_of(decode_frames(files["png"], [0], (48, 64))) == [7]
    resized = decode_frames(files["jpg"], [0, 0], (30, 40))
    assert resized.shape == (2, 30, 40, 3) and indices_of(resized) == [9, 9]


def test_exif_rotated_jpeg(files: dict[str, Path]) -> None:
    info = probe(files["jpg_exif90"])
    assert (info.width, info.height, info.rotation) == (60, 80, 90)
    frame = decode_frames(files["jpg_exif90"], [0], (80, 60))[0]
    assert mf.marker_corner(frame) == "tr" and indices_of(frame[None], 90) == [3]


def test_16bit_png_is_scaled_to_8bit(files: dict[str, Path]) -> None:
    info = probe(files["png16"])
    assert info.bit_depth == 16
    frame = decode_frames(files["png16"], [0], (48, 64))[0]
    assert frame.mean() == pytest.approx(40000 / 257, abs=1)  # not clipped to white


def test_transparent_png_is_flattened_on_white(files: dict[str, Path]) -> None:
    frame = decode_frames(files["rgba"], [0], (48, 64))[0]
    assert frame[24, 8].tolist() == [0, 0, 255] and frame[24, 56].tolist() == [255, 255, 255]


def test_image_has_only_frame_zero(files: dict[str, Path]) -> None:
    with pytest.raises(ValueError):
        decode_frames(files["png"], [1], (48, 64))


# ------------------------------------------------------------------------------- demo data


def test_demo_dataset_is_real_captioned_deterministic_and_idempotent(tmp_path: Path) -> None:
    from loraflow.demo.dataset import make_demo_dataset

    out = make_demo_dataset(tmp_path / "demo")
    videos, stills = sorted(out.glob("*.mp4")), sorted(out.glob("*.png"))
    assert len(videos) == 5 and len(stills) == 2
    infos = [probe(p) for p in videos]
    assert sorted(i.num_frames for i in infos) == [21, 29, 33, 45, 49]
    assert len({(i.width, i.height) for i in infos}) == 5 and all(i.fps == 24.0 for i in infos)
    assert all(probe(p).is_image for p in stills)
    assert all(p.with_suffix(".txt").read_text().strip() for p in videos + stills)
    assert (out / "clip_00.txt").read_text().strip() == "a red circle moves from left to right on a blue background"
    # The caption is true: the red circle's centre moves right.
    frames = decode_frames(out / "clip_00.mp4", [0, 10, 20], (64, 96))
    red = (frames[..., 0] > 150) & (frames[..., 2] < 100)
    xs = [float(np.nonzero(mask)[1].mean()) for mask in red]
    assert xs[0] < xs[1] < xs[2]

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert make_demo_dataset(out) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing rewritten
    again = make_demo_dataset(tmp_path / "again")
    assert _digests(again) == _digests(out)  # same seed, same bytes


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:12] for p in sorted(folder.iterdir())}


# ------------------------------------------------- containers without a frame index (MPEG-TS/PS, MXF) and AVI

_H264 = {"preset": "veryfast"}  # B-frames: packets arrive out of display order
_MPEG2 = {"bf": "2", "qmax": "2"}  # fine quantizers: coding noise never flips an index digit


@pytest.fixture(scope="module")
def unindexed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("unindexed")
    m2ts = {"mpegts_m2ts_mode": "1"}  # AVCHD's 192-byte packets
    return {
        "obs.ts": mf.write_video(d / "obs.ts", 30, 96, 64, options=_H264),
        "camcorder.mts": mf.write_video(d / "camcorder.mts", 30, 96, 64, options=_H264, container_options=m2ts),
        "camcorder.m2ts": mf.write_video(d / "camcorder.m2ts", 30, 96, 64, options=_H264, container_options=m2ts),
        "dvd.vob": mf.write_video(d / "dvd.vob", 30, 96, 64, fps=25, codec="mpeg2video", options=_MPEG2),
        "old.mpg": mf.write_video(d / "old.mpg", 30, 96, 64, fps=25, codec="mpeg2video", options=_MPEG2),
        "broadcast.mxf": mf.write_video(d / "broadcast.mxf", 30, 96, 64, fps=25, codec="mpeg2video", options=_MPEG2),
        "clip.avi": mf.write_video(d / "clip.avi", 30, 96, 64, options=_H264),
    }


@pytest.mark.parametrize("name", ["obs.ts", "camcorder.mts", "camcorder.m2ts", "dvd.vob", "old.mpg", "broadcast.mxf",
                                  "clip.avi"])
def test_unindexed_containers_give_the_requested_frames(unindexed: dict[str, Path], name: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # decord seeks these to wrong frames without an error (.ts: frame 14 for 0, .avi: frame 0 for 28); 96 px wide
    # would go to decord, so this checks they go to PyAV and that its count and positions are the shown frames.
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    info = probe(unindexed[name])
    fps = 25.0 if name.endswith((".vob", ".mpg", ".mxf")) else 24.0
    assert (info.num_frames, info.fps, info.is_vfr, (info.width, info.height)) == (30, fps, False, (96, 64))
    wanted = [0, 1, 2, 15, 28, 29]
    assert indices_of(decode_frames(unindexed[name], wanted, (64, 96))) == wanted
    assert backend_used(caplog) == "pyav"


def test_transport_stream_starts_at_a_nonzero_time(unindexed: dict[str, Path]) -> None:
    # What makes .ts different: its clock starts at 1.4 s, not 0; the probe's timing is relative to the first frame.
    import av

    with av.open(str(unindexed["obs.ts"])) as container:
        assert container.streams.video[0].start_time > 0
    assert probe(unindexed["obs.ts"]).duration_s == pytest.approx(30 / 24)


@pytest.mark.parametrize(("codec", "shown"), [("libx264", range(11, 60)), ("mpeg2video", range(12, 60))])
def test_a_transport_stream_cut_mid_stream_counts_the_frames_its_decoder_shows(
    tmp_path: Path, codec: str, shown: range
) -> None:
    # A capture that starts mid-GOP: the frames before the first keyframe cannot be decoded (H.264 still shows the
    # one that precedes its keyframe, MPEG-2 drops two). Counting every packet promised frames that never come.
    whole = mf.write_video(tmp_path / "whole.ts", 60, 96, 64, fps=25, codec=codec,
                           options={**(_H264 if codec == "libx264" else _MPEG2), "g": "12"})
    data = whole.read_bytes()
    cut = tmp_path / "capture.ts"
    cut.write_bytes(data[len(data) // 10 // 188 * 188 :])  # whole 188-byte TS packets, as a tuner records them
    info = probe(cut)
    assert info.num_frames == len(shown)
    assert indices_of(decode_frames(cut, list(range(info.num_frames)), (64, 96))) == list(shown)


def test_anamorphic_transport_stream_is_shown_wide(tmp_path: Path) -> None:
    path = mf.write_video(tmp_path / "hdv.m2ts", 12, 64, 64, sar=Fraction(3, 2), options=_H264)
    info = probe(path)
    assert (info.width, info.height) == (96, 64)
    assert indices_of(decode_frames(path, [0, 11], (64, 96))) == [0, 11]


def test_a_one_frame_transport_stream(tmp_path: Path) -> None:
    path = mf.write_video(tmp_path / "one.ts", 1, 96, 64)
    assert probe(path).num_frames == 1  # its rate is a guess (48: H.264's field rate), nothing to measure
    assert indices_of(decode_frames(path, [0], (64, 96))) == [0]


@pytest.mark.parametrize(("name", "codec"), [("scan.tif", "tiff"), ("scan.tiff", "tiff"), ("phone.avif", "avif")])
def test_tiff_and_avif_stills(tmp_path: Path, name: str, codec: str) -> None:
    path = mf.write_image(tmp_path / name, 80, 60, index=11)
    info = probe(path)
    assert (info.width, info.height, info.is_image, info.codec) == (80, 60, True, codec)
    assert indices_of(decode_frames(path, [0], (30, 40))) == [11]


def test_16bit_tiff_is_scaled_to_8bit(tmp_path: Path) -> None:
    path = mf.write_png16(tmp_path / "deep.tif")  # Pillow writes the format the suffix names
    assert probe(path).bit_depth == 16
    assert decode_frames(path, [0], (48, 64))[0].mean() == pytest.approx(40000 / 257, abs=1)


def test_a_failed_pyav_decode_frees_its_decoder_before_ffmpeg_logs_go_back_to_python(tmp_path: Path) -> None:
    # The worker sends FFmpeg's logs to Python; a frame-threaded decoder freed then, while one of its threads logs an
    # error, deadlocks on the GIL (seen: 3 hangs in 22 early stops on a 720p .ts). An error's traceback holds the
    # decoder, so _decode_pyav must free it before it turns logging back on and lets the error through.
    import gc

    import av

    cut = mf.write_video(tmp_path / "cut.ts", 60, 96, 64, options=_H264)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2 // 188 * 188])
    before = {id(o) for o in gc.get_objects() if isinstance(o, av.codec.context.CodecContext)}
    av.logging.set_level(av.logging.ERROR)  # as media._serve sets it
    try:
        with pytest.raises(MediaError) as caught:
            media_decode._decode_pyav(cut, [0, 59], (64, 96), 0)
        alive = [o for o in gc.get_objects() if isinstance(o, av.codec.context.CodecContext) and id(o) not in before]
        assert caught.value.reason == "truncated" and alive == []
        assert av.logging.get_level() == av.logging.ERROR
    finally:
        av.logging.set_level(None)
