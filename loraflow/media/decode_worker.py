"""The decode worker: the worker side of loraflow.media.frames, probing and decoding inside a time-bounded worker
process.

Nothing here is called in the pipeline's own process; `frames.probe` and `frames.decode_frames` send a request to a
worker, which calls `probe_local` or `decode_local` (local to the worker).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import traceback
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from loraflow.media.types import IMAGE_EXTENSIONS, MediaError, Probe

logger = logging.getLogger("loraflow.media.frames")

# Containers whose rotation decord's bundled FFmpeg 4.0 reads the same way we do (the "rotate"
# tag / display matrix of the MP4 family). Elsewhere a rotated stream goes to PyAV.
_DECORD_ROTATION_SUFFIXES = frozenset({".mp4", ".mov", ".m4v"})
# Containers whose frames decord finds by index. In AVI, MPEG-TS/PS and MXF its seeks land on the wrong frames
# without an error (H.264 with B-frames in .ts: frame 14 for 0, in .avi: frame 0 for 28; MPEG-2 in .mpg/.vob/.mxf:
# frame 14 for 15), so those go to PyAV.
_DECORD_SUFFIXES = _DECORD_ROTATION_SUFFIXES | {".mkv", ".webm"}
# decord 0.6 infers the channel count from the padded row size, so some narrow outputs come back
# with 4..48 "channels" (or get_batch raises). Measured over widths 2..4096: 2, 3, 4, 6, 8, 12, 16,
# 24, 48 and 72 break, nothing wider. The shape is still checked after every decord call.
_DECORD_MIN_WIDTH = 80
_DECORD_CHUNK = 8  # frames per get_batch call

# --------------------------------------------------------------------------------------------
# Probing (worker side)
# --------------------------------------------------------------------------------------------


def probe_local(path: Path) -> Probe:
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return _probe_image(path)
    return _probe_video(path)


def _probe_video(path: Path) -> Probe:
    with _open_container(path) as container:
        stream = _video_stream(container, path)
        first = _first_frame(container, stream, path)
        indexed = _timestamps_from_index(stream, path) if _has_sample_table(container) else None
        counted = indexed or _demuxed(path)
        # Everything is read while the container is open: PyAV streams die with it.
        info = _describe(path, container, stream, first, *counted)
        tick = float(stream.time_base or 0)
    if not info.is_vfr or not tick:
        return info
    # Frame times for time-based resampling: presentation stamps, which a sample table does not hold (its
    # decode stamps run ahead of them by a varying amount with B-frames), so a VFR file is demuxed once more.
    count, stamps = _demuxed(path) if indexed else counted
    times = tuple(round((t - stamps[0]) * tick, 6) for t in stamps) if count == info.num_frames else ()
    return dataclasses.replace(info, frame_times=times)


def _demuxed(path: Path) -> tuple[int, list[int]]:
    with _open_container(path) as container:
        return _timestamps_from_demux(container, _video_stream(container, path), path)


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
    first_key = _NO_KEYFRAME
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the flush packet PyAV appends
            total += 1
            past_end = packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size > file_size
            if packet.is_corrupt or past_end:
                _raise_truncated(path, f"packet {total} is incomplete")
            first_key = _first_key(first_key, packet)
            if _shown(first_key, packet.pts) and not packet.is_discard:
                stamps.append(packet.pts if packet.pts is not None else packet.dts if packet.dts is not None else total)
    except av.error.FFmpegError as err:
        _raise_truncated(path, f"reading stopped after {total} packets ({err})")
    if stream.frames > total:
        _raise_truncated(path, f"the header promises {stream.frames} frames but only {total} are present")
    return len(stamps), sorted(stamps)


# A recording cut mid-stream (a .ts capture) opens on frames whose references were cut off. Decoders drop them, and
# how many depends on the codec (H.264 shows an open GOP's leading frames, MPEG-2 drops them), so both the count and
# the PyAV decode keep the same frames: from the first keyframe on, none shown before it.
_NO_KEYFRAME = object()


def _first_key(first_key: Any, packet: Any) -> Any:
    """The first keyframe's pts once one was read (None if that packet has no pts), else _NO_KEYFRAME."""
    return packet.pts if first_key is _NO_KEYFRAME and packet.is_keyframe else first_key


def _shown(first_key: Any, pts: int | None) -> bool:
    return first_key is not _NO_KEYFRAME and (first_key is None or pts is None or pts >= first_key)


def _shown_frames(container: Any, stream: Any) -> Iterator[Any]:
    """The decoded frames the probe counted (see _first_key)."""
    first_key = _NO_KEYFRAME
    for packet in container.demux(stream):
        first_key = _first_key(first_key, packet)
        if first_key is not _NO_KEYFRAME or packet.size == 0:  # the flush packet drains the decoder
            yield from (frame for frame in packet.decode() if _shown(first_key, frame.pts))


def _raise_truncated(path: Path, detail: str) -> NoReturn:
    raise MediaError("truncated", f"{path}: the file is cut short — {detail}; re-download or re-export it")


def _describe(path: Path, container: Any, stream: Any, first: Any, num_frames: int, stamps: list[int]) -> Probe:
    if num_frames == 0:
        raise MediaError("zero_frames", f"{path}: the video stream has no frames; remove the file")
    if num_frames > 1 and len(stamps) > 1 and stamps[0] == stamps[-1]:  # sorted: every frame at one time
        raise MediaError("zero_duration", f"{path}: its {num_frames} frames all carry one timestamp (the video lasts "
                         "0 s), so its frame rate is unknown and any clip of it a guess; re-encode it at its real "
                         "rate (ffmpeg -r FPS -i FILE OUT.mp4)")
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
    except (ValueError, SyntaxError, struct.error) as err:  # Pillow's other ways of refusing a file (huge text chunks)
        raise MediaError("unreadable", f"{path}: the image cannot be decoded ({err}); re-export it") from err
    orientation = image.getexif().get(0x0112, 1)
    return image, _EXIF_ROTATION.get(orientation, 0), image.mode


# --------------------------------------------------------------------------------------------
# Decoding (worker side)
# --------------------------------------------------------------------------------------------


def decode_local(
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
    if path.suffix.lower() not in _DECORD_SUFFIXES:
        return f"decord seeks {path.suffix.lower()} files to the wrong frames"
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

    # The worker sends FFmpeg's log lines to Python (frames._serve), which takes the GIL in the thread that logs.
    # Freeing a frame-threaded decoder holds the GIL while it waits for its threads, so a thread logging an error then
    # (a stop before the end, a damaged file) hung the worker until the timeout: 3 of 22 runs on a 720p .ts. Logging
    # stays off until this decoder is freed: on return with `_pyav_frames`' frame, on an error by clearing its frame.
    level = av.logging.get_level()
    av.logging.set_level(None)
    try:
        return _pyav_frames(path, indices, size, rotation)
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        av.logging.set_level(level)


def _pyav_frames(path: Path, indices: list[int], size: tuple[int, int], rotation: int) -> np.ndarray:
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
            for position, frame in enumerate(_shown_frames(container, stream)):
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
                "unreadable",
                f"{path}: decoding failed before frame {target} ({err}); the file is damaged, re-export it"
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
