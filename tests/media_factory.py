"""Writers for small REAL media files used by the media tests.

Every video frame carries its own index, so a test can tell exactly which
source frame a decoder returned after resizing, rotation and lossy coding:
three horizontal bands hold the base-14 digits of the index as grey levels
16, 32, ..., 224 (16 levels apart, so a few levels of coding noise never
flip a digit). A pure red block marks the coded top-left corner, which tells
whether a frame was rotated and whether channels are in RGB order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

DIGITS = 14  # base of the index code: 14 digits x 16 levels fits in 16..224
BANDS = 3  # three digits: indices up to 14**3 - 1 = 2743 are unique

# Encoder logs would drown pytest output; keep only real errors.
_QUIET = {"x264-params": "log-level=error", "x265-params": "log-level=error"}


def level(digit: int) -> int:
    """Grey level that encodes one base-14 digit."""
    return 16 + 16 * digit


def index_frame(i: int, width: int, height: int) -> np.ndarray:
    """RGB frame whose bands encode `i`, with a red block in the top-left corner."""
    frame = np.empty((height, width, 3), np.uint8)
    edges = np.linspace(0, height, BANDS + 1).round().astype(int)
    for band in range(BANDS):
        digit = (i // DIGITS**band) % DIGITS
        frame[edges[band] : edges[band + 1]] = level(digit)
    frame[: max(1, height // 4), : max(1, width // 4)] = (255, 0, 0)
    return frame


def read_index(frame: np.ndarray) -> int:
    """Inverse of `index_frame` for a decoded (possibly resized) RGB frame in coded orientation."""
    height, width = frame.shape[:2]
    edges = np.linspace(0, height, BANDS + 1)
    # Sample the middle of each band, right half only: away from the red marker
    # and from the blur that resizing puts on band edges.
    cols = slice(width // 2 + 1, max(width // 2 + 2, width - 1))
    index = 0
    for band in range(BANDS):
        lo, hi = edges[band], edges[band + 1]
        top = int(lo + (hi - lo) * 0.3)
        rows = slice(top, max(top + 1, int(lo + (hi - lo) * 0.7)))
        mean = float(frame[rows, cols].mean())
        digit = int(np.clip(round((mean - 16) / 16), 0, DIGITS - 1))
        index += digit * DIGITS**band
    return index


def marker_corner(frame: np.ndarray) -> str:
    """Which corner holds the red block: 'tl', 'tr', 'bl' or 'br'."""
    height, width = frame.shape[:2]
    h, w = max(1, height // 8), max(1, width // 8)
    corners = {
        "tl": frame[:h, :w],
        "tr": frame[:h, -w:],
        "bl": frame[-h:, :w],
        "br": frame[-h:, -w:],
    }
    # Red minus the other channels: high only on the marker, low on grey bands.
    def redness(patch: np.ndarray) -> float:
        p = patch.astype(np.float32)
        return float((p[..., 0] - (p[..., 1] + p[..., 2]) / 2).mean())

    return max(corners, key=lambda k: redness(corners[k]))


def write_video(
    path: Path,
    num_frames: int,
    width: int,
    height: int,
    *,
    fps: int = 24,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    pts: Sequence[int] | None = None,
    time_base: Fraction | None = None,
    rotation_cw: int = 0,
    sar: Fraction | None = None,
    audio: str | None = None,
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
) -> Path:
    """Encode `num_frames` index frames.

    `pts` (in `time_base` units) makes a variable-frame-rate file. `rotation_cw`
    writes a display matrix asking players to turn the picture clockwise, the way
    phones tag portrait clips. `sar` stores anamorphic pixels (HDV/AVCHD's 1440x1080
    shown 16:9). `audio` is None, "ok" (a real AAC track) or "broken" (an AAC track
    whose packets are random bytes).
    """
    path = Path(path)
    with av.open(str(path), "w", options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=fps, options={**_QUIET, **(options or {})})
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if time_base is not None:
            stream.codec_context.time_base = time_base
            stream.time_base = time_base
        if sar is not None:
            stream.codec_context.sample_aspect_ratio = sar
        if rotation_cw:
            # PyAV takes a counter-clockwise angle (FFmpeg's display-matrix convention).
            stream.set_display_rotation(-rotation_cw)
        audio_stream = _add_audio(out) if audio else None
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(index_frame(i, width, height), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
        if audio_stream is not None:
            _write_audio(out, audio_stream, seconds=num_frames / fps, broken=audio == "broken")
    return path


def _add_audio(out: av.container.OutputContainer) -> av.audio.stream.AudioStream:
    stream = out.add_stream("aac", rate=16000)
    stream.layout = "mono"
    return stream


def _write_audio(
    out: av.container.OutputContainer, stream: av.audio.stream.AudioStream, seconds: float, broken: bool
) -> None:
    rng = np.random.default_rng(0)
    samples = int(seconds * 16000)
    for start in range(0, samples, 1024):
        tone = np.sin(np.arange(start, start + 1024) * 0.05).astype(np.float32)[None]
        frame = av.AudioFrame.from_ndarray(tone, format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, start
        for packet in stream.encode(frame):
            if broken:
                # Same timing, garbage payload: demuxes fine, fails to decode.
                packet.update(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
            out.mux(packet)
    if not broken:
        out.mux(stream.encode(None))


def write_h264(path: Path, num_frames: int = 30, width: int = 96, height: int = 64, **kw: object) -> Path:
    """Plain H.264 in MP4 with B-frames (x264 'veryfast' keeps them), like phone exports."""
    kw.setdefault("options", {"preset": "veryfast"})
    return write_video(path, num_frames, width, height, **kw)  # type: ignore[arg-type]


def write_vfr(path: Path, num_frames: int = 30, width: int = 96, height: int = 64) -> Path:
    """H.264 MP4 whose frame durations alternate 20 ms / 60 ms (average 25 fps)."""
    pts = np.cumsum([0] + [20 if i % 2 else 60 for i in range(num_frames - 1)]).tolist()
    return write_video(path, num_frames, width, height, fps=25, pts=pts, time_base=Fraction(1, 1000))


def write_rotated(path: Path, rotation_cw: int = 90, num_frames: int = 12, width: int = 128, height: int = 80) -> Path:
    return write_video(path, num_frames, width, height, rotation_cw=rotation_cw)


def write_10bit(path: Path, num_frames: int = 12, width: int = 96, height: int = 64) -> Path:
    """10-bit 4:2:0 H.264 (High 10), what cameras in HDR/log modes produce."""
    return write_video(path, num_frames, width, height, pix_fmt="yuv420p10le")


def write_odd_size(path: Path, num_frames: int = 10, width: int = 97, height: int = 55) -> Path:
    """Odd width and height; MPEG-4 Part 2 accepts them, H.264 4:2:0 encoders do not."""
    return write_video(path, num_frames, width, height, codec="mpeg4", options={"qscale": "2"})


def write_mov(path: Path, num_frames: int = 14, width: int = 80, height: int = 80) -> Path:
    return write_video(path, num_frames, width, height)


def write_webm_vp9(path: Path, num_frames: int = 16, width: int = 96, height: int = 64) -> Path:
    return write_video(path, num_frames, width, height, codec="libvpx-vp9", options={"crf": "20", "b": "0"})


def write_audio_only(path: Path, seconds: float = 1.0) -> Path:
    with av.open(str(path), "w") as out:
        stream = _add_audio(out)
        _write_audio(out, stream, seconds=seconds, broken=False)
    return path


def write_truncated(path: Path, keep_fraction: float = 0.6, faststart: bool = False) -> Path:
    """An MP4 cut short, as an interrupted copy or download leaves it.

    Without faststart the index (moov) sits at the end and is lost entirely;
    with faststart the index survives but promises frames that are missing.
    """
    opts = {"movflags": "faststart"} if faststart else None
    write_video(path, 60, 96, 64, container_options=opts, options={"preset": "ultrafast"})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path


def write_zero_bytes(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def write_text_as_video(path: Path) -> Path:
    path.write_text("this is not a video, just a caption saved with the wrong name\n" * 20)
    return path


def write_unknown_codec(path: Path) -> Path:
    """An MP4 whose sample entry names a codec no decoder knows (its fourcc patched to 'zzzz')."""
    write_video(path, 6, 96, 64, options={"preset": "ultrafast"})
    data = path.read_bytes()
    # Patch the sample description, not the 'avc1' brand in the ftyp box.
    at = data.index(b"avc1", data.index(b"stsd"))
    path.write_bytes(data[:at] + b"zzzz" + data[at + 4 :])
    return path


def write_corrupt_header(path: Path) -> Path:
    """An MP4 with its index intact but the decoder configuration (avcC) destroyed."""
    write_video(path, 6, 96, 64, options={"preset": "ultrafast"})
    data = path.read_bytes()
    at = data.index(b"avcC") + 4
    path.write_bytes(data[:at] + bytes(16) + data[at + 16 :])
    return path


def write_edit_list(path: Path, hidden: int = 5, num_frames: int = 30) -> Path:
    """An MP4 whose first `hidden` frames sit before its edit list, as trimming without
    re-encoding leaves them: they are in the file but players (and FFmpeg) never show them."""
    pts = [(i - hidden) * 512 for i in range(num_frames)]
    return write_video(
        path, num_frames, 96, 64, pts=pts, time_base=Fraction(1, 12288), options={"preset": "veryfast"}
    )


def write_long(path: Path, num_frames: int = 2000, width: int = 96, height: int = 64) -> Path:
    return write_video(path, num_frames, width, height, options={"preset": "ultrafast", "g": "50"})


def write_image(path: Path, width: int = 64, height: int = 48, index: int = 0, exif_rotation_cw: int = 0) -> Path:
    """A still image carrying the same index pattern; JPEG/PNG/WebP chosen by suffix."""
    image = Image.fromarray(index_frame(index, width, height))
    if exif_rotation_cw:
        # EXIF orientation 6 = turn 90 cw to display, 3 = 180, 8 = 270 cw.
        exif = image.getexif()
        exif[0x0112] = {90: 6, 180: 3, 270: 8}[exif_rotation_cw]
        image.save(path, exif=exif.tobytes(), quality=95)
    else:
        image.save(path, quality=95)  # PNG ignores quality
    return path


def write_png16(path: Path, width: int = 64, height: int = 48, value: int = 40000) -> Path:
    """A 16-bit greyscale PNG of one level (0..65535)."""
    Image.fromarray(np.full((height, width), value, np.uint16)).save(path)
    return path


def write_rgba_png(path: Path, width: int = 64, height: int = 48) -> Path:
    """Left half opaque blue, right half fully transparent (stored colour black)."""
    rgba = np.zeros((height, width, 4), np.uint8)
    rgba[:, : width // 2] = (0, 0, 255, 255)
    Image.fromarray(rgba, "RGBA").save(path)
    return path


def tone(seconds: float, rate: int, hz: float, amplitude: float = 0.5, starts_s: float = 0.0) -> np.ndarray:
    """(N,) float64: a sine of `hz` that is silent before `starts_s` (seconds from the track's first sample)."""
    t = np.arange(round(seconds * rate)) / rate
    return np.where(t >= starts_s, amplitude * np.sin(2 * np.pi * hz * t), 0.0)


def s16(sound: np.ndarray) -> np.ndarray:
    """What a 16-bit PCM track stores of float samples, read back as a decoder returns them (v / 32768)."""
    return np.round(np.clip(sound, -1, 1) * 32767) / 32768


def write_with_sound(path: Path, num_frames: int, sound: np.ndarray, rate: int, layout: str = "mono", *,
                     fps: int = 24, width: int = 64, height: int = 64, offset_s: float = 0.0,
                     codec: str = "pcm_s16le") -> Path:
    """Index frames (H.264) with a sound track: `sound` float (channels, N) in [-1, 1] at `rate`, channel `layout`
    ("mono", "stereo", "5.1", "7.1"), its first sample `offset_s` after the first frame (a track that starts late).
    pcm_s16le (exact: `s16` says what it stores; in a .mov or .mkv), pcm_f32le (float as given, NaN and over full scale
    too), flac (16-bit, exact like s16; in a .mkv) or aac (lossy, as phones write; in an .mp4)."""
    track = Track(sound, rate, layout, codec=codec, offset_s=offset_s)
    return write_with_tracks(path, num_frames, [track], fps=fps, width=width, height=height)


@dataclass(frozen=True)
class Track:
    """One sound track for `write_with_tracks` (the fields as `write_with_sound` takes them); `disposition` names
    av.stream.Disposition flags ("default", "comment"), none: the muxer's own choice."""

    sound: np.ndarray
    rate: int
    layout: str = "mono"
    codec: str = "pcm_s16le"
    offset_s: float = 0.0
    disposition: tuple[str, ...] = ()


def write_with_tracks(path: Path, num_frames: int, tracks: Sequence[Track], *, fps: int = 24, width: int = 64,
                      height: int = 64) -> Path:
    """Index frames (H.264) and the sound `tracks`, in that order of streams."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=fps, options=_QUIET)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        streams = []
        for track in tracks:
            audio = out.add_stream(track.codec, rate=track.rate)
            audio.layout = track.layout
            if track.codec == "aac":  # 64 kb/s a channel (FFmpeg's default is 128 kb/s for all of them: 16 for 7.1)
                audio.bit_rate = 64_000 * audio.codec_context.channels
            if track.disposition:
                audio.disposition = sum(getattr(av.stream.Disposition, name) for name in track.disposition)
            streams.append(audio)
        for i in range(num_frames):
            out.mux(video.encode(av.VideoFrame.from_ndarray(index_frame(i, width, height), format="rgb24")))
        out.mux(video.encode(None))
        for track, audio in zip(tracks, streams, strict=True):
            _encode_track(out, audio, track)
    return path


def _encode_track(out: av.container.OutputContainer, audio: av.audio.stream.AudioStream, track: Track) -> None:
    # Frames go in packed (one interleaved plane; the encoder converts to its own format, fltp for AAC): PyAV 18.1
    # counts 9 planes in an 8-channel planar frame and its from_ndarray fails on one
    fmt = "s16" if audio.codec_context.format.name.startswith("s16") else "flt"
    chunk = audio.codec_context.frame_size or 1024
    for start in range(0, track.sound.shape[1], chunk):
        part = track.sound[:, start:start + chunk]
        if fmt == "s16":
            part = np.round(np.clip(part, -1, 1) * 32767).astype(np.int16)
        samples = np.ascontiguousarray(part.T.reshape(1, -1), np.int16 if fmt == "s16" else np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format=fmt, layout=track.layout)
        frame.sample_rate, frame.time_base = track.rate, Fraction(1, track.rate)
        frame.pts = start + round(track.offset_s * track.rate)
        out.mux(audio.encode(frame))
    out.mux(audio.encode(None))


def write_footage(path: Path, segments: Sequence[tuple[int, tuple[int, int, int]]], fades: dict[int, int] | None = None,
                  width: int = 96, height: int = 64, fps: int = 24) -> Path:
    """A recording of `segments` (frame count, RGB colour of its source) joined by hard cuts, except where `fades`
    says segment n's last `fades[n]` frames dissolve into segment n + 1's colour (a fade, not a cut). The left half
    of each frame is its source's colour and the right half carries the index code (`read_index` samples the right
    half), so which source a decoded frame came from and which frame it is are both readable."""
    colours: list[np.ndarray] = []
    for number, (count, colour) in enumerate(segments):
        ramp = (fades or {}).get(number, 0)
        here, after = np.asarray(colour, np.float64), np.asarray(segments[min(number + 1, len(segments) - 1)][1])
        for i in range(count):
            weight = max(0, i - (count - ramp) + 1) / (ramp + 1) if ramp else 0.0
            colours.append((1 - weight) * here + weight * after)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps, options={**_QUIET, "preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i, colour in enumerate(colours):
            frame = index_frame(i, width, height)
            frame[:, : width // 2] = np.round(colour).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode(None))
    return path
