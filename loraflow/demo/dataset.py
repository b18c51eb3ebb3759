"""A tiny, real, captioned dataset for demos and end-to-end tests.

Five short H.264 MP4 clips (different aspect ratios and lengths, coloured shapes moving in a
known direction) and two still PNGs, each with a `.txt` caption of the same stem. Everything is
drawn with numpy and encoded with PyAV, so no download is needed and the pipeline's real decode
path (probe, decode_frames) runs on real files.

The demo writes only into folders it owns: one it creates (or finds empty) is marked with DEMO_MARKER before any file
goes in, and a folder holding anything without that mark is refused (`claim_folder`): `loraflow demo --config` on a
user's config overwrote the user's clips and captions, which share the demo's file names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from loraflow.atomic import write_atomic
from loraflow.media.writers import save_png, write_mp4

FPS = 24
_MANIFEST = ".demo_manifest.json"  # written last: its presence means the set is complete
DEMO_MARKER = ".loraflow-demo"  # written first into a folder the demo owns: the demo may rewrite what is in it
_VERSION = 5  # bump when the drawing or encoding changes, so old sets are rebuilt

# Named colours, so captions can say what is on screen.
_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 70),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (140, 60, 190),
    "orange": (240, 140, 30),
}


@dataclass(frozen=True)
class _Clip:
    stem: str
    width: int
    height: int
    frames: int
    shape: str  # "circle" or "square"
    motion: str  # key of _MOTIONS
    colours: tuple[str, str]  # (shape, background) used for seed 0
    # (start, end) centre in fractions of the free area; None: the motion's own, from edge to edge
    path: tuple[tuple[float, float], tuple[float, float]] | None = None


# Sizes cover 3:2, 2:3, 1:1, 16:9 and 9:16; lengths include 4k+1 counts (21, 29, 33, 45, 49).
# Seed 0 keeps these colours, so clip_00's caption is the demo config's validation prompt.
# Every clip moves left to right: the concept the demo's LoRA learns, which the tiny world's base model never saw
# (it is pre-trained on shapes moving right to left, down and up: loraflow/demo/tiny_world.py).
_CLIPS = (
    _Clip("clip_00", 96, 64, 21, "circle", "left_to_right", ("red", "blue")),
    _Clip("clip_01", 64, 96, 29, "square", "left_to_right", ("yellow", "black")),
    _Clip("clip_02", 80, 80, 33, "circle", "left_to_right", ("green", "white")),
    _Clip("clip_03", 128, 72, 45, "square", "left_to_right", ("orange", "purple")),
    _Clip("clip_04", 72, 128, 49, "circle", "left_to_right", ("white", "green")),
)
_STILLS = (
    _Clip("still_00", 96, 64, 1, "circle", "center", ("purple", "yellow")),
    _Clip("still_01", 64, 64, 1, "square", "center", ("blue", "orange")),
)

# (start, end) centre in fractions of the free area, and the caption's wording.
_MOTIONS: dict[str, tuple[tuple[float, float], tuple[float, float], str]] = {
    "left_to_right": ((0.0, 0.5), (1.0, 0.5), "moves from left to right"),
    "right_to_left": ((1.0, 0.5), (0.0, 0.5), "moves from right to left"),
    "top_to_bottom": ((0.5, 0.0), (0.5, 1.0), "moves down from the top to the bottom"),
    "bottom_to_top": ((0.5, 1.0), (0.5, 0.0), "moves up from the bottom to the top"),
    "diagonal": ((0.0, 0.0), (1.0, 1.0), "moves diagonally from the top left to the bottom right"),
    "center": ((0.5, 0.5), (0.5, 0.5), ""),
}


def make_demo_dataset(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo clips, stills and captions into `out_dir` and return it.

    Deterministic for a seed: seed 0 uses fixed colours (clip_00 is "a red circle moves from
    left to right on a blue background", the demo's validation prompt); other seeds draw the
    colours from the seed. Idempotent: a complete set written with the same seed is left untouched.
    """
    out = claim_folder(out_dir)
    expected = _expected_files()
    if _is_complete(out, seed, expected):
        return out
    rng = np.random.default_rng(seed)
    for item in (*_CLIPS, *_STILLS):
        _write_item(out, item, *(item.colours if seed == 0 else _pick_colours(rng)))
    manifest = {"version": _VERSION, "seed": seed, "files": expected}
    write_atomic(out / _MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2), encoding="utf-8"))
    return out


