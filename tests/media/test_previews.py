"""Pictures for the UI (loraflow/media/previews.py) from known frames: where each frame lands on a contact sheet, its
labels, the animation's frames and timing, the smoothing of the loss plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loraflow.media.previews import (
    GAP,
    MAX_ANIMATION_FRAMES,
    MAX_SHEET_WIDTH,
    PLOT_DPI,
    PLOT_INCHES,
    SHEET_ROW_HEIGHT,
    TEXT_HEIGHT,
    contact_sheet,
    eval_loss_plot,
    loss_plot,
    save_animation,
    smoothed,
)

HEIGHT, WIDTH = 48, 64
TILE = round(WIDTH * SHEET_ROW_HEIGHT / HEIGHT)  # frames enlarged to the row height, aspect kept


def noise(frames: int, seed: int, size: tuple[int, int] = (HEIGHT, WIDTH)) -> np.ndarray:
    """uint8 (F, H, W, 3) noise: every frame, and every row of it, unlike any other."""
    return np.random.default_rng(seed).integers(0, 256, (frames, *size, 3), dtype=np.uint8)


def enlarged(frame: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(frame).resize((TILE, SHEET_ROW_HEIGHT), Image.NEAREST))


def position(sheet: np.ndarray, tile: np.ndarray) -> tuple[int, int]:
    """(x, y) of the one place `tile` sits on `sheet`, pixel for pixel."""
    found = []
    for y in range(sheet.shape[0] - tile.shape[0] + 1):
        x = sheet[y].tobytes().find(tile[0].tobytes())
        if x >= 0 and x % 3 == 0 and np.array_equal(sheet[y:y + tile.shape[0], x // 3:x // 3 + tile.shape[1]], tile):
            found.append((x // 3, y))
    assert len(found) == 1, found
    return found[0]


def test_a_contact_sheet_wraps_each_video_to_fit_the_dialog_under_its_label() -> None:
    videos = {"base": noise(9, 0), "LoRA": noise(9, 1)}
    sheet = np.asarray(contact_sheet(videos, title="validation: a red circle"))
    assert sheet.shape[1] <= MAX_SHEET_WIDTH < 8 * (TILE + GAP)  # eight frames in one line would not fit
    picks = [0, 1, 2, 3, 5, 6, 7, 8]  # 8 of 9 frames, spread over the video
    spots = {label: [position(sheet, enlarged(video[i])) for i in picks] for label, video in videos.items()}
    left, top = spots["base"][0]
    assert top == TEXT_HEIGHT and 0 < left  # the title above, the label left of the frames
    per_line = sum(y == top for _, y in spots["base"])
    assert 1 < per_line < 8 and sheet.shape[1] == left + per_line * (TILE + GAP) - GAP
    for label, spot in spots.items():  # row by row, left to right, the same grid for both videos
        first = spot[0][1]
        assert spot == [(left + (i % per_line) * (TILE + GAP), first + (i // per_line) * (SHEET_ROW_HEIGHT + GAP))
                        for i in range(8)], label
    assert spots["LoRA"][0][1] > spots["base"][-1][1] + SHEET_ROW_HEIGHT  # LoRA's block below base's
    # the labels: text left of each block's first line, drawn from the keys (swap them, and the pixels swap)
    labels = {k: sheet[y:y + SHEET_ROW_HEIGHT, :left] for k, ((_, y), *_) in spots.items()}
    assert all((lab < 128).any() for lab in labels.values()) and not np.array_equal(labels["base"], labels["LoRA"])
    swapped = np.asarray(contact_sheet({"LoRA": videos["base"], "base": videos["LoRA"]}, title="validation: a"))
    assert np.array_equal(swapped[top:top + SHEET_ROW_HEIGHT, :left], labels["LoRA"])
    assert (sheet[:TEXT_HEIGHT] < 128).any()  # the title is written


def test_one_frame_a_line_when_the_frames_are_wider_than_the_sheet() -> None:
    wide = noise(3, 2, size=(8, 8 * MAX_SHEET_WIDTH // SHEET_ROW_HEIGHT))  # one tile as wide as the sheet
    sheet = contact_sheet({"x": wide})
    assert sheet.height == 3 * (SHEET_ROW_HEIGHT + GAP) - GAP  # no title: three lines of one frame


def test_the_animation_plays_base_and_lora_side_by_side_at_the_video_fps(tmp_path: Path) -> None:
    videos = {"base": noise(9, 0), "LoRA": noise(9, 1)}
    save_animation(videos, 24.0, tmp_path / "a.webp")
    with Image.open(tmp_path / "a.webp") as animation:
        assert animation.format == "WEBP" and animation.n_frames == 9
        assert animation.size == (2 * TILE + GAP, TEXT_HEIGHT + SHEET_ROW_HEIGHT)
        assert animation.info["loop"] == 0
        shown, durations = [], []
        for i in range(9):
            animation.seek(i)
            shown.append(np.asarray(animation.convert("RGB"), dtype=np.int32)[TEXT_HEIGHT:])
            durations.append(animation.info["duration"])  # known once the frame is decoded
    assert durations == [round(1000 / 24)] * 9
    # lossy WebP: each frame is nearer its own source frame than any other (noise frames are far apart)
    sources = [np.concatenate([enlarged(videos["base"][i]), np.full((SHEET_ROW_HEIGHT, GAP, 3), 255, np.uint8),
                               enlarged(videos["LoRA"][i])], axis=1).astype(np.int32) for i in range(9)]
    nearest = [int(np.argmin([np.abs(frame - s).mean() for s in sources])) for frame in shown]
    assert nearest == list(range(9))


def test_a_long_video_animates_fewer_frames_over_the_same_duration(tmp_path: Path) -> None:
    save_animation({"base": noise(121, 3, size=(8, 8))}, 24.0, tmp_path / "long.webp")
    with Image.open(tmp_path / "long.webp") as animation:
        assert animation.n_frames == MAX_ANIMATION_FRAMES
        animation.load()
        assert animation.info["duration"] == round(1000 * 121 / 24 / MAX_ANIMATION_FRAMES)  # 5.04 s in all


def test_smoothing_is_a_debiased_exponential_average() -> None:
    values = [float(v) for v in np.random.default_rng(4).normal(1.0, 0.2, 30)]
    assert smoothed(values, 1) == values
    beta = 1 - 1 / 5
    naive = [sum(beta ** (t - i) * v for i, v in enumerate(values[:t + 1])) / sum(beta ** (t - i) for i in range(t + 1))
             for t in range(len(values))]
    assert smoothed(values, 5) == pytest.approx(naive, rel=1e-12)  # 30 terms of O(1): rounding ~30 ulp


def test_the_plots_are_matplotlib_figures_of_the_data() -> None:
    history = [{"step": s, "loss": 1.5 - 0.01 * s} for s in range(1, 21)]
    plot = loss_plot(history)
    assert plot.size == (PLOT_INCHES[0] * PLOT_DPI, PLOT_INCHES[1] * PLOT_DPI)
    rising = [{**h, "loss": 1 + 0.01 * h["step"]} for h in history]
    assert not np.array_equal(np.asarray(plot), np.asarray(loss_plot(rising)))
    silent = [{**h, "audio_loss": 0.0} for h in history]  # a run with sound draws its audio term (train_audio)
    assert np.array_equal(np.asarray(plot), np.asarray(loss_plot(silent)))
    assert not np.array_equal(np.asarray(plot), np.asarray(loss_plot([{**h, "audio_loss": 0.3} for h in history])))
    rows = [{"sigma": s / 10, "base": 2.5, "lora": 2.4} for s in range(1, 10)]
    assert eval_loss_plot(rows).size == plot.size
