"""Pure clip planning: which source frames a clip keeps, and the size (bucket) it is cropped to.

No I/O here but `latent_geometry` (one VAE config.json), so the rules are property-tested on their own
(tests/stages/test_buckets.py). The latent geometry and bucket tally sit here, below the clips stage and `loraflow
check`'s plan (bucket_plan.py), which both use them.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loraflow.contracts.reports import BucketRow
from loraflow.pipelines import nearest_multiple
from loraflow.pipelines.sources import ModelSource, as_source

if TYPE_CHECKING:  # planning asks the plain protocol (`FamilyPlanning`): no torch
    from loraflow.pipelines import FamilyPlanning

# Sources at most 5% faster than the target fps are taken 1:1, not resampled: 25 -> 24 fps would drop every 25th
# frame (a judder each second, and a 49-frame clip becomes 47, too short for 49), while playing 25 fps footage 4%
# slower is what film-to-PAL transfer has always done unnoticed. 29.97/30 and 59.94/60 fall well inside.
FPS_TOLERANCE = 1.05


class TooShort(ValueError):
    """The video has fewer usable frames than the clip needs."""


def resampled_indices(num_frames: int, source_fps: float, target_fps: float | None,
                      frame_times: Sequence[float] = ()) -> list[int]:
    """Source frame indices of the timeline resampled down to target_fps (never up: no invented frames).

    `frame_times` (a VFR source's frame times in seconds): each step of 1/target_fps takes the frame nearest in
    time, so a phone clip that drops from 30 to 15 fps in the dark keeps its real speed in both halves (frame
    numbers would skip a third of the slow half's frames). A stretch slower than target_fps keeps each of its
    frames once, as a slow CFR source does.
    """
    if not target_fps or source_fps <= target_fps * FPS_TOLERANCE:
        return list(range(num_frames))
    if len(frame_times) == num_frames > 1:
        times = np.asarray(frame_times, np.float64)
        wanted = np.arange(int(times[-1] * target_fps + 1e-6) + 1) / target_fps
        after = np.clip(np.searchsorted(times, wanted), 1, num_frames - 1)
        nearer_before = wanted - times[after - 1] <= times[after] - wanted
        return np.unique(after - nearer_before).tolist()  # nondecreasing: unique keeps the order
    step = source_fps / target_fps
    count = int((num_frames - 1) / step) + 1
    return [min(num_frames - 1, round(i * step)) for i in range(count)]


def resampling_note(num_frames: int, source_fps: float, target_fps: float | None, kept: int) -> str:
    """How a video's frame count became `kept`, for every rate-related drop: both rates and both counts."""
    source = f"{num_frames} frames at {source_fps:g} fps"
    if not target_fps:
        return f"{source} (no target fps: every frame)"
    if source_fps > target_fps * FPS_TOLERANCE:
        return f"{source} resampled to {kept} frames at {target_fps:g} fps"
    why = f"within {FPS_TOLERANCE - 1:.0%} of" if source_fps > target_fps else "not faster than"
    return f"{source}, {why} the {target_fps:g} fps target: {kept} frames taken 1:1"


def source_edge(height: int, width: int, resolution_type: str) -> float:
    """A source's size in `resolution`'s unit: pixel = the shorter side, area = the side of a square of its area."""
    return float(min(height, width)) if resolution_type == "pixel" else math.sqrt(height * width)


def round_down_4k1(frames: int) -> int:
    """Largest 4k+1 <= frames (49 stays 49; 48 becomes 45)."""
    return (frames - 1) // 4 * 4 + 1


def clip_starts(available: int, clip_frames: int, mode: str, stride: int = 1, samples: int = 1) -> list[int]:
    """Start positions (on the resampled timeline) of the clips a video yields."""
    if available < clip_frames:
        raise TooShort(f"{available} frames available, {clip_frames} needed")
    last = available - clip_frames
    if mode == "head":
        return [0]
    if mode == "chunk":
        return list(range(0, last + 1, clip_frames))
    if mode == "slide":
        return list(range(0, last + 1, stride))
    if mode == "uniform":
        if samples == 1:
            return [0]
        return sorted({round(i * last / (samples - 1)) for i in range(samples)})
    raise ValueError(f"frame_extraction {mode!r} is not known; allowed: head, chunk, slide, uniform, full")


def select_clips(
    timeline: list[int], num_frames: int, mode: str, max_frames: int | None, stride: int = 1, samples: int = 1
) -> list[list[int]]:
    """Source-frame index lists, one per clip. `full` keeps the whole video rounded down to 4k+1."""
    if mode == "full":
        usable = min(len(timeline), max_frames or len(timeline))
        return [timeline[: round_down_4k1(usable)]]
    return [timeline[s : s + num_frames] for s in clip_starts(len(timeline), num_frames, mode, stride, samples)]


def scene_timelines(timeline: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    """The resampled timeline split at the scene cuts (each the first source frame of a new scene, sorted): one list
    a scene, in order, with the timeline's frames of that scene (a scene with none of them: an empty list), so a
    clip chosen inside one list never spans a cut."""
    scenes: list[list[int]] = [[] for _ in range(len(cuts) + 1)]
    for frame in timeline:
        scenes[bisect.bisect_right(cuts, frame)].append(frame)
    return scenes


def frames_for_bucket(frames: int, frame_interval: int | None) -> int:
    """resolution_frames: round a clip's frame count down to the interval, keeping 4k+1."""
    if not frame_interval or frames <= frame_interval:
        return frames
    return round_down_4k1(frames // frame_interval * frame_interval + 1)


def bucket_label(height: int, width: int, num_frames: int) -> str:
    """A bucket's name, WIDTHxHEIGHT@FRAMES: the size the latents stage encodes (the one function for it)."""
    return f"{width}x{height}@{num_frames}"


def bucket_size(
    height: int,
    width: int,
    resolution: int,
    multiple: int,
    resolution_type: str = "pixel",
    crop_aspect: str = "preserve",
    aspect_buckets: Sequence[float] = (),
) -> tuple[int, int]:
    """(height, width) of a source's bucket, both sides multiples of `multiple`.

    The aspect (width/height) is the source's (`preserve`), 1 (`square`) or the nearest of `aspect_buckets` in
    log scale (`closest`: 2:1 and 1:2 are equally far from 1:1). `pixel` makes the shorter side `resolution`;
    `area` (alias `pixel_area`) keeps resolution**2 pixels.
    """
    if resolution_type == "pixel" and crop_aspect == "preserve":
        # The original rule, kept operation for operation so existing clip keys (which hold the size) stay valid.
        scale = resolution / min(height, width)
        return nearest_multiple(height * scale, multiple), nearest_multiple(width * scale, multiple)
    aspect = target_aspect(width / height, crop_aspect, aspect_buckets)
    if resolution_type == "pixel":
        h, w = (resolution, resolution * aspect) if aspect >= 1 else (resolution / aspect, resolution)
    elif resolution_type in ("area", "pixel_area"):
        h = resolution / math.sqrt(aspect)
        w = h * aspect
    else:
        raise ValueError(f"resolution_type {resolution_type!r} is not known; allowed: pixel, area")
    return nearest_multiple(h, multiple), nearest_multiple(w, multiple)


def target_aspect(source_aspect: float, crop_aspect: str, aspect_buckets: Sequence[float] = ()) -> float:
    """The width/height ratio a bucket gets for a source of `source_aspect`."""
    if crop_aspect == "preserve":
        return source_aspect
    if crop_aspect == "square":
        return 1.0
    if crop_aspect == "closest":
        if not aspect_buckets:
            raise ValueError("crop_aspect closest needs crop_aspect_buckets (width/height ratios)")
        # Ties go to the first listed ratio, so the choice never depends on float noise in the order.
        return min(aspect_buckets, key=lambda a: abs(math.log(a / source_aspect)))
    raise ValueError(f"crop_aspect {crop_aspect!r} is not known; allowed: preserve, square, closest")


@dataclass(frozen=True)
class CropPlan:
    resize: tuple[int, int]  # (height, width) the decoder resizes to
    box: tuple[int, int, int, int]  # (top, left, height, width) cut from the resized frames


def crop_plan(source: tuple[int, int], target: tuple[int, int], style: str, seed: str = "") -> CropPlan:
    """Resize so the target fits inside (cover), then cut the target box; `none` stretches instead."""
    (sh, sw), (th, tw) = source, target
    if style == "none":
        return CropPlan((th, tw), (0, 0, th, tw))
    scale = max(th / sh, tw / sw)
    rh, rw = max(th, round(sh * scale)), max(tw, round(sw * scale))
    if style == "center":
        top, left = (rh - th) // 2, (rw - tw) // 2
    elif style == "random":  # seeded by the clip, so the same clip always gets the same crop
        rng = random.Random(seed)
        top, left = rng.randint(0, rh - th), rng.randint(0, rw - tw)
    else:
        raise ValueError(f"crop_style {style!r} is not known; allowed: center, random, none")
    return CropPlan((rh, rw), (top, left, th, tw))


# What a bucket's latents take: the clips stage's table and `loraflow check`'s plan ----------------------------
LATENT_BYTES = 4  # latents are cached as float32


@dataclass(frozen=True)
class LatentGeometry:
    """How the checkpoint's VAE maps a (F, H, W) clip to a (C, T, h, w) latent."""

    channels: int
    temporal: int
    spatial: int

    def shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        # Causal video VAEs keep the first frame and compress the rest: F = 4k+1 -> k+1 latent frames.
        return (self.channels, (num_frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)

    def nbytes(self, num_frames: int, height: int, width: int) -> int:
        c, t, h, w = self.shape(num_frames, height, width)
        return c * t * h * w * LATENT_BYTES


def latent_geometry(model: ModelSource | str | Path, family: FamilyPlanning) -> LatentGeometry:
    """Read the VAE's factors from its config.json (no weights): the family gives the temporal factor.

    Video VAEs name `spatial_compression_ratio`; image VAEs (AutoencoderKL) downsample once per block after
    the first, which is how every diffusers pipeline computes its `vae_scale_factor`.
    """
    path = as_source(model).folder("vae") / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no VAE config at {path}: `pretrained_model_name_or_path` must hold a vae/ folder "
                                "(or `vae_path` name one)")
    return vae_geometry(json.loads(path.read_text()), family)


def vae_geometry(vae: dict, family: FamilyPlanning) -> LatentGeometry:
    """`latent_geometry` of a VAE config dict."""
    spatial = vae.get("spatial_compression_ratio") or 2 ** (len(vae["block_out_channels"]) - 1)
    return LatentGeometry(
        channels=int(vae["latent_channels"]), temporal=family.vae_temporal_factor, spatial=int(spatial)
    )


def tally_buckets(clips: list[tuple[str, int, int, int]], geometry: LatentGeometry | None) -> list[BucketRow]:
    """Bucket rows from (dataset, height, width, num_frames) per clip: the plan here and the clips stage's table."""
    rows: dict[tuple[str, str], BucketRow] = {}
    for dataset, height, width, frames in clips:
        label = bucket_label(height, width, frames)
        row = rows.setdefault((dataset, label), BucketRow(dataset, label))
        row.clips += 1
        row.frames_bytes += frames * height * width * 3
        row.latent_bytes = None if geometry is None else row.latent_bytes + geometry.nbytes(frames, height, width)
    return sorted(rows.values(), key=lambda r: (r.dataset, r.bucket))
