"""The media vocabulary both sides of the decode worker share: file extensions, `MediaError`, `Probe` and
`ClipAudio`; and `Sound`, a rendered sound track on its way to a file.

Below `media` (the caller's side) and `media_decode` (the worker's side), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What datasets take: each is read by the installed Pillow or PyAV and tested in tests/media/test_media.py. A TIFF or
# AVIF gives its first page or frame. The MPEG transport stream (.ts; AVCHD's .mts/.m2ts), program stream
# (.mpg/.mpeg, DVD .vob) and MXF have no frame index, so they are counted by demuxing and decoded with PyAV.
IMAGE_EXTENSIONS: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".avif"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({
    ".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".mpg", ".mpeg", ".vob", ".mxf",
})

# The codes the media modules raise. Callers add their own (the clips stage: "missing_caption",
# "too_short", ...), so MediaError accepts any short code.
REASONS = frozenset(
    {
        "unreadable",
        "empty_file",
        "not_media",
        "no_video_stream",
        "zero_frames",
        "zero_duration",
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


class DecoderCrash(MediaError):
    """The worker process died during a call (reason "unreadable"): `exit_code` is its exit status, minus the signal
    that ended it (-11: a segmentation fault; -9: killed from outside, e.g. by the kernel short of memory)."""

    exit_code: int | None

    def __init__(self, reason: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(reason, message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (DecoderCrash, (self.reason, str(self), self.exit_code))


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
    # VFR only: each output frame's time in seconds from the first (CFR: (), the frame rate says it all)
    frame_times: tuple[float, ...] = ()


@dataclass(frozen=True)
class ClipAudio:
    """The sound of a time span of a file (media/audio_worker.py): mono float32 samples at `rate` from the span's
    start, which of them the track covered (a bool per sample; the rest are zeros), the track in words, the first
    errors of packets that did not decode (their time is uncovered), which track it is, and what was over full
    scale (clipped)."""

    waveform: Any  # np.ndarray (N,) float32; Any: this module stays free of numpy
    rate: int
    covered: Any  # np.ndarray (N,) bool
    source: str  # "aac 6 ch (5.1) at 48000 Hz"
    errors: tuple[str, ...] = ()
    track: str = ""  # which audio track: "a:1 of 2 (default; FFmpeg's pick), stream #2"
    peak: float = 0.0  # the loudest channel's largest |sample| over the span, before clipping (over 1: clipped)
    clipped_s: float = 0.0  # seconds of the span where a channel was over full scale and clipped to [-1, 1]

    def uncovered_s(self, until_s: float) -> float:
        """Seconds of the first `until_s` seconds the track does not cover."""
        return float((~self.covered[: round(until_s * self.rate)]).sum() / self.rate)


@dataclass(frozen=True)
class Sound:
    """A rendered sound track (Kandinsky 6's vocoder, over its video's span): mono float32 samples in [-1, 1] at
    `rate` Hz; written as the render's audio stream (media/writers.py), drawn under its contact sheet (previews.py)."""

    waveform: Any  # np.ndarray (N,) float32
    rate: int
