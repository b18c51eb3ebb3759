"""Probe and decode video/image files: only the frames that are kept, at the size they are kept.

Decoding every frame of a 720p clip to RGB and then keeping 49 costs 480-780 MB and ~2 s on two
cores; decoding only the 49 kept frames, resized inside the decoder, costs 0.3 s and ~75 MB of
worker working set (benchmarks/bench_decode.py, benchmarks/results/decode_cpu.json). So:

* `probe` reads container metadata and the packet index, decodes exactly one frame (for rotation,
  pixel format and to prove the codec works), and counts frames without decoding them.
* `decode_frames` asks decord for the kept indices at the kept size (resize happens in its filter
  graph), and falls back to PyAV, which walks the stream once, converts only the wanted frames and
  stops after the last one.

`decode_audio` reads the sound of a clip's time span the same way (media/audio_worker.py).

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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from loraflow.keys import content_key
from loraflow.media.decode_worker import decode_local, probe_local  # light: it imports decord and PyAV when it decodes
from loraflow.media.scenes_worker import DETECTOR, detect_cuts_local  # light: it imports PySceneDetect when it detects
from loraflow.media.types import ClipAudio, DecoderCrash, MediaError, Probe

if TYPE_CHECKING:  # annotations only
    from loraflow.store import Store

logger = logging.getLogger(__name__)
PROBE_VERSION = 4  # bump when a probe would describe the same file differently (2: VFR frame times; 3: streams
# without a frame index counted from their first keyframe, as decoders show them; 4: frames all at one timestamp are
# refused as zero_duration, not given a made-up rate)
PROBE_BATCH = 256  # new probes per committed shard (ProbeCache with a store)
PROBE_CACHE_MAX = 4096  # probes (and cut lists) kept in memory
SCENES_VERSION = 1  # bump when the same file and settings would give other cuts (another detector, another mapping)
# The cut detector's time limit: 60 s and this many seconds a second of video (it decodes every frame; a damaged file
# that hangs it is stopped all the same)
SCENE_SECONDS_PER_SECOND = 2.0

# --------------------------------------------------------------------------------------------
# Public API (runs in the caller's process; the work happens in a worker process)
# --------------------------------------------------------------------------------------------


def probe(path: str | Path, timeout_s: float = 60.0) -> Probe:
    """Describe a video or image file (each version of it once per process: `ProbeCache`); raises MediaError if it
    cannot be used."""
    return ProbeCache().probe(path, timeout_s=timeout_s)


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


def decode_audio(path: str | Path, start_s: float, num_samples: int, rate: int, timeout_s: float = 60.0,
                 audio_stream: int | None = None) -> ClipAudio:
    """The sound of `num_samples` samples at `rate` from `start_s` seconds after the file's first video frame, mono,
    of the track `audio_stream` names (None: FFmpeg's pick; media/audio_worker.py says how). Raises MediaError:
    "no_audio" (no audio track, or not the one named), "undecodable" (none of the span decodes), "decoder_crash" (the
    decoder crashed reading the track: a fault of the file or of FFmpeg/PyAV, which the same call repeats), or as
    `decode_frames` for a file that hangs the decoder or a worker killed from outside."""
    path = Path(path)
    _stat_key(path)  # a missing or empty file says so here, as for frames
    request = ("audio", str(path), float(start_s), int(num_samples), int(rate), audio_stream)
    try:
        return _run_in_worker(request, path, timeout_s)["audio"]
    except DecoderCrash as crash:
        if crash.exit_code not in _DECODER_FAULTS:
            raise
        fault = signal.Signals(-crash.exit_code).name
        raise MediaError("decoder_crash", f"{path}: reading its audio track crashed the decoder ({fault}, worker exit "
                         f"code {crash.exit_code}); the picture is not at fault. Re-encode the sound (ffmpeg -i in.mp4 "
                         "-c:v copy -c:a aac -ac 2 out.mp4) or name another track with the dataset's audio_stream"
                         ) from None


# A worker that died of these crashed on what it read (the same request crashes it again); another end (SIGKILL: the
# kernel short of memory, a user) is not the file's.
_DECODER_FAULTS = frozenset(-s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL))


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


class _StageRows:
    """The rows of one store stage a pass reads (every stored row in one read, on the first hit) and adds to
    (PROBE_BATCH at a time, not a shard each: a shard per row cost an fsync per file and left 100k shards for the
    next run to index). A killed pass loses at most PROBE_BATCH rows, which the next one redoes."""

    def __init__(self, store: Store | None, stage: str) -> None:
        self.store, self.stage = store, stage
        self.stored = store.keys(stage) if store is not None else set()
        self.pending: list[dict[str, Any]] = []
        self.kept: set[str] = set()  # keys this pass stored (or will, at its next commit)
        self._rows: dict[str, dict[str, Any]] | None = None

    def row(self, key: str | None) -> dict[str, Any] | None:
        if key not in self.stored:
            return None
        if self._rows is None:
            self._rows = self.store.get(self.stage, self.stored)
        return self._rows[key]

    def keep(self, key: str | None, row: dict[str, Any]) -> None:
        if key is None or key in self.stored or key in self.kept:
            return
        self.pending.append({"key": key, **row})
        self.kept.add(key)
        if len(self.pending) >= PROBE_BATCH:
            self.commit()

    def commit(self) -> None:
        if self.store is not None:
            self.store.put(self.stage, self.pending)
        self.pending = []


class ProbeCache:
    """The one probe cache: a file version (path, size, mtime) is probed once per process, and with a store once ever;
    and so is its scene cut list (`scenes`), once per detector setting.

    In memory, every instance shares one bounded map, so decoding reuses what planning probed; a changed file (size
    or mtime) is probed again. With a store (the clips stage), probes also go to its `probes` stage and cut lists to
    its `scenes` stage, keyed by the file's dataset-relative identity (keys.file_identity), for the next run
    (`_StageRows`: committed in batches, read in one pass).
    """

    _memory: ClassVar[OrderedDict[tuple[Any, ...], Any]] = OrderedDict()  # probes and cut lists by file version
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, store: Store | None = None) -> None:
        self._probes = _StageRows(store, "probes")
        self._scenes = _StageRows(store, "scenes")
        self.scene_lists: dict[str, tuple[int, ...]] = {}  # path -> the cut list this pass used (`scenes`)

    @property
    def pending(self) -> list[dict[str, Any]]:
        """The probes made since the last commit."""
        return self._probes.pending

    def probe(self, path: str | Path, identity: dict[str, Any] | None = None, timeout_s: float = 60.0) -> Probe:
        """`identity`: the file's keys.file_identity, to store the probe under (needs a store)."""
        path = Path(path)
        key = None if identity is None or self._probes.store is None else _stored_probe_key(identity)

        def probed() -> Probe:
            row = self._probes.row(key)
            if row is not None:
                return Probe(**{k: tuple(v) if k == "frame_times" else v for k, v in row.items() if k != "key"})
            return Probe(**_run_in_worker(("probe", str(path)), path, timeout_s)["probe"])

        result = self._remembered(_stat_key(path), probed)
        self._probes.keep(key, dataclasses.asdict(result))  # whoever probed it in this process
        return result

    def scenes(self, path: str | Path, identity: dict[str, Any] | None, info: Probe, threshold: float,
               min_scene_len_s: float) -> tuple[int, ...]:
        """The frame indices where a new scene starts (PySceneDetect's hard cuts, media/scenes_worker.py): () for one
        scene. Detected once per file version and setting, and with a store once ever. The detector decodes every
        frame, so its time limit grows with the video's length."""
        path = Path(path)
        settings = {"detector": DETECTOR, "threshold": float(threshold), "min_scene_len": float(min_scene_len_s)}
        key = None if identity is None or self._scenes.store is None else content_key(
            identity=identity, scenes=SCENES_VERSION, **settings)

        def detected() -> tuple[int, ...]:
            row = self._scenes.row(key)
            if row is not None:
                return tuple(row["cuts"])
            timeout_s = 60.0 + SCENE_SECONDS_PER_SECOND * info.duration_s
            times = _run_in_worker(("scenes", str(path), settings["threshold"], settings["min_scene_len"]), path,
                                   timeout_s)["cuts"]
            return cut_frames(times, info)

        cuts = self._remembered((*_stat_key(path), *settings.values()), detected)
        self._scenes.keep(key, {"cuts": list(cuts)})
        self.scene_lists[str(path)] = cuts
        return cuts

    def _remembered(self, here: tuple[Any, ...], compute: Any) -> Any:
        with self._lock:
            result = self._memory.get(here)
            if result is not None:
                self._memory.move_to_end(here)
                return result
        result = compute()
        with self._lock:
            self._memory[here] = result
            while len(self._memory) > PROBE_CACHE_MAX:
                self._memory.popitem(last=False)
        return result

    def commit(self) -> None:
        """Store the probes and cut lists made since the last commit."""
        self._probes.commit()
        self._scenes.commit()


def cut_frames(times: Sequence[float], info: Probe) -> tuple[int, ...]:
    """Cut times (seconds after the first frame) as the indices of the first frames of their scenes: the frame
    nearest in time (a VFR file by its frame times), without repeats, never frame 0."""
    if info.frame_times:
        stamps = np.asarray(info.frame_times, np.float64)
        found = [int(np.abs(stamps - t).argmin()) for t in times]
    else:
        found = [round(t * info.fps) for t in times]
    return tuple(sorted({i for i in found if 0 < i < info.num_frames}))


def _stored_probe_key(identity: dict[str, Any]) -> str:
    # "clips-1": the clips stage's code version when probes were first stored; a probe does not depend on it, the
    # value only keeps stored probes valid.
    return content_key(identity=identity, code="clips-1", probe=PROBE_VERSION)


def _stat_key(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError as err:
        raise MediaError(
            "unreadable", f"{path}: cannot read the file ({err.strerror}); check the path and permissions"
        ) from err
    if not path.is_file():
        raise MediaError("unreadable", f"{path}: not a regular file; point the dataset at media files")
    if st.st_size == 0:
        raise MediaError("empty_file", f"{path}: the file is empty (0 bytes); re-copy or remove it")
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


# --------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------

# A plain `python -c` child rather than multiprocessing: spawn/forkserver re-import the caller's
# __main__ (breaking scripts without a __main__ guard), and fork is unsafe in a threaded process.
_WORKER_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
    "from loraflow.media.frames import _serve; _serve(int(sys.argv[1]), int(sys.argv[2]))"
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
            raise DecoderCrash(
                "unreadable",
                f"{path}: the decoder crashed on this file (worker exit code {code}); it is corrupt — "
                "re-encode it (e.g. ffmpeg -i in.mp4 -c:v libx264 out.mp4) or remove it",
                exit_code=code,
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
            replies.send({"kind": "ok", "probe": dataclasses.asdict(probe_local(path))})
            return
        if op == "scenes":
            replies.send({"kind": "ok", "cuts": detect_cuts_local(path, *request[2:])})
            return
        if op == "audio":
            from loraflow.media.audio_worker import clip_audio_local

            replies.send({"kind": "ok", "audio": clip_audio_local(path, *request[2:])})
            return
        _, _, indices, size, info = request
        frames, backend, note = decode_local(path, indices, size, Probe(**info))
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
