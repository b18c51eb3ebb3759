"""Probe and decode video/image files: only the frames that are kept, at the size they are kept.

Decoding every frame of a 720p clip to RGB and then keeping 49 costs 480-780 MB and ~2 s on two
cores; decoding only the 49 kept frames, resized inside the decoder, costs 0.3 s and ~75 MB of
worker working set (benchmarks/bench_decode.py, benchmarks/results/decode_cpu.json). So:

* `probe` reads container metadata and the packet index, decodes exactly one frame (for rotation,
  pixel format and to prove the codec works), and counts frames without decoding them.
* `decode_frames` asks decord for the kept indices at the kept size (resize happens in its filter
  graph), and falls back to PyAV, which walks the stream once, converts only the wanted frames and
  stops after the last one.

All decoding runs in a small pool of worker processes: one corrupt file can hang or crash FFmpeg
or decord, and a process is the only thing that can be killed. A hang becomes
MediaError("decode_timeout") and a crash MediaError("unreadable"); the calling pipeline goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".webp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi"})

# Containers whose rotation decord's bundled FFmpeg 4.0 reads the same way we do (the "rotate"
# tag / display matrix of the MP4 family). Elsewhere a rotated stream goes to PyAV.
_DECORD_ROTATION_SUFFIXES = frozenset({".mp4", ".mov", ".m4v"})
# decord 0.6 infers the channel count from the padded row size, so some narrow outputs come back
# with 4..48 "channels" (or get_batch raises). Measured over widths 2..4096: 2, 3, 4, 6, 8, 12, 16,
# 24, 48 and 72 break, nothing wider. The shape is still checked after every decord call.
_DECORD_MIN_WIDTH = 80
_DECORD_CHUNK = 8  # frames per get_batch call

# The codes this module raises. Callers add their own (the clips stage: "missing_caption",
# "too_short", ...), so MediaError accepts any short code.
REASONS = frozenset(
    {
        "unreadable",
        "empty_file",
        "not_media",
        "no_video_stream",
        "zero_frames",
        "truncated",
        "unsupported_codec",
        "decode_timeout",
    }
)


class MediaError(Exception):
    """A file that cannot be used. `reason` is a short machine code, the message says what to do."""

    reason: str

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Default exception pickling replays only `args`; keep `reason` across processes.
        return (MediaError, (self.reason, str(self)))


@dataclass(frozen=True)
class Probe:
    """What the clips stage needs to know about one file, without decoding it."""

    width: int  # display size: sample aspect ratio and rotation applied
    height: int
    num_frames: int  # frames the decoder will output (discarded edit-list frames excluded)
    fps: float  # nominal rate for CFR; num_frames / duration_s for VFR
    is_vfr: bool
    duration_s: float
    rotation: int  # clockwise degrees the display matrix asks for: 0, 90, 180 or 270
    pix_fmt: str
    bit_depth: int
    has_audio: bool
    codec: str
    is_image: bool  # still images are 1-frame media


# --------------------------------------------------------------------------------------------
# Public API (runs in the caller's process; the work happens in a worker process)
# --------------------------------------------------------------------------------------------


def probe(path: str | Path, timeout_s: float = 60.0) -> Probe:
    """Describe a video or image file; raises MediaError if it cannot be used."""
    path = Path(path)
    key = _stat_key(path)
    cached = _probe_cache_get(key)
    if cached is not None:
        return cached
    reply = _run_in_worker(("probe", str(path)), path, timeout_s)
    result = Probe(**reply["probe"])
    _probe_cache_put(key, result)
    return result


def decode_frames(
    path: str | Path,
    indices: Sequence[int],
    size: tuple[int, int],
    timeout_s: float = 60.0,
) -> np.ndarray:
    """Decode source frames `indices` of `path`, resized to `size` = (H, W).

    Returns uint8 RGB of shape (len(indices), H, W, 3), frames in the order given (repeats
    allowed). Aspect is not preserved: the caller picks a size that keeps it and crops after.
    Raises MediaError for unusable files or when decoding takes longer than `timeout_s`, and
    ValueError for indices outside [0, num_frames) or a non-positive size.
    """
    path = Path(path)
    height, width = _check_size(size, path)
    wanted = [int(i) for i in indices]
    info = probe(path, timeout_s=timeout_s)
    _check_indices(wanted, info, path)
    if not wanted:
        return np.empty((0, height, width, 3), np.uint8)
    unique = sorted(set(wanted))
    request = ("decode", str(path), unique, (height, width), dataclasses.asdict(info))
    reply = _run_in_worker(request, path, timeout_s)
    frames = reply["frames"]
    logger.debug("%s: %d frames via %s%s", path, len(unique), reply["backend"], reply["note"])
    if unique == wanted:
        return frames
    # Decode each distinct frame once; repeats and order are restored by a gather.
    return frames[np.searchsorted(unique, wanted)]


def _check_size(size: tuple[int, int], path: Path) -> tuple[int, int]:
    if len(size) != 2 or any(int(s) != s or s <= 0 for s in size):
        raise ValueError(f"{path}: size must be (height, width) with positive integers, got {size!r}")
    return int(size[0]), int(size[1])


def _check_indices(wanted: list[int], info: Probe, path: Path) -> None:
    bad = [i for i in wanted if not 0 <= i < info.num_frames]
    if bad:
        raise ValueError(
            f"{path}: frame indices {bad[:5]} are outside 0..{info.num_frames - 1} "
            f"(the file has {info.num_frames} frames); choose indices from probe().num_frames"
        )


# Probe results are reused by decode_frames; a changed file (size or mtime) is probed again.
_PROBE_CACHE: OrderedDict[tuple[str, int, int], Probe] = OrderedDict()
_PROBE_CACHE_MAX = 4096
_PROBE_CACHE_LOCK = threading.Lock()


def _stat_key(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError as err:
        raise MediaError("unreadable", f"{path}: cannot read the file ({err.strerror}); check the path and permissions") from err
    if not path.is_file():
        raise MediaError("unreadable", f"{path}: not a regular file; point the dataset at media files")
    if st.st_size == 0:
        raise MediaError("empty_file", f"{path}: the file is empty (0 bytes); re-copy or remove it")
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _probe_cache_get(key: tuple[str, int, int]) -> Probe | None:
    with _PROBE_CACHE_LOCK:
        hit = _PROBE_CACHE.get(key)
        if hit is not None:
            _PROBE_CACHE.move_to_end(key)
        return hit


def _probe_cache_put(key: tuple[str, int, int], value: Probe) -> None:
    with _PROBE_CACHE_LOCK:
        _PROBE_CACHE[key] = value
        while len(_PROBE_CACHE) > _PROBE_CACHE_MAX:
            _PROBE_CACHE.popitem(last=False)


# --------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------

# A plain `python -c` child rather than multiprocessing: spawn/forkserver re-import the caller's
# __main__ (breaking scripts without a __main__ guard), and fork is unsafe in a threaded process.
_WORKER_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
    "from loraflow.ops.media import _serve; _serve(int(sys.argv[1]), int(sys.argv[2]))"
)


class _WorkerGone(Exception):
    """The worker died while idle (not the file's fault): retry on a fresh one."""


class _Worker:
    """One decoding subprocess, spoken to over two pipes."""

    BOOT_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        search_path = [str(Path(__file__).resolve().parents[2]), *sys.path]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, str(req_r), str(res_w), json.dumps(search_path)],
            pass_fds=(req_r, res_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # FFmpeg/decord chatter stays on stderr
        )
        os.close(req_r)
        os.close(res_w)
        self.requests = Connection(req_w, readable=False)
        self.replies = Connection(res_r, writable=False)
        self.alive = True
        self.in_call = False
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        # A worker that cannot even start (broken install) must not be mistaken for a file that
        # crashes the decoder: every file would be reported as corrupt.
        try:
            ready = self.replies.poll(self.BOOT_TIMEOUT_S) and self.replies.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            code = self.kill()
            raise RuntimeError(
                f"the media worker process did not start (exit code {code}); its traceback is on "
                "stderr above — check that numpy, av and decord import in this environment"
            )

    def call(self, request: tuple[Any, ...], path: Path, timeout_s: float) -> dict[str, Any]:
        try:
            self.requests.send(request)
        except OSError as err:
            self.kill()
            raise _WorkerGone from err
        self.in_call = True  # until the whole reply is read, this worker may not serve others
        if not self.replies.poll(timeout_s):
            self.kill()
            raise MediaError(
                "decode_timeout",
                f"{path}: decoding took longer than {timeout_s:g} s and was stopped; the file is "
                "probably damaged (re-encode it) or very long (raise timeout_s)",
            )
        try:
            reply = self.replies.recv()
            if reply["kind"] == "frames":
                reply = self._receive_frames(reply)
        except EOFError:
            code = self.kill()
            raise MediaError(
                "unreadable",
                f"{path}: the decoder crashed on this file (worker exit code {code}); it is corrupt — "
                "re-encode it (e.g. ffmpeg -i in.mp4 -c:v libx264 out.mp4) or remove it",
            ) from None
        self.in_call = False
        return reply

    def _receive_frames(self, header: dict[str, Any]) -> dict[str, Any]:
        frames = np.empty(header["shape"], np.uint8)
        # Straight into the result, no second copy. Connection measures buffers by len(), so it
        # must see a flat byte view, not the 4-D array.
        self.replies.recv_bytes_into(frames.reshape(-1))
        return {"kind": "ok", "frames": frames, **{k: header[k] for k in ("backend", "note")}}

    def kill(self) -> int | None:
        self.alive = False
        self.requests.close()
        self.replies.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def close(self) -> None:
        """Ask politely (EOF on the request pipe), then insist."""
        self.alive = False
        self.requests.close()
        self.replies.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_IDLE: list[_Worker] = []
