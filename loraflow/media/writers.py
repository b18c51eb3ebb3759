"""Rendered frames to files: mp4 for videos (with a rendered sound: an AAC stream), PNG for images (validation and the
renders during training)."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from loraflow.atomic import write_atomic
from loraflow.media.types import Sound


def slug(name: str) -> str:
    """A shortname as a folder name (the index prefix keeps two names with one slug apart)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:60] or "prompt"


def write_media(frames: np.ndarray, stem: Path, fps: float, sound: Sound | None = None) -> Path:
    """uint8 (F, H, W, 3) -> `stem`.png when F == 1 (image families, lossless), else `stem`.mp4, with `sound` as its
    audio stream. Renders are written with the reproducible x264 settings: at PyAV's defaults (threads auto) x264
    wrote the same frames to other bytes now and then, which made a resumed validation run's mp4 decode to other
    pixels than the first run's (issue 41's flake; test_validate.test_a_render_written_again_is_the_same_file)."""
    if len(frames) == 1:
        if sound is not None:
            raise ValueError("a still has no sound track: sound is rendered with videos only")
        path = stem.with_suffix(".png")
        save_png(Image.fromarray(frames[0]), path)
    else:
        path = stem.with_suffix(".mp4")
        write_mp4(frames, path, fps, reproducible=True, sound=sound)
    return path


def read_media(path: str | Path) -> np.ndarray:
    """uint8 (F, H, W, 3) of what write_media wrote (an mp4's frames as decoded, lossy)."""
    if Path(path).suffix == ".png":
        return np.asarray(Image.open(path).convert("RGB"))[None]
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


# Same frames, same bytes (the demo data, the renders): the codec on one thread (at PyAV's default thread count x264
# wrote other bytes for 1-6% of the writes of one 48x64 render, 0 of 400 on one thread), and "superfast", whose
# settings skip x264's mb-tree lookahead; with veryfast, 96-px-wide clips came out different about 1 run in 30.
REPRODUCIBLE_X264 = {"crf": "18", "preset": "superfast", "x264-params": "log-level=error:threads=1"}


def write_mp4(frames: np.ndarray, path: Path, fps: float, reproducible: bool = False,
              sound: Sound | None = None) -> None:
    """uint8 (F, H, W, 3) -> h264 yuv420p mp4 (odd sizes padded by edge copy, as yuv420p requires);
    `reproducible`: REPRODUCIBLE_X264 on one thread, else x264's defaults. `sound`: a mono AAC stream at its rate
    (FFmpeg's native encoder; AAC is the audio codec every mp4 player takes), from its first sample at time 0."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")

    def encode(tmp: Path) -> None:
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001),  # 23.976 stays exact
                                          options=REPRODUCIBLE_X264 if reproducible else {})
            stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            if reproducible:
                stream.codec_context.thread_count = 1
            audio = container.add_stream("aac", rate=sound.rate, layout="mono") if sound is not None else None
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
            if audio is not None:
                _mux_sound(container, audio, sound)

    write_atomic(path, encode)


def _mux_sound(container: av.container.OutputContainer, stream: av.audio.stream.AudioStream, sound: Sound) -> None:
    """`sound` into its AAC `stream` (added with the video's, before the first packet): float planar, the encoder's
    own format; PyAV cuts the one frame into the encoder's frames (1024 samples) and the encoder pads the last."""
    waveform = np.clip(np.asarray(sound.waveform, np.float32), -1.0, 1.0)[None]  # (1, N): one plane
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform), format="fltp", layout="mono")
    frame.sample_rate, frame.pts = sound.rate, 0
    container.mux(stream.encode(frame))
    container.mux(stream.encode())


def save_png(image: Image.Image, path: Path) -> None:
    write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))
