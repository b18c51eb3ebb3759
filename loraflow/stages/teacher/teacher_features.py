"""The teacher_features stage: CREPA's frozen image-encoder (DINOv2) patch features of every clip, cached.

SimpleTuner decodes each batch's latents with the VAE and runs the teacher at every training step. The features of a
clip never change, so here they are a content-addressed stage like `latents`: keyed by the clip, the teacher's
fingerprint (its folder's config and weight files), the image size and the frames, computed once from the frames the
clips stage stored (the frames the latents were encoded from), and read by training with no VAE decode and no teacher
in memory.

One row per clip:
    key        hash of clip key, teacher fingerprint, image size, frame indices, code version
    clip_key   the clip's key in the clips stage
    features   float16 (T, g * g, E): for each latent frame t, the teacher's final-layer-norm patch tokens of stored
               frame t * temporal factor (`latent_frame_indices`), on a g x g grid (g = image size / patch size).
               float16 keeps 11 significant bits, plenty for a cosine target, at half the bytes (this is the largest
               cache: a ViT-g at 518 px is 1369 x 1536 values per frame).
Frames go to the teacher as SimpleTuner's do: RGB in [0, 1], resized to image_size x image_size (bilinear, with
antialiasing), normalised with ImageNet's mean and std.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import ClipRow
from loraflow.contracts.reports import TeacherFeaturesReport
from loraflow.contracts.teacher_features import (
    STAGE,
    Teacher,
    teacher_fingerprint,
    teacher_of,
    teacher_rows,
    trained_clips,
)
from loraflow.kernels.devices import free_models, pick_device
from loraflow.keys import data_version
from loraflow.pipelines.base import ModelFamily, non_finite, non_finite_detail
from loraflow.store import Store

log = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FRAMES_PER_BATCH = 16  # frames through the teacher at once: bounds its activations, not its results


def encode_teacher_features(clips: list[ClipRow], teacher: Teacher, temporal_factor: int, store: Store,
                            datasets: list[str]) -> TeacherFeaturesReport:
    """Compute the features the store lacks, one shard per clip; write one manifest part per dataset id."""
    rows = teacher_rows(clips, teacher, temporal_factor)
    have = store.keys(STAGE)
    todo = [r for r in rows if r["key"] not in have]
    if todo:
        device = pick_device()
        model = load_teacher(teacher, device)
        refused = []
        for row in todo:
            stored = store.get("clips", [row["clip_key"]])[row["clip_key"]]
            frames = torch.from_numpy(np.array(stored["frames"])[row["indices"]])  # (T, H, W, 3) uint8, a copy
            features = patch_features(model, frames.to(device), teacher.image_size).cpu()
            bad = non_finite({"features": features, "features as stored (float16)": features.half()})
            if bad:  # never stored: CREPA would train toward NaN
                refused.append(non_finite_detail(f"clip {row['clip_key']} (dataset {row['dataset']})", "teacher",
                                                 features.dtype, bad))
                continue
            store.put(STAGE, [{"key": row["key"], "clip_key": row["clip_key"], "features": features.half().numpy()}])
        free_models(model)
        if refused:  # every trained clip needs its features: the stage fails, the others stay cached
            raise ValueError(f"{len(refused)} clip(s) have no usable CREPA teacher features (float16 holds up to "
                             f"65504); use another crepa_encoder_path or turn crepa_enabled off: {'; '.join(refused)}")
    listed = [{"key": r["key"], "clip_key": r["clip_key"], "dataset": r["dataset"]} for r in rows]
    for dataset in datasets:
        store.write_manifest(STAGE, [r for r in listed if r["dataset"] == dataset], part=dataset)
    return TeacherFeaturesReport(data_version=data_version(r["key"] for r in rows), computed=len(todo),
                                 reused=len(rows) - len(todo), teacher=str(teacher.path), image_size=teacher.image_size)


def load_teacher(teacher: Teacher, device: torch.device) -> torch.nn.Module:
    """The encoder in fp32, frozen, from the local folder only."""
    from transformers import AutoModel

    teacher_fingerprint(teacher)  # a clear error for a folder that is not a model
    model = AutoModel.from_pretrained(teacher.path, local_files_only=True, torch_dtype=torch.float32)
    patch = model.config.patch_size
    if teacher.image_size % patch:
        low = teacher.image_size // patch * patch
        raise ValueError(f"crepa_encoder_image_size {teacher.image_size} is not a multiple of the encoder's patch "
                         f"size {patch}; use {low or patch} or {low + patch}")
    return model.to(device).eval().requires_grad_(False)


@torch.no_grad()
def patch_features(model: torch.nn.Module, frames: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 frames (N, H, W, 3) -> float32 (N, g * g, E), the final layer norm's patch tokens (DINOv2's
    `x_norm_patchtokens`: transformers' last_hidden_state without the class and register tokens)."""
    patches = (image_size // model.config.patch_size) ** 2
    out = []
    for batch in frames.split(FRAMES_PER_BATCH):
        pixels = batch.permute(0, 3, 1, 2).float() / 255  # (n, 3, H, W)
        pixels = torch.nn.functional.interpolate(pixels, size=(image_size, image_size), mode="bilinear",
                                                 align_corners=False, antialias=True)
        mean, std = (torch.tensor(v, device=pixels.device).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        out.append(model(pixel_values=(pixels - mean) / std).last_hidden_state[:, -patches:].float())
    return torch.cat(out)


def cache_teacher_features(config: LoraflowConfig, family: ModelFamily, store: Store) -> TeacherFeaturesReport:
    """The teacher_features stage for every clip training reads (computes only what the store lacks)."""
    store = store.named(config.manifest_names)  # its manifests named by what they are made from, whoever opened it
    datasets = [d.id for d in config.training_datasets]
    return encode_teacher_features(trained_clips(store), teacher_of(config), family.vae_temporal_factor, store,
                                   datasets)