_IDLE_LOCK = threading.Lock()
_IDLE_MAX = max(2, os.cpu_count() or 2)


@contextlib.contextmanager
def _borrow_worker() -> Iterator[_Worker]:
    """A worker for this call only; concurrent callers (threads) each get their own."""
    with _IDLE_LOCK:
        worker = _IDLE.pop() if _IDLE else None
    if worker is None or worker.proc.poll() is not None:
        worker = _Worker()
    try:
        yield worker
    finally:
        # Interrupted mid-call (Ctrl-C, an error while reading), the worker would later answer
        # a request nobody is waiting for, and the next caller would read that stale answer.
        reusable = worker.alive and not worker.in_call
        with _IDLE_LOCK:
            keep = reusable and len(_IDLE) < _IDLE_MAX
            if keep:
                _IDLE.append(worker)
        if not keep and worker.alive:
            worker.kill() if worker.in_call else worker.close()


def _run_in_worker(request: tuple[Any, ...], path: Path, timeout_s: float) -> dict[str, Any]:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    try:
        reply = _call_once(request, path, timeout_s)
    except _WorkerGone:
        reply = _call_once(request, path, timeout_s)  # a worker that died while idle
    if reply["kind"] == "media_error":
        raise MediaError(reply["reason"], reply["message"])
    if reply["kind"] == "bug":
        raise RuntimeError(f"media worker failed on {path} (a loraflow bug, please report):\n{reply['traceback']}")
    return reply


