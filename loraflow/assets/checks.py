"""Asset checks: each reads the store and fails loudly, the offending items listed in its metadata.

ERROR checks are blocking: in a job, a failed check stops the assets downstream of it (no training on
latents of the wrong shape, no validation of a LoRA that does not load). The finders below are plain
functions returning offending rows, so they read (and test) without Dagster. A check of a partitioned asset
(clips, latents) is partitioned like it: it checks the run's dataset only (another dataset may be half-way through
its own run), and its result is that dataset's, so one dataset's pass never hides another's failure.
"""

# No `from __future__ import annotations` here: Dagster inspects the real annotations of check functions.
import warnings
from collections.abc import Iterable, Iterator
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    MetadataValue,
    PreviewWarning,
    asset_check,
)

from loraflow.assets import metadata as md
from loraflow.assets.partitions import DATASETS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import clips, latents, lora, text_embeds
from loraflow.contracts.clip_rows import read_clips
from loraflow.stages.clips.bucket_plan import LatentGeometry
from loraflow.store import Store

if TYPE_CHECKING:  # the latents stage imports torch: annotations only
    from loraflow.stages.latents.latents import PlannedLatent

# Partitioned checks are "preview" in Dagster 1.13 (pinned in pyproject.toml); they are what keeps one dataset's
# result from replacing another's, so the load-time warning about them is expected and quieted.
warnings.filterwarnings("ignore", "Specifying a partitions_def on an AssetCheckSpec", PreviewWarning)
READ_CLIPS = 64  # latents read per store.get: bounds memory on large datasets


def _datasets(context: AssetCheckExecutionContext) -> list[str] | None:
    """The run's dataset (a partitioned run), or None: every dataset (a direct call without a partition)."""
    return [context.partition_key] if context.has_partition_key else None


def _result(passed: bool, offending: list[dict[str, Any]], checked: int, what: str,
            severity: AssetCheckSeverity = AssetCheckSeverity.ERROR, **extra: Any) -> AssetCheckResult:
    description = f"all {checked} {what} ok" if passed else f"{len(offending)} of {checked} {what} failed"
    return AssetCheckResult(
        passed=passed,
        severity=severity,
        description=description,
        metadata={"checked": checked, "offending_count": len(offending), "offending": md.md_table(offending), **extra},
    )