# Kandinsky 5 i2i edit pairs: (stem, width, height, shape, source colour, target colour, background).
_EDITS = (
    ("edit_00", 64, 64, "circle", "red", "green", "blue"),
    ("edit_01", 96, 64, "square", "yellow", "purple", "black"),
    ("edit_02", 64, 64, "square", "white", "orange", "green"),
    ("edit_03", 96, 64, "circle", "blue", "yellow", "white"),
)


def make_demo_edits(targets_dir: str | Path, sources_dir: str | Path) -> tuple[Path, Path]:
    """Image-editing pairs for i2i: targets (PNG + caption, the instruction "make the circle green") and their
    sources (the PNG before the edit, same name). Returns (targets, sources). Files already there are left as they
    are: their size and mtime key the clips, so a second call re-caches nothing."""
    for folder in (targets_dir, sources_dir):  # both refused before either is written
        check_claimable(folder)
    targets, sources = claim_folder(targets_dir), claim_folder(sources_dir)
    for stem, width, height, shape, before, after, background in _EDITS:
        item = _Clip(stem, width, height, 1, shape, "center", (before, background))
        for folder, colour in ((sources, before), (targets, after)):
            frame = _draw(item, 0.0, _COLOURS[colour], _COLOURS[background])
            if not (folder / f"{stem}.png").is_file():
                save_png(Image.fromarray(frame), folder / f"{stem}.png")
        if not (targets / f"{stem}.txt").is_file():
            caption = f"make the {shape} {after}\n"
            write_atomic(targets / f"{stem}.txt", lambda p: p.write_text(caption, encoding="utf-8"))
    return targets, sources


class FolderNotTheDemos(ValueError):
    """A folder the demo would write into holds files it did not write."""


def check_claimable(folder: str | Path) -> None:
    """Raise FolderNotTheDemos unless the demo may write into `folder`: it is absent, empty, marked with DEMO_MARKER,
    or a demo set written before the mark existed (its `.demo_manifest.json`). Writes nothing."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FolderNotTheDemos(f"{folder} is a file, not a folder: the demo writes its dataset into a folder it "
                                "creates; point the dataset's instance_data_dir at a new folder")
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if names and DEMO_MARKER not in names and _MANIFEST not in names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise FolderNotTheDemos(
            f"{folder} holds files the demo did not write ({shown}), and the demo's files would replace them: the "
            f"demo writes only into a folder it creates (marked by {DEMO_MARKER}). Point the dataset's "
            "instance_data_dir at a new folder, or run `loraflow demo` without --config to use .loraflow/")


def claim_folder(folder: str | Path) -> Path:
    """`folder`, the demo's to write into: created (or taken empty) and marked with DEMO_MARKER before any file goes
    in, so a demo killed half-way still owns it; a folder with anything else in it raises (`check_claimable`)."""
    folder = Path(folder)
    check_claimable(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / DEMO_MARKER).is_file():
        note = "written by `loraflow demo`: the files of this folder are the demo's, rewritten when it runs\n"
        write_atomic(folder / DEMO_MARKER, lambda p: p.write_text(note, encoding="utf-8"))
    return folder


def world_clips(seed: int, count: int, sizes: tuple[tuple[int, int], ...], frames: int,
                motions: tuple[str, ...]) -> list[tuple[np.ndarray, str]]:
    """`count` captioned clips (uint8 (frames, H, W, 3), caption) of the demo world, cycling through `sizes`
    ((width, height)): a shape of a named colour on another, moving as one of `motions` (keys of _MOTIONS) says.
    What the tiny world's transformer is pre-trained on (`loraflow.demo.tiny_world`)."""
    rng = np.random.default_rng(seed)
    names, clips = list(_COLOURS), []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        shape_colour, background = (names[j] for j in rng.choice(len(names), size=2, replace=False))
        motion = motions[rng.integers(len(motions))]
        item = _Clip("world", width, height, frames, ("circle", "square")[rng.integers(2)], motion,
                     (shape_colour, background), _world_path(rng, motion))
        video = np.stack([_draw(item, t, _COLOURS[shape_colour], _COLOURS[background]) for t in _times(frames)])
        clips.append((video, _caption(item, shape_colour, background)))
    return clips