def _call_once(request: tuple[Any, ...], path: Path, timeout_s: float) -> dict[str, Any]:
    with _borrow_worker() as worker:
        return worker.call(request, path, timeout_s)


def _close_all_workers() -> None:
    with _IDLE_LOCK:
        workers, _IDLE[:] = list(_IDLE), []
    for worker in workers:
        worker.close()


def _forget_workers_after_fork() -> None:
    # A forked child shares the parent's pipes; talking on them would steal the parent's replies.
    global _IDLE_LOCK
    _IDLE_LOCK = threading.Lock()
    _IDLE.clear()


atexit.register(_close_all_workers)
os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _serve(request_fd: int, reply_fd: int) -> None:
    """Worker main loop: answer requests until the parent closes the pipe."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import av

    # PyAV folds the last FFmpeg error line into its exceptions (and so into our messages) only
    # when logging is on; route the lines nowhere instead of printing one per bad file.
    libav_log = logging.getLogger("libav")
    libav_log.addHandler(logging.NullHandler())
    libav_log.propagate = False
    av.logging.set_level(av.logging.ERROR)
    requests = Connection(request_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    replies.send("ready")
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        _answer(request, replies)
        _release_freed_memory()


def _answer(request: tuple[Any, ...], replies: Connection) -> None:
    op, path = request[0], Path(request[1])
    try:
        if op == "probe":
            replies.send({"kind": "ok", "probe": dataclasses.asdict(_probe_local(path))})
            return
        _, _, indices, size, info = request
        frames, backend, note = _decode_local(path, indices, size, Probe(**info))
    except MediaError as err:
        replies.send({"kind": "media_error", "reason": err.reason, "message": str(err)})
        return
    except Exception:  # noqa: BLE001 - forwarded to the caller as a RuntimeError with the traceback
        replies.send({"kind": "bug", "traceback": traceback.format_exc()})
        return
    replies.send({"kind": "frames", "shape": frames.shape, "backend": backend, "note": note})
    replies.send_bytes(np.ascontiguousarray(frames).reshape(-1))  # flat: see _receive_frames


def _release_freed_memory() -> None:
    # glibc keeps freed frame buffers mapped; hand them back so an idle worker stays small.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


# --------------------------------------------------------------------------------------------
# Probing (worker side)
# --------------------------------------------------------------------------------------------


def _probe_local(path: Path) -> Probe:
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return _probe_image(path)
    return _probe_video(path)


def _probe_video(path: Path) -> Probe:
    with _open_container(path) as container:
        stream = _video_stream(container, path)
        first = _first_frame(container, stream, path)
        counted = _timestamps_from_index(stream, path) if _has_sample_table(container) else None
        if counted is None:
            with _open_container(path) as again:
                counted = _timestamps_from_demux(again, _video_stream(again, path), path)
        # Everything is read while the container is open: PyAV streams die with it.
        return _describe(path, container, stream, first, *counted)


def _has_sample_table(container: Any) -> bool:
    return "mp4" in container.format.name or "mov" in container.format.name


def _open_container(path: Path) -> Any:
    import av

    try:
        return av.open(str(path), metadata_errors="ignore")
    except av.error.InvalidDataError as err:
        if _looks_like_cut_mp4(path):
            raise MediaError(
                "truncated",
                f"{path}: an MP4/MOV whose index (moov atom) is missing — the file was cut off "
                "(interrupted copy/download or a recording that never finished); re-download or re-export it",
            ) from err
        raise MediaError(
            "not_media",
            f"{path}: not a video FFmpeg can read ({err.strerror}); remove it or convert it to mp4",
        ) from err
    except (av.error.FFmpegError, OSError) as err:
        raise MediaError("unreadable", f"{path}: cannot open ({err}); check the file and permissions") from err


def _looks_like_cut_mp4(path: Path) -> bool:
    """An ISO-BMFF file whose top-level boxes run past the end or never reach the index (moov)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[4:8] not in (b"ftyp", b"mdat", b"wide", b"free", b"skip"):
            return False  # not an MP4/MOV at all
        offset = 0
        while offset + 8 <= size:
            f.seek(offset)
            header = f.read(16)
            box_size, box_type = int.from_bytes(header[:4], "big"), header[4:8]
            if box_type == b"moov":
                return False  # the index exists: the damage is elsewhere
            if box_size == 1 and len(header) == 16:
                box_size = int.from_bytes(header[8:16], "big")  # 64-bit size
            if box_size < 8:
                return True  # size 0 = "to end of file" without a moov, or garbage
            offset += box_size
    return True


