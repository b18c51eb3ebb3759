"""What a config would cache, before any model loads: buckets, dropped files, and the bytes they will take.

`loraflow check` prints this; the latents asset check uses `LatentGeometry` for the shape every latent must
have. Planning reuses the clips stage's own functions (list_folder, read_captions, probe, plan_clips), so
the plan is what the clips stage will do, not a second opinion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from tqdm import tqdm

from loraflow.config import LoraflowConfig
from loraflow.ops.buckets import bucket_label

if TYPE_CHECKING:  # the family protocol module imports torch; planning must stay light
    from loraflow.pipelines.base import ModelFamily

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


def latent_geometry(model_path: str | Path, family: ModelFamily) -> LatentGeometry:
    """Read the VAE's factors from its config.json (no weights): the family gives the temporal factor.

    Video VAEs name `spatial_compression_ratio`; image VAEs (AutoencoderKL) downsample once per block after
    the first, which is how every diffusers pipeline computes its `vae_scale_factor`.
    """
    path = Path(model_path) / "vae" / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no VAE config at {path}: `pretrained_model_name_or_path` must hold a vae/ folder")
    vae = json.loads(path.read_text())
    spatial = vae.get("spatial_compression_ratio") or 2 ** (len(vae["block_out_channels"]) - 1)
    return LatentGeometry(channels=int(vae["latent_channels"]), temporal=family.vae_temporal_factor, spatial=int(spatial))


@dataclass
class BucketRow:
    dataset: str
    bucket: str
    clips: int = 0
    frames_bytes: int = 0  # uint8 RGB frames the clips stage stores
    latent_bytes: int | None = 0  # None when the VAE config is not readable


@dataclass
class BucketPlan:
    buckets: list[BucketRow] = field(default_factory=list)
    dropped: list[dict[str, str]] = field(default_factory=list)  # {dataset, file, reason, detail}
    problems: list[str] = field(default_factory=list)  # datasets that cannot be planned at all


def plan_buckets(config: LoraflowConfig, family: ModelFamily, geometry: LatentGeometry | None,
                 progress: bool = True) -> BucketPlan:
    """Probe every source file (metadata and one frame, no full decode) and plan its clips."""
    from loraflow.ops.clips import check_name, dropped, find_source_image, plan_clips, read_captions
    from loraflow.ops.dataset_folder import list_folder
    from loraflow.ops.media import MediaError, probe

    plan = BucketPlan()
    clips_seen: list[tuple[str, int, int, int]] = []
    for dataset in config.training_datasets:
        try:
            listing = list_folder(dataset)
        except FileNotFoundError as exc:
            plan.problems.append(str(exc))
            continue
        files = listing.files
        plan.dropped += [dropped(dataset.id, path, exc) for path, exc in listing.others]
        if not files:
            plan.problems.append(f"dataset '{dataset.id}': no video/image files under {dataset.instance_data_dir}")
        sources = config.source_images(dataset)
        for path in tqdm(files, desc=f"probe {dataset.id}", unit="file", disable=not progress or not files):
            try:
                read_captions(check_name(path), dataset)
                if sources is not None:  # i2i: a target without its source image is dropped by clips too
                    probe(check_name(find_source_image(path, dataset, sources)))
                clips = plan_clips(path, probe(path), dataset, family, config.pretrained_model_name_or_path,
                                   dataset.id == config.render_dataset_id)
            except MediaError as exc:
                plan.dropped.append(dropped(dataset.id, path, exc))
                continue
            clips_seen += [(dataset.id, c["height"], c["width"], len(c["indices"])) for c in clips]
    plan.buckets = tally_buckets(clips_seen, geometry)
    return plan


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


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