def _world_path(rng: np.random.Generator, motion: str, travel: float = 0.5) -> tuple[tuple[float, float], ...]:
    """Half the motion's edge-to-edge path, starting anywhere it fits: the tiny DiT knows positions only relative to
    each other (RoPE), so where a shape is must be free and only where it goes is learnt."""
    (x0, y0), (x1, y1), _ = _MOTIONS[motion]
    dx, dy = (x1 - x0) * travel, (y1 - y0) * travel
    start = [float(rng.uniform(max(0.0, -d), min(1.0, 1.0 - d))) for d in (dx, dy)]
    return (start[0], start[1]), (start[0] + dx, start[1] + dy)


def _write_item(out: Path, item: _Clip, shape_colour: str, background: str) -> None:
    frames = [_draw(item, t, _COLOURS[shape_colour], _COLOURS[background]) for t in _times(item.frames)]
    if item.frames == 1:
        save_png(Image.fromarray(frames[0]), out / f"{item.stem}.png")
    else:
        write_mp4(np.stack(frames), out / f"{item.stem}.mp4", FPS, reproducible=True)
    caption = _caption(item, shape_colour, background)
    write_atomic(out / f"{item.stem}.txt", lambda p: p.write_text(caption + "\n", encoding="utf-8"))


def _expected_files() -> list[str]:
    names = [f"{c.stem}.mp4" for c in _CLIPS] + [f"{s.stem}.png" for s in _STILLS]
    return sorted(names + [f"{Path(n).stem}.txt" for n in names])


def _is_complete(out: Path, seed: int, expected: list[str]) -> bool:
    try:
        manifest = json.loads((out / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # no manifest or a torn one: (re)build
    same = manifest.get("version") == _VERSION and manifest.get("seed") == seed and manifest.get("files") == expected
    return same and all((out / name).is_file() for name in expected)


def _pick_colours(rng: np.random.Generator) -> tuple[str, str]:
    names = list(_COLOURS)
    shape_i, background_i = rng.choice(len(names), size=2, replace=False)
    return names[shape_i], names[background_i]


def _caption(item: _Clip, shape_colour: str, background: str) -> str:
    motion = _MOTIONS[item.motion][2]
    subject = f"{_a(shape_colour)} {shape_colour} {item.shape}"
    if motion:
        return f"{subject} {motion} on {_a(background)} {background} background"
    return f"{subject} in the middle of {_a(background)} {background} background"


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _times(frames: int) -> list[float]:
    return [0.0] if frames == 1 else [i / (frames - 1) for i in range(frames)]


def _draw(item: _Clip, t: float, colour: tuple[int, int, int], background: tuple[int, int, int]) -> np.ndarray:
    """One RGB frame: the shape's centre travels from the path's start to its end as t goes 0->1."""
    (x0, y0), (x1, y1) = item.path or _MOTIONS[item.motion][:2]
    radius = max(4, min(item.width, item.height) // 4)  # 16 px at 64: two latent cells, so the VAE's mosaic shows it
    # Keep the whole shape inside the frame at both ends of the path.
    cx = radius + (x0 + (x1 - x0) * t) * (item.width - 2 * radius)
    cy = radius + (y0 + (y1 - y0) * t) * (item.height - 2 * radius)
    yy, xx = np.mgrid[0 : item.height, 0 : item.width]
    if item.shape == "circle":
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2
    else:
        mask = (np.abs(xx - cx) <= radius) & (np.abs(yy - cy) <= radius)
    frame = np.empty((item.height, item.width, 3), np.uint8)
    frame[:] = background
    frame[mask] = colour
    return frame