def _video_stream(container: Any, path: Path) -> Any:
    import av

    # FFmpeg's own choice (what decord also uses); cover art in audio files is not video.
    stream = container.streams.best("video")
    if stream is None or stream.disposition & av.stream.Disposition.attached_pic:
        kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
        raise MediaError(
            "no_video_stream",
            f"{path}: has no video stream (streams: {kinds}); remove it from the video dataset",
        )
    if stream.codec_context is None:
        raise MediaError(
            "unsupported_codec",
            f"{path}: this FFmpeg build has no decoder for its video codec; "
            "re-encode it to H.264 (ffmpeg -i in -c:v libx264 -pix_fmt yuv420p out.mp4)",
        )
    return stream


def _first_frame(container: Any, stream: Any, path: Path) -> Any:
    """Decode one frame: proves the codec works and carries rotation and pixel format."""
    import av

    try:
        for packet in container.demux(stream):
            for frame in packet.decode():
                return frame
    except av.error.FFmpegError as err:
        raise MediaError(
            "unreadable", f"{path}: the first frame cannot be decoded ({err}); the file is corrupt, re-export it"
        ) from err
    raise MediaError("zero_frames", f"{path}: the video stream has no decodable frames; remove the file")


def _timestamps_from_index(stream: Any, path: Path) -> tuple[int, list[int]] | None:
    """(frame count, sorted timestamps) from the MP4 sample table, without reading frame data.

    Returns None when the table is incomplete (fragmented MP4) so the caller demuxes instead.
    """
    entries = stream.index_entries
    if len(entries) == 0 or len(entries) != stream.frames:
        return None
    file_size = path.stat().st_size
    count, stamps = 0, []
    for entry in entries:
        if entry.pos + entry.size > file_size:
            _raise_truncated(path, f"frame data at byte {entry.pos} lies past the end of the file ({file_size} bytes)")
        count += entry.size > 0 and not entry.is_discard
        # These are decode timestamps; with B-frames, edit-list discards sit between kept
        # frames in decode order, so timing is measured on all of them (steady for CFR).
        stamps.append(entry.timestamp)
    return count, sorted(stamps)


