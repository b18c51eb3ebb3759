"""Which teacher features a clip has, and how training finds and reads them: the contract between the
teacher_features stage (stages/teacher/, which computes them) and CREPA inside training. A row's key covers the clip,
the teacher's fingerprint, the image size, the frames and CODE_VERSION.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import ClipRow, read_clips
from loraflow.contracts.latent_rows import read_latent_rows
from loraflow.keys import content_key, data_version, directory_fingerprint
from loraflow.store import Store

if TYPE_CHECKING:  # annotations only: contracts stay free of torch at import
    import torch

    from loraflow.pipelines.base import ModelFamily

CODE_VERSION = "teacher-features-1"
STAGE = "teacher_features"


@dataclass(frozen=True)
class Teacher:
    """Which teacher, at which size: `path` is a local folder written by transformers' save_pretrained (DINOv2)."""

    path: str
    image_size: int


def teacher_fingerprint(teacher: Teacher) -> str:
    if not (Path(teacher.path) / "config.json").is_file():
        raise FileNotFoundError(f"crepa_encoder_path {teacher.path}: not a transformers model folder (no "
                                "config.json); save the encoder there with `save_pretrained` (nothing is downloaded)")
    return content_key(files=directory_fingerprint(teacher.path))


def latent_frame_indices(num_frames: int, temporal_factor: int) -> list[int]:
    """The stored frame each latent frame's features come from: frame t * factor, the last of the frames the causal
    video VAE folds into latent frame t (frame 0 alone is latent frame 0)."""
    if (num_frames - 1) % temporal_factor:
        raise ValueError(f"a clip of {num_frames} frames is not 1 + {temporal_factor} k frames")
    return list(range(0, num_frames, temporal_factor))


def teacher_rows(clips: list[ClipRow], teacher: Teacher, temporal_factor: int) -> list[dict[str, Any]]:
    """One row per clip with the key its features have."""
    fingerprint = teacher_fingerprint(teacher)
    rows = []
    for clip in clips:
        indices = latent_frame_indices(clip.num_frames, temporal_factor)
        key = content_key(clip=clip.key, teacher=fingerprint, image_size=teacher.image_size, frames=indices,
                          code=CODE_VERSION)
        rows.append({"key": key, "clip_key": clip.key, "dataset": clip.dataset, "indices": indices})
    return rows


def teacher_of(config: LoraflowConfig) -> Teacher:
    return Teacher(str(config.crepa_encoder_path), config.crepa_encoder_image_size)


def trained_clips(store: Store) -> list[ClipRow]:
    """The clips that have latents (the only ones training reads)."""
    encoded = {row.clip_key for row in read_latent_rows(store)}
    return [clip for clip in read_clips(store) if clip.key in encoded]


def teacher_keys(config: LoraflowConfig, family: ModelFamily, store: Store) -> dict[str, str]:
    """latent key -> the key of its clip's teacher features."""
    rows = teacher_rows(trained_clips(store), teacher_of(config), family.vae_temporal_factor)
    by_clip = {row["clip_key"]: row["key"] for row in rows}
    return {row.key: by_clip[row.clip_key] for row in read_latent_rows(store) if row.clip_key in by_clip}


def teacher_version(config: LoraflowConfig, family: ModelFamily, store: Store) -> str:
    """The data version of the features a run reads: part of its key (new teacher weights, new run)."""
    return data_version(teacher_keys(config, family, store).values())


def load_teacher_batch(store: Any, keys: list[str]) -> torch.Tensor:
    """(B, T, g * g, E) float32 features of a batch, in sample order (`store`: a Store or a RowCache)."""
    import torch  # here, not at the top: contracts stay free of torch at import

    rows = store.get(STAGE, set(keys))
    return torch.stack([torch.from_numpy(rows[k]["features"].astype("float32")) for k in keys])