# -- latents -------------------------------------------------------------------------------------
def _latent_chunks(store: Store, rows: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """(manifest row, latent) pairs, read a bucket chunk at a time (shards are written per bucket)."""
    rows = sorted(rows, key=lambda r: r["bucket"])
    for _, group in groupby(rows, key=lambda r: r["bucket"]):
        group = list(group)
        for start in range(0, len(group), READ_CLIPS):
            chunk = group[start : start + READ_CLIPS]
            got = store.get("latents", [r["key"] for r in chunk], columns=["latent"])
            for row in chunk:
                yield row, got[row["key"]]["latent"]


def bad_latents(store: Store, geometry: LatentGeometry,
                datasets: list[str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Latents (of `datasets`; None: all) whose shape is not their clip's bucket shape, or that hold NaN/inf;
    (checked, offending)."""
    clip_rows = {r.key: r for r in read_clips(store, parts=datasets)}
    rows = store.read_manifest("latents", parts=datasets)
    committed = store.keys("latents")
    offending = [{"latent": r["key"], "bucket": r["bucket"], "problem": "not in the store (manifest names it)"}
                 for r in rows if r["key"] not in committed]
    readable = [r for r in rows if r["key"] in committed]
    for row, latent in _latent_chunks(store, readable):
        clip = clip_rows.get(row["clip_key"])
        if clip is None:
            offending.append({"latent": row["key"], "bucket": row["bucket"], "problem": "its clip is not current"})
            continue
        expected = geometry.shape(clip.num_frames, clip.height, clip.width)
        base = {"latent": row["key"], "bucket": row["bucket"], "source": clip.source}
        if tuple(latent.shape) != expected:
            offending.append({**base, "problem": f"shape {tuple(latent.shape)}, expected {expected}"})
        elif not np.isfinite(latent).all():
            offending.append({**base, "problem": f"{int((~np.isfinite(latent)).sum())} non-finite values"})
    return len(rows), offending


@asset_check(asset=latents, blocking=True, partitions_def=DATASETS,
             description="Every latent has its clip's shape through the checkpoint's VAE, (C, (F-1)/4+1, H/s, W/s) "
                         "with s its spatial factor (8 or 16), and is finite.")
def latents_shape_and_finite(context: AssetCheckExecutionContext, loraflow: LoraflowResource) -> AssetCheckResult:
    from loraflow.pipelines import plan_family
    from loraflow.stages.clips.buckets import latent_geometry

    config = loraflow.load()
    geometry = latent_geometry(loraflow.model(config), plan_family(config))
    checked, offending = bad_latents(loraflow.store(config), geometry, _datasets(context))
    return _result(not offending, offending, checked, "latents",
                   geometry=MetadataValue.json({"channels": geometry.channels, "temporal": geometry.temporal,
                                                "spatial": geometry.spatial}))


# -- coverage ------------------------------------------------------------------------------------
def clips_without_latents(expected: "list[PlannedLatent]", store: Store,
                          datasets: list[str] | None = None) -> list[dict[str, Any]]:
    """Current clips (of `datasets`; None: all) whose latent for the current VAE is not listed and stored (an
    approximate one, tiled after running out of memory, is listed under its own key and counts)."""
    listed = {r["key"] for r in store.read_manifest("latents", parts=datasets)}
    committed = store.keys("latents")
    sources = {r.key: r.source for r in read_clips(store, parts=datasets)}
    skipped = quarantined_latents(store, datasets)  # the latents report names them, with their reason

    def problem(row: "PlannedLatent") -> str:
        key = next((k for k in (row.key, row.tiled_key) if k in listed), None)
        if key is None:
            return "no latent for the current VAE"
        return "" if key in committed else "latent listed but not stored"

    return [{"clip": r.clip_key, "source": sources.get(r.clip_key, "?"), "bucket": r.bucket,
             "problem": problem(r)} for r in expected if r.key not in skipped and problem(r)]


def quarantined_latents(store: Store, datasets: list[str] | None) -> set[str]:
    """Latent keys the last latents run of each dataset quarantined (a store from before it kept them: none)."""
    parts = [p for p in store.manifest_parts("latents_quarantine") if datasets is None or p in datasets]
    return {r["key"] for r in store.read_manifest("latents_quarantine", parts=parts)} if parts else set()


@asset_check(asset=latents, blocking=True, partitions_def=DATASETS,
             description="Every clip in the clips manifest has a stored latent.")
def latents_cover_clips(context: AssetCheckExecutionContext, loraflow: LoraflowResource) -> AssetCheckResult:
    from loraflow.pipelines import get_family
    from loraflow.stages.latents.latents import latent_rows

    config = loraflow.load()
    store = loraflow.store(config)
    datasets = _datasets(context)
    expected = latent_rows(config, get_family(config), loraflow.model(config), store, datasets)
    offending = clips_without_latents(expected, store, datasets)
    return _result(not offending, offending, len(expected), "clips")


def texts_without_embeddings(needed: Iterable[tuple[str, str]], store: Store) -> list[dict[str, Any]]:
    """Needed (text, image) items (captions, "", negative, validation prompt; i2i: with their source image)
    missing from the manifest or the store."""
    from loraflow.contracts.text_set import text_lookup

    listed = text_lookup(store)
    committed = store.keys("text_embeds")
    users: dict[str, list[str]] = {}
    for clip in read_clips(store):
        for caption in clip.captions:
            users.setdefault(caption, []).append(clip.source)
    offending = []
    for text, image in needed:
        if listed.get((text, image)) in committed:
            continue
        who = users.get(text, [])
        offending.append({"text": repr(text[:60]), "used_by": ", ".join(sorted(set(who))[:5]) or "(prompt)",
                          "problem": "not in the manifest" if (text, image) not in listed else "listed but not stored"})
    return offending


@asset_check(asset=text_embeds, blocking=True,
             description="Every caption of every clip (and the empty, negative and validation prompts) is embedded.")
def text_embeds_cover_captions(loraflow: LoraflowResource) -> AssetCheckResult:
    from loraflow.pipelines import get_family
    from loraflow.stages.text.text_embeds import needed_texts

    config = loraflow.load()
    store = loraflow.store(config)
    needed = needed_texts(config, get_family(config), loraflow.model(config), store)
    offending = texts_without_embeddings(needed, store)
    return _result(not offending, offending, len(needed), "texts")


# -- captions ------------------------------------------------------------------------------------
def empty_captions(store: Store, datasets: list[str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    rows = read_clips(store, parts=datasets)
    offending = [{"dataset": r.dataset, "source": r.source, "bucket": r.bucket}
                 for r in rows if any(not c.strip() for c in r.captions)]
    return len(rows), offending


@asset_check(asset=clips, partitions_def=DATASETS,
             description="No clip trains on the empty prompt by accident (an empty caption file). "
                         "WARN: an empty caption is legitimate when unconditional training is intended.")
def captions_not_empty(context: AssetCheckExecutionContext, loraflow: LoraflowResource) -> AssetCheckResult:
    config = loraflow.load()
    checked, offending = empty_captions(loraflow.store(config), _datasets(context))
    return _result(not offending, offending, checked, "clips", severity=AssetCheckSeverity.WARN)


# -- lora ----------------------------------------------------------------------------------------
def lora_problems(path: str | Path, rank: int) -> tuple[int, list[dict[str, Any]]]:
    """Open the adapter file and list what is wrong with it: (tensors checked, offending)."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        return 0, [{"tensor": "(file)", "problem": f"does not open as safetensors: {exc}"}]
    if not tensors:
        return 0, [{"tensor": "(file)", "problem": "holds no tensors"}]
    offending = []
    for name, tensor in sorted(tensors.items()):
        problem = _tensor_problem(name, tensor, tensors, rank)
        if problem is None and not torch.isfinite(tensor.float()).all():
            problem = f"{int((~torch.isfinite(tensor.float())).sum())} non-finite values"
        if problem:
            offending.append({"tensor": name, "shape": tuple(tensor.shape), "problem": problem})
    return len(tensors), offending


def _tensor_problem(name: str, tensor: Any, tensors: dict[str, Any], rank: int) -> str | None:
    """Key and shape rules of a diffusers-format LoRA: transformer.*.lora_A.weight (r, in) + lora_B (out, r)."""
    if not name.startswith("transformer."):
        return "key does not start with `transformer.` (not the diffusers LoRA format)"
    if ".lora_A." in name:
        partner, rank_dim = name.replace(".lora_A.", ".lora_B."), 0
    elif ".lora_B." in name:
        partner, rank_dim = name.replace(".lora_B.", ".lora_A."), 1
    else:
        return "key is neither lora_A nor lora_B"
    if partner not in tensors:
        return f"has no partner {partner}"
    if tensor.dim() != 2 or tensor.shape[rank_dim] != rank:
        return f"rank dimension is not lora_rank {rank}"
    return None


@asset_check(asset=lora, blocking=True,
             description="The adapter opens as safetensors, has transformer.*lora_A/B keys in pairs, and is finite.")
def lora_file_loads(loraflow: LoraflowResource) -> AssetCheckResult:
    from loraflow.pipelines import get_family
    from loraflow.training.run import current_lora_path

    config = loraflow.load()
    try:
        path = current_lora_path(config, get_family(config), loraflow.store(config))
    except FileNotFoundError as exc:
        return _result(False, [{"tensor": "(file)", "problem": str(exc)}], 0, "tensors")
    checked, offending = lora_problems(path, config.lora_rank)
    return _result(not offending, offending, checked, "tensors", lora_path=MetadataValue.path(path))


ALL_CHECKS = [latents_shape_and_finite, latents_cover_clips, text_embeds_cover_captions, captions_not_empty,
              lora_file_loads]
