"""Pictures for the UI: clip thumbnails, labelled contact sheets (with a rendered sound: its spectrogram),
animated previews, loss plots.

Every picture is embedded in Dagster markdown metadata, which the UI shows in a dialog at most 80% of the window
wide: a sheet wraps its frames at MAX_SHEET_WIDTH so it fits a 1280 px window without scrolling sideways.
matplotlib is imported inside the plot functions, so loading the code location stays fast.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from loraflow.atomic import write_atomic
from loraflow.media.types import Sound

THUMB = 96
PREVIEW_CLIPS = 12  # clips in the clips asset's preview
SHEET_ROW_HEIGHT = 128  # px per row of frames: small enough to embed in the asset's metadata
MAX_SHEET_WIDTH = 960  # px: 80% of a 1280 px window, less the dialog's 2 x 20 px padding, less a margin
MAX_LABEL_WIDTH = 160  # px: longer labels (prompt shortnames) are cut with an ellipsis
MAX_ANIMATION_FRAMES = 48  # longer videos play every n-th frame, over the same duration
FONT_SIZE = 14
TEXT_HEIGHT = 22  # px of a title line
GAP = 2  # px of white between frames and lines, so frame boundaries show
BLOCK_GAP = 8  # px of white between two videos' blocks, so base and LoRA stay apart when their frames wrap
PLOT_INCHES, PLOT_DPI = (6.4, 3.2), 100  # 640 x 320 px
SPECTROGRAM_ROW_INCHES = 1.8  # 180 px a sound
SPECTROGRAM_FFT = 1024  # samples a window: 23 ms at 44.1 kHz
SPECTROGRAM_RANGE_DB = 80  # the colour scale's depth below the loudest bin


def clip_preview(clips: Sequence[Mapping[str, Any]]) -> Image.Image:
    """First frame of each stored clip row (`contracts.clip_rows.stored_clips`: at most PREVIEW_CLIPS) side by side,
    each fitted into a THUMB x THUMB cell; i2i: each clip's source image (`condition_frames`) in a second row below
    it."""
    rows = [[np.asarray(clip["frames"][0]) for clip in clips]]
    if clips and clips[0].get("condition_frames") is not None:
        rows.append([np.asarray(clip["condition_frames"][0]) for clip in clips])
    canvas = Image.new("RGB", (THUMB * max(1, len(clips)), THUMB * len(rows)), "black")
    for r, frames in enumerate(rows):
        for i, frame in enumerate(frames):
            thumb = Image.fromarray(frame)
            thumb.thumbnail((THUMB, THUMB))
            canvas.paste(thumb, (i * THUMB + (THUMB - thumb.width) // 2, r * THUMB + (THUMB - thumb.height) // 2))
    return canvas


# -- scene cuts: the frames on both sides of each ---------------------------------------------------------------
CUT_FRAMES = 3  # frames shown on each side of a cut
MAX_CUTS_SHOWN = 12  # cuts drawn, over every file (the table lists them all)
CUT_BAR = 4  # px of red between a cut's two sides


class CutFile(Protocol):
    """What a cut strip needs of a file (the clips report's `SceneRow`): its name, where it is, its cuts."""

    file: str  # shown
    path: str  # decoded
    cuts: tuple[int, ...]  # the first frame of each scene after the first


def cut_strips(scenes: Sequence[CutFile]) -> Image.Image:
    """For each cut of each file (the clips report's `scenes`; the first MAX_CUTS_SHOWN): a line naming it, then the
    CUT_FRAMES frames before it, a red bar, and the CUT_FRAMES frames from it on, each tile at most THUMB px tall and
    the line at most MAX_SHEET_WIDTH wide. Decodes those frames only, at the tiles' size."""
    from loraflow.media.frames import decode_frames, probe

    cuts = [(row, number, cut) for row in scenes for number, cut in enumerate(row.cuts, 1)][:MAX_CUTS_SHOWN]
    lines = []
    for row, number, cut in cuts:
        info = probe(row.path)
        room = (MAX_SHEET_WIDTH - CUT_BAR - 2 * GAP * CUT_FRAMES) / (2 * CUT_FRAMES)
        height = max(2, min(THUMB, round(room * info.height / info.width)))
        size = (height, max(2, round(height * info.width / info.height)))
        before = list(range(max(0, cut - CUT_FRAMES), cut))
        after = list(range(cut, min(info.num_frames, cut + CUT_FRAMES)))
        shown = decode_frames(row.path, before + after, size)
        seconds = cut / info.fps if info.fps else 0.0
        label = f"{row.file}: cut {number} of {len(row.cuts)}, at frame {cut} ({seconds:.2f} s): scene {number} | " \
                f"scene {number + 1}"
        lines.append(_cut_line(label, list(shown[: len(before)]), list(shown[len(before):])))
    if not lines:
        return Image.new("RGB", (1, 1), "white")
    canvas = Image.new("RGB", (max(line.width for line in lines), sum(line.height + BLOCK_GAP for line in lines)),
                       "white")
    y = 0
    for line in lines:
        canvas.paste(line, (0, y))
        y += line.height + BLOCK_GAP
    return canvas


def _cut_line(label: str, before: list[np.ndarray], after: list[np.ndarray]) -> Image.Image:
    tiles = [Image.fromarray(frame) for frame in [*before, *after]]
    height, width = tiles[0].height, tiles[0].width
    line_width = len(tiles) * (width + GAP) + CUT_BAR + GAP
    line = Image.new("RGB", (max(line_width, 1), TEXT_HEIGHT + height), "white")
    draw = ImageDraw.Draw(line)
    draw.text((4, 3), _fit(draw, label, line_width - 8), fill="black", font=_font())
    x = 0
    for i, tile in enumerate(tiles):
        if i == len(before):
            draw.rectangle((x, TEXT_HEIGHT, x + CUT_BAR - 1, TEXT_HEIGHT + height - 1), fill=(255, 0, 0))
            x += CUT_BAR + GAP
        line.paste(tile, (x, TEXT_HEIGHT))
        x += width + GAP
    return line


# -- renders: a still sheet and an animation ------------------------------------------------------------------
def contact_sheet(videos: Mapping[str, np.ndarray], title: str = "", columns: int = 8,
                  sounds: Mapping[str, Sound] | None = None) -> Image.Image:
    """Each labelled uint8 (F, H, W, 3) video as up to `columns` frames spread over its length, SHEET_ROW_HEIGHT
    px tall, wrapped into lines that fit MAX_SHEET_WIDTH, its label left of its first line; `title` on top; the
    videos' `sounds` (by label) as `spectrograms` below."""
    if sounds:
        return _stacked(contact_sheet(videos, title, columns), spectrograms(sounds))
    # 1. tiles: the picked frames of each video, scaled to the row height
    tiles = {}
    for label, video in videos.items():
        picks = np.linspace(0, len(video) - 1, min(columns, len(video))).round().astype(int)
        tiles[label] = [_scaled(video[i], SHEET_ROW_HEIGHT) for i in picks]
    # 2. layout: the label column, then as many tiles per line as fit
    label_width = _label_width(tiles)
    tile_width = max(t.width for row in tiles.values() for t in row)
    per_line = max(1, (MAX_SHEET_WIDTH - label_width + GAP) // (tile_width + GAP))
    lines = {label: [row[i:i + per_line] for i in range(0, len(row), per_line)] for label, row in tiles.items()}
    width = label_width + min(per_line, max(len(row) for row in tiles.values())) * (tile_width + GAP) - GAP
    top = TEXT_HEIGHT if title else 0
    height = top + sum(len(ls) * (SHEET_ROW_HEIGHT + GAP) - GAP for ls in lines.values()) + BLOCK_GAP * (len(lines) - 1)
    # 3. draw: title, then each video's label and lines
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((4, 3), _fit(draw, title, width - 8), fill="black", font=_font())
    y = top
    for label, video_lines in lines.items():
        draw.text((4, y + 4), _fit(draw, label, label_width - 8), fill="black", font=_font())
        for line in video_lines:
            for i, tile in enumerate(line):
                sheet.paste(tile, (label_width + i * (tile_width + GAP), y))
            y += SHEET_ROW_HEIGHT + GAP
        y += BLOCK_GAP - GAP
    return sheet


def _stacked(top: Image.Image, bottom: Image.Image) -> Image.Image:
    """`bottom` under `top`, BLOCK_GAP px of white between, left-aligned on white."""
    canvas = Image.new("RGB", (max(top.width, bottom.width), top.height + BLOCK_GAP + bottom.height), "white")
    canvas.paste(top, (0, 0))
    canvas.paste(bottom, (0, top.height + BLOCK_GAP))
    return canvas


def save_animation(videos: Mapping[str, np.ndarray], fps: float, path: Path) -> None:
    """The labelled videos side by side, playing in a loop: an animated WebP (lossy: a few tens of KB for the
    demo) at `fps`; at most MAX_ANIMATION_FRAMES frames, a longer video keeping its duration."""
    count = len(next(iter(videos.values())))
    picks = np.linspace(0, count - 1, min(count, MAX_ANIMATION_FRAMES)).round().astype(int)
    frame_ms = round(1000 * count / fps / len(picks))
    frames = [_side_by_side({label: video[i] for label, video in videos.items()}) for i in picks]
    write_atomic(path, lambda tmp: frames[0].save(tmp, format="WEBP", save_all=True, append_images=frames[1:],
                                                  duration=frame_ms, loop=0, quality=80))


def _side_by_side(frames: Mapping[str, np.ndarray]) -> Image.Image:
    """One animation frame: each video's frame at SHEET_ROW_HEIGHT with its label above it."""
    tiles = {label: _scaled(frame, SHEET_ROW_HEIGHT) for label, frame in frames.items()}
    canvas = Image.new("RGB", (sum(t.width + GAP for t in tiles.values()) - GAP, TEXT_HEIGHT + SHEET_ROW_HEIGHT),
                       "white")
    draw = ImageDraw.Draw(canvas)
    x = 0
    for label, tile in tiles.items():
        draw.text((x + 4, 3), _fit(draw, label, tile.width - 8), fill="black", font=_font())
        canvas.paste(tile, (x, TEXT_HEIGHT))
        x += tile.width + GAP
    return canvas


def _scaled(frame: np.ndarray, height: int) -> Image.Image:
    image = Image.fromarray(frame)
    size = (max(1, round(image.width * height / image.height)), height)
    return image.resize(size, Image.NEAREST if height >= image.height else Image.LANCZOS)  # crisp when enlarging


def _label_width(tiles: Mapping[str, Any]) -> int:
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    return min(MAX_LABEL_WIDTH, max(round(draw.textlength(label, font=_font())) for label in tiles) + 12)


def _fit(draw: ImageDraw.ImageDraw, text: str, width: int) -> str:
    """`text`, cut with an ellipsis where it would be wider than `width` px."""
    if draw.textlength(text, font=_font()) <= width:
        return text
    while text and draw.textlength(text + "…", font=_font()) > width:
        text = text[:-1]
    return text + "…"


@functools.cache
def _font() -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=FONT_SIZE)  # Pillow's bundled font: the same on every machine


# -- plots ---------------------------------------------------------------------------------------------------
def smoothed(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average with weight 1 - 1/span on the past, divided by the weights' sum so the first
    values are not pulled towards 0 (TensorBoard's smoothing); span 1 gives the values back."""
    beta, average, weight, out = 1 - 1 / span, 0.0, 0.0, []
    for value in values:
        average, weight = beta * average + (1 - beta) * value, beta * weight + (1 - beta)
        out.append(average / weight)
    return out


def loss_plot(history: Sequence[Mapping[str, float]]) -> Image.Image:
    """Training loss per optimizer step: raw, and smoothed over ~1/10 of the run."""
    steps, losses = [h["step"] for h in history], [h["loss"] for h in history]
    span = max(1, len(losses) // 10)
    figure, axes = _figure()
    axes.plot(steps, losses, color="tab:red", alpha=0.35, linewidth=1, marker="." if len(steps) <= 50 else None,
              label="raw")
    axes.plot(steps, smoothed(losses, span), color="tab:red", linewidth=2, label=f"smoothed (EMA, span {span})")
    axes.set(title="training loss", xlabel="optimizer step", ylabel="flow-matching MSE")
    axes.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    audio = [h.get("audio_loss") for h in history]
    if any(audio):  # train_audio: the sound's part of the loss, in the same units (its own mean, summed in)
        axes.plot(steps, audio, color="tab:green", linewidth=1.5, label="of which the sound's term")
    crepa = [h.get("crepa_loss") for h in history]
    if any(v is not None for v in crepa):  # its own axis: a negative cosine term summed in would hide the flow loss
        twin = axes.twinx()
        twin.plot(steps, crepa, color="tab:blue", linewidth=1.5, label="CREPA term (x crepa_lambda)")
        twin.set_ylabel("CREPA term", color="tab:blue")
        twin.legend(loc="upper center")
    return _image(figure, axes)


def eval_loss_plot(rows: Sequence[Mapping[str, float]]) -> Image.Image:
    """Eval loss per sigma on the held-out clips, base and LoRA on one axis."""
    sigmas = [r["sigma"] for r in rows]
    figure, axes = _figure()
    axes.plot(sigmas, [r["base"] for r in rows], color="tab:blue", marker="o", label="base")
    axes.plot(sigmas, [r["lora"] for r in rows], color="tab:red", marker="o", label="LoRA")
    axes.set(title="eval loss on held-out clips", xlabel="sigma (noise level; timestep = 1000 sigma)",
             ylabel="flow-matching MSE")
    return _image(figure, axes)


def spectrograms(sounds: Mapping[str, Sound]) -> Image.Image:
    """Each labelled sound's spectrogram (power density in dB over time and frequency; windows of SPECTROGRAM_FFT
    samples, 3/4 overlapping), a row each, SPECTROGRAM_ROW_INCHES tall, on one colour scale, so the rows compare."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(PLOT_INCHES[0], SPECTROGRAM_ROW_INCHES * len(sounds)), dpi=PLOT_DPI, layout="constrained")
    rows = figure.subplots(len(sounds), 1, sharex=True, squeeze=False)[:, 0]
    images = []
    for axes, (label, sound) in zip(rows, sounds.items(), strict=True):
        power, _, _, image = axes.specgram(sound.waveform, NFFT=SPECTROGRAM_FFT, Fs=sound.rate,
                                           noverlap=SPECTROGRAM_FFT * 3 // 4, scale="dB", cmap="magma")
        images.append((image, 10 * np.log10(np.maximum(power, 1e-20))))
        axes.set(title=label, ylabel="frequency (kHz)")
        axes.yaxis.set_major_formatter(lambda hz, _: f"{hz / 1000:g}")
    rows[-1].set_xlabel("time (s)")
    top = max(float(db.max()) for _, db in images)  # one scale: 80 dB down from the loudest bin of any row
    for image, _ in images:
        image.set_clim(top - SPECTROGRAM_RANGE_DB, top)
    figure.colorbar(images[0][0], ax=list(rows), label="power density (dB/Hz)")
    return _rendered(figure)


def _figure() -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # a Figure without pyplot: no global state, no GUI backend

    figure = Figure(figsize=PLOT_INCHES, dpi=PLOT_DPI)
    return figure, figure.subplots()


def _image(figure: Any, axes: Any) -> Image.Image:
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return _rendered(figure)


def _rendered(figure: Any) -> Image.Image:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB")