def _timestamps_from_demux(container: Any, stream: Any, path: Path) -> tuple[int, list[int]]:
    """Frame timestamps by reading every packet (no decoding) for containers without a full index."""
    import av

    file_size = path.stat().st_size
    stamps: list[int] = []
    total = 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the flush packet PyAV appends
            total += 1
            if packet.is_corrupt or (packet.pos >= 0 and packet.pos + packet.size > file_size):
                _raise_truncated(path, f"packet {total} is incomplete")
            if not packet.is_discard:
                stamps.append(packet.pts if packet.pts is not None else packet.dts if packet.dts is not None else total)
    except av.error.FFmpegError as err:
        _raise_truncated(path, f"reading stopped after {total} packets ({err})")
    if stream.frames > total:
        _raise_truncated(path, f"the header promises {stream.frames} frames but only {total} are present")
    return len(stamps), sorted(stamps)


def _raise_truncated(path: Path, detail: str) -> NoReturn:
    raise MediaError("truncated", f"{path}: the file is cut short — {detail}; re-download or re-export it")


def _describe(path: Path, container: Any, stream: Any, first: Any, num_frames: int, stamps: list[int]) -> Probe:
    if num_frames == 0:
        raise MediaError("zero_frames", f"{path}: the video stream has no frames; remove the file")
    fps, is_vfr, duration_s = _timing(num_frames, stamps, stream)
    rotation = _rotation_cw(first)
    width, height = _display_size(first.width, first.height, stream, rotation)
    fmt = first.format
    return Probe(
        width=width,
        height=height,
        num_frames=num_frames,
        fps=fps,
        is_vfr=is_vfr,
        duration_s=duration_s,
        rotation=rotation,
        pix_fmt=fmt.name,
        bit_depth=max(c.bits for c in fmt.components),
        has_audio=len(container.streams.audio) > 0,
        codec=stream.codec_context.name,
        is_image=False,
    )


