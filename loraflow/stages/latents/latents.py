"""The latents stage: VAE-encode the stored frames of every clip the store lacks.

The VAE is the only model loaded here, with (HunyuanVideo 1.5 i2v) the family's image encoder beside it, which caches
each clip's first-frame condition in the latent row (`image_latent`, `image_embeds`); Kandinsky 5 i2i caches its
source image's latent there (`image_latent`); a clip with a loss mask caches it on the latent grid (`loss_mask`,
contracts/masks.py). Text encoders live in another stage and load only after this one freed its models, so with
`offload_during_startup` they never share the accelerator with the VAE.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from itertools import groupby
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from loraflow.config import LoraflowConfig, select_datasets
from loraflow.contracts.clip_rows import read_clips
from loraflow.contracts.latent_rows import LatentRow, latent_columns
from loraflow.contracts.masks import MASK_COLUMN, latent_key_part, latent_mask
from loraflow.contracts.reports import BadLatent, LatentsReport, OomFallback
from loraflow.kernels.devices import free_models, peak_memory_gib, pick_device
from loraflow.kernels.patch_conv import enable_patch_conv
from loraflow.keys import Shard, content_key, data_version
from loraflow.pipelines.base import ModelFamily, component_fingerprint, load_component, non_finite, non_finite_detail
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "latents-1"
SHARD_CLIPS = 8


@dataclass(frozen=True)
class PlannedLatent:
    """A current clip's latent as the stage plans it: `key`, and `tiled_key`, the key its latent has when an
    out-of-memory encode falls back to tiling."""

    key: str
    tiled_key: str
    clip_key: str
    bucket: str
    dataset: str
    source: str  # the clip's file, dataset-relative
    frames: str  # its first and last source frame, "0-24"

    def listed(self, tiled: bool) -> LatentRow:
        """Its manifest row. An out-of-memory encode that fell back to tiling was stored under the tiled key and is
        listed as approximate; the next run tries the exact encode again (its key is still missing)."""
        return LatentRow(key=self.tiled_key if tiled else self.key, clip_key=self.clip_key, bucket=self.bucket,
                         dataset=self.dataset, approximate=tiled)


def latent_rows(config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store,
                datasets: list[str] | None = None) -> list[PlannedLatent]:
    """One row per current clip of the datasets (None: every training dataset) with the key its latent has.
    Patch conv is exact, so it is not in the key; tiling blends seams and changes the numbers, so it is; so
    does the sampling (a mode row and a distribution row of one clip never share a key), and for i2v flavours
    the first-frame image latent (see `_with_image_latent`) or image condition (the family's `image_condition`).
    `tiled_key` is the key of the clip's latent when an out-of-memory encode falls back to tiling."""
    vae_id = component_fingerprint(model, "vae")
    given = family.flavour.conditioning_frames
    image = {"image_frames": given} if given else {}  # t2v keys stay what they were
    if family.flavour.last_frame_given:  # its own key: a first-frame-only cache is encoded again, never reused
        image["last_frame"] = True
    parts = family.image_condition_components
    if parts:  # the models that compute the image condition name it (HV1.5 i2v: SigLIP)
        image["image_condition"] = {c: component_fingerprint(model, c) for c in parts}
    elif family.image_condition_name:  # the VAE alone computes it (K5 i2i: from the source, which the clip key names)
        image["image_condition"] = family.image_condition_name
    ids = {d.id for d in select_datasets(config, datasets)}
    clips = read_clips(store, parts=datasets)
    key = lambda clip, tiling: content_key(  # noqa: E731
        clip=clip.key, vae=vae_id, dtype="float32", sampling=config.latent_sampling, tiling=tiling,
        code=CODE_VERSION, **image, **latent_key_part(clip))
    return [
        PlannedLatent(key=key(clip, config.vae_enable_tiling), tiled_key=key(clip, True), clip_key=clip.key,
                      bucket=clip.bucket, dataset=clip.dataset, source=clip.source,
                      frames=f"{clip.indices[0]}-{clip.indices[-1]}")
        for clip in clips
        if clip.dataset in ids  # a dataset no longer in the config is never encoded or listed
    ]


def prepare_vae(vae: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> None:
    """The VAE as the family runs it (`setup_vae`), with the configured memory features (also applied by
    `loraflow.estimates` to its fake VAE)."""
    family.setup_vae(vae)
    if config.vae_enable_patch_conv:
        enable_patch_conv(vae)
    if config.vae_enable_tiling:
        vae.enable_tiling()
    if config.vae_enable_slicing:
        vae.enable_slicing()


def encode_latents(
    config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store, shard_clips: int = SHARD_CLIPS,
    datasets: list[str] | None = None, shard: Shard | None = None,
) -> LatentsReport:
    """Encode the datasets' clips (None: every training dataset) the store lacks; write each one's manifest part.
    With a `shard`, only that shard's clips, and no manifest: one of N workers (stages/shard_worker.py)."""
    store = store.named(config.manifest_names)  # its manifests named by what they are made from, whoever opened it
    planned = [r for r in latent_rows(config, family, model, store, datasets)
               if shard is None or shard.owns(r.clip_key)]
    have = store.keys("latents")
    todo = sorted((r for r in planned if r.key not in have), key=lambda r: r.bucket)
    quarantined: list[BadLatent] = []
    fallbacks: list[OomFallback] = []
    device = pick_device()
    if todo:
        vae = load_component(model, "vae", torch.float32, str(device))
        prepare_vae(vae, config, family)
        image = [load_component(model, c, torch.float32, str(device))
                 for c in family.image_condition_components]  # [] or (image encoder, its processor)
        quarantined, fallbacks = _encode(todo, vae, family, store, device, shard_clips, config.latent_sampling, image,
                                         have)
        free_models(vae, *image)
    bad = {q.key for q in quarantined}
    tiled = {f.key for f in fallbacks if f.fallback == "tiling"}
    rows = [r.listed(r.key in tiled) for r in planned if r.key not in bad]
    for dataset in select_datasets(config, datasets) if shard is None else []:  # one part per dataset
        store.write_manifest("latents", [r.to_row() for r in rows if r.dataset == dataset.id], part=dataset.id)
        # this run's failures (a failed clip is retried by every run): the coverage check leaves them out
        store.write_manifest("latents_quarantine", [asdict(q) for q in quarantined if q.dataset == dataset.id],
                             part=dataset.id)
    return LatentsReport(
        data_version=data_version(r.key for r in rows),
        computed=len(todo) - len(bad),
        reused=len(rows) - (len(todo) - len(bad)),
        quarantined=tuple(quarantined),
        oom_fallbacks=tuple(fallbacks),
        device=str(device),
        peak_gib=round(peak_memory_gib(device), 3),
    )


@torch.no_grad()
def _encode(
    todo: list[PlannedLatent], vae: torch.nn.Module, family: ModelFamily, store: Store, device: torch.device,
    shard_clips: int, sampling: str, image: list[Any], have: set[str],
) -> tuple[list[BadLatent], list[OomFallback]]:
    """Encode clip by clip; commit a shard every `shard_clips` so a killed run loses at most one shard's work."""
    quarantined: list[BadLatent] = []
    fallbacks: list[OomFallback] = []
    progress = tqdm(total=len(todo), desc="latents", unit="clip")
    for _, group in groupby(todo, key=lambda r: r.bucket):
        group = list(group)
        for start in range(0, len(group), shard_clips):
            done = []
            for row in group[start : start + shard_clips]:
                stored = store.get("clips", [row.clip_key])[row.clip_key]
                pixels = torch.from_numpy(np.array(stored["frames"]))[None].to(device)  # copy: Arrow is read-only
                latent, fallback = _encode_with_fallback(vae, family, pixels, sampling)
                latent = _with_image_latent(latent, vae, family, pixels, sampling)
                condition = family.image_condition(vae, image, stored) or {}
                if stored.get("mask_frames") is not None:
                    condition[MASK_COLUMN] = latent_mask(np.asarray(stored["mask_frames"]), tuple(latent.shape))
                key = row.tiled_key if fallback == "tiling" else row.key  # tiled: other numbers, other key
                if fallback:
                    log.warning("clip %s ran out of memory; encoded with %s", row.clip_key, fallback)
                    fallbacks.append(OomFallback(clip_key=row.clip_key, fallback=fallback, key=row.key))
                bad = non_finite({"latent": latent, **condition})
                if bad:
                    what = f"{row.source} (clip {row.clip_key}, frames {row.frames})"
                    quarantined.append(BadLatent(key=row.key, clip_key=row.clip_key, dataset=row.dataset,
                                                 reason="non_finite_latent",
                                                 detail=non_finite_detail(what, "vae", vae.dtype, bad)
                                                 + "; the clip is left out of training"))
                    log.warning("%s", quarantined[-1].detail)
                elif MASK_COLUMN in condition and not condition[MASK_COLUMN].any():  # nothing to train on
                    quarantined.append(BadLatent(key=row.key, clip_key=row.clip_key, dataset=row.dataset,
                                                 reason="empty_mask"))
                elif key not in have:
                    done.append({"key": key, **latent_columns(latent.cpu(), sampling), **condition})
                progress.update()
            store.put("latents", done)
    progress.close()
    return quarantined, fallbacks


def _with_image_latent(
    latent: torch.Tensor, vae: torch.nn.Module, family: ModelFamily, pixels: torch.Tensor, sampling: str
) -> torch.Tensor:
    """i2v: latent frame 0 replaced by the first frame encoded alone, which is what the i2v pipeline conditions on.

    Encoding the whole clip gives a different frame 0 (the video VAE's GroupNorms see every frame), and training
    only ever uses frame 0 as the clean conditioning frame (it is outside the loss), so this makes training's
    condition exactly inference's (the mode; the pipeline draws a sample around it). With `i2v_mode: first_last` the
    last latent frame is the clip's last frame encoded alone, likewise."""
    given = family.flavour.conditioning_frames
    if not given:
        return latent
    image, _ = _encode_with_fallback(vae, family, pixels[:, :1], sampling)
    latent = torch.cat([image[:, :given], latent[:, given:]], dim=1)  # (C, T, h, w): frames are dim 1
    if family.flavour.last_frame_given:  # i2v_mode first_last: the last frame alone, as validation encodes it
        last, _ = _encode_with_fallback(vae, family, pixels[:, -1:], sampling)
        latent = torch.cat([latent[:, :-1], last], dim=1)
    return latent


def _encode_with_fallback(
    vae: torch.nn.Module, family: ModelFamily, pixels: torch.Tensor, sampling: str
) -> tuple[torch.Tensor, str]:
    """Encode; on out-of-memory retry with exact patch conv, then with tiling. Returns (latent, fallback used)."""
    try:
        return family.vae_encode(vae, pixels, sampling)[0], ""
    except torch.OutOfMemoryError:
        free_models()
    enable_patch_conv(vae, max_slab_bytes=64 * 2**20)
    try:
        return family.vae_encode(vae, pixels, sampling)[0], "patch_conv"
    except torch.OutOfMemoryError:
        free_models()
    # Tiling is approximate: only this clip gets it (stored under its tiled key, listed as approximate; see
    # `listed`), and every later clip is tried as configured first again. Patch conv above stays on: it is exact.
    configured = getattr(vae, "use_tiling", False)
    vae.enable_tiling()
    try:
        return family.vae_encode(vae, pixels, sampling)[0], "tiling"
    finally:
        if not configured:
            vae.disable_tiling()