def _timing(num_frames: int, stamps: list[int], stream: Any) -> tuple[float, bool, float]:
    """(fps, is_vfr, duration_s) from sorted timestamps in stream time-base units."""
    tick = float(stream.time_base) if stream.time_base else 0.0
    nominal = _nominal_rate(stream)
    deltas = np.diff(np.asarray(stamps, np.float64))
    mean = float(deltas.mean()) if len(deltas) else 0.0
    if tick <= 0 or mean <= 0:
        return nominal, False, (num_frames / nominal if nominal else 0.0)
    # Millisecond time bases round 1/24 s to 41 or 42 ticks: allow 1.5 ticks and 2 % of jitter.
    is_vfr = bool(np.abs(deltas - mean).max() > max(1.5, 0.02 * mean))
    measured = 1.0 / (mean * tick)
    if is_vfr:
        duration_s = num_frames * mean * tick
        return num_frames / duration_s, True, duration_s
    # Prefer the container's exact rational (30000/1001) when it agrees with what was measured.
    fps = nominal if nominal and abs(nominal - measured) <= 0.01 * measured else measured
    return fps, False, num_frames / fps


def _nominal_rate(stream: Any) -> float:
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate:
            return float(rate)
    return 0.0


def _rotation_cw(frame: Any) -> int:
    # PyAV reports the display matrix counter-clockwise; players (ffmpeg's autorotate) turn the
    # picture clockwise by the negated angle. Snap to quarter turns.
    return int(round(-frame.rotation / 90.0)) % 4 * 90


def _display_size(width: int, height: int, stream: Any, rotation: int) -> tuple[int, int]:
    sar = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    if sar and sar > 0 and sar != 1:
        width = max(1, round(width * Fraction(sar)))  # anamorphic pixels: show as displayed
    return (height, width) if rotation in (90, 270) else (width, height)


def _probe_image(path: Path) -> Probe:
    image, rotation, mode = _load_image(path)
    width, height = image.size
    if rotation in (90, 270):
        width, height = height, width
    return Probe(
        width=width,
        height=height,
        num_frames=1,
        fps=0.0,
        is_vfr=False,
        duration_s=0.0,
        rotation=rotation,
        pix_fmt=mode,
        bit_depth=16 if mode.startswith("I;16") or mode == "I" else 8,
        has_audio=False,
        codec=(image.format or path.suffix.lstrip(".")).lower(),
        is_image=True,
    )


# EXIF orientation -> clockwise quarter turns; mirrored variants share the turn (exif_transpose
# applies the mirror exactly when decoding).
_EXIF_ROTATION = {1: 0, 2: 0, 3: 180, 4: 180, 5: 90, 6: 90, 7: 270, 8: 270}


def _load_image(path: Path) -> tuple[Any, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()  # the pixels outlive the file handle
    except UnidentifiedImageError as err:
        raise MediaError("not_media", f"{path}: not an image Pillow can read; remove it or convert it to png") from err
    except Image.DecompressionBombError as err:
        raise MediaError("unreadable", f"{path}: {err}; downscale the image before training") from err
    except OSError as err:
        reason = "truncated" if "truncated" in str(err) else "unreadable"
        raise MediaError(reason, f"{path}: the image cannot be decoded ({err}); re-export it") from err
    orientation = image.getexif().get(0x0112, 1)
    return image, _EXIF_ROTATION.get(orientation, 0), image.mode


# --------------------------------------------------------------------------------------------
# Decoding (worker side)
# --------------------------------------------------------------------------------------------


def _decode_local(
    path: Path, indices: list[int], size: tuple[int, int], info: Probe
) -> tuple[np.ndarray, str, str]:
    """Frames `indices` (sorted, unique) at `size`; returns (frames, backend, why-not-decord)."""
    if info.is_image:
        return _decode_image(path, len(indices), size), "pillow", ""
    frames, why_not = _decode_decord(path, indices, size, info)
    if frames is not None:
        return frames, "decord", ""
    return _decode_pyav(path, indices, size, info.rotation), "pyav", f" (decord skipped: {why_not})"


def _decord_unsuitable(path: Path, size: tuple[int, int], info: Probe) -> str:
    if size[1] < _DECORD_MIN_WIDTH:
        return f"width {size[1]} < {_DECORD_MIN_WIDTH} hits decord's row-padding bug"
    if info.rotation and path.suffix.lower() not in _DECORD_ROTATION_SUFFIXES:
        return "rotation outside MP4/MOV is not applied by decord"
    return ""


def _decode_decord(
    path: Path, indices: list[int], size: tuple[int, int], info: Probe
) -> tuple[np.ndarray | None, str]:
    why_not = _decord_unsuitable(path, size, info)
    if why_not:
        return None, why_not
    import decord

    height, width = size
    try:
        # decord rotates MP4/MOV itself and takes width/height in display orientation.
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0), width=width, height=height)
        # decord counts every packet, including edit-list discards, then pads the tail with
        # copies of the last frame; if its count differs from ours its indices cannot be trusted.
        if len(reader) != info.num_frames:
            return None, f"decord counts {len(reader)} frames, the decoder outputs {info.num_frames}"
        frames = np.empty((len(indices), height, width, 3), np.uint8)
        # get_batch(all) holds the batch twice (decord's buffer and asnumpy's copy); in chunks
        # only the output is whole. The reader keeps its position, so chunks do not re-seek.
        for start in range(0, len(indices), _DECORD_CHUNK):
            chunk = reader.get_batch(indices[start : start + _DECORD_CHUNK]).asnumpy()
            if chunk.shape[1:] != frames.shape[1:]:
                return None, f"decord returned frames of shape {chunk.shape[1:]}"
            frames[start : start + len(chunk)] = chunk
    except (decord.DECORDError, RuntimeError) as err:
        return None, f"decord failed: {str(err).strip().splitlines()[-1][:200]}"
    return frames, ""


def _decode_pyav(path: Path, indices: list[int], size: tuple[int, int], rotation: int) -> np.ndarray:
    """One pass over the stream; converts only wanted frames and stops after the last one."""
    import av

    height, width = size
    # Scale in coded orientation so swscale resizes and converts to RGB in one pass; turning the
    # small result afterwards is a cheap copy (a quarter turn swaps the target's sides).
    coded_h, coded_w = (width, height) if rotation in (90, 270) else (height, width)
    out = np.empty((len(indices), height, width, 3), np.uint8)
    wanted = iter(enumerate(indices))
    slot, target = next(wanted)
    with _open_container(path) as container:
        stream = _video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            for position, frame in enumerate(container.decode(stream)):
                if position < target:
                    continue  # decoded (it may be a reference) but never converted to RGB
                rgb = frame.reformat(width=coded_w, height=coded_h, format="rgb24", interpolation="BICUBIC")
                out[slot] = _rotate(rgb.to_ndarray(), rotation)
                step = next(wanted, None)
                if step is None:
                    return out
                slot, target = step
        except av.error.FFmpegError as err:
            raise MediaError(
                "unreadable", f"{path}: decoding failed before frame {target} ({err}); the file is damaged, re-export it"
            ) from err
    _raise_truncated(path, f"frame {target} was requested but the decoder stopped earlier")


def _rotate(frame: np.ndarray, rotation: int) -> np.ndarray:
    # np.rot90 turns counter-clockwise for positive k; the display matrix asks for clockwise.
    return np.rot90(frame, k=-(rotation // 90)) if rotation else frame


def _decode_image(path: Path, count: int, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image, ImageOps

    image, _, _ = _load_image(path)
    image = _to_rgb8(ImageOps.exif_transpose(image))
    height, width = size
    rgb = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    return np.repeat(rgb[None], count, axis=0)


def _to_rgb8(image: Any) -> Any:
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # Pillow's convert("RGB") clips 16-bit samples at 255 (a white image); scale instead.
        scaled = (np.asarray(image, np.float32) / 257.0).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(scaled, "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Transparent pixels store arbitrary colours (often black); show them over white.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
