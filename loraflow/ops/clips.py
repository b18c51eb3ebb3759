"""The clips stage: probe sources, choose clips, bucket, crop, decode only the kept frames, caption.

Flow for one file: identity -> probe (cached by path+size+mtime) -> frame plan -> clip keys -> decode the
missing clips at their bucket size -> store frames -> manifest row with captions. A file that cannot be
used becomes a quarantine row with a reason; every other file proceeds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loraflow.config import DatasetConfig, LoraflowConfig
from loraflow.keys import content_key, data_version, file_identity
from loraflow.ops import buckets
from loraflow.ops.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, Probe, decode_frames, probe
from loraflow.ops.report import StageReport
from loraflow.pipelines.base import ModelFamily
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "clips-1"  # bump when the decoded frames would change for the same plan


def source_files(dataset: DatasetConfig) -> Iterator[Path]:
    root = Path(dataset.instance_data_dir or "")
    if not root.is_dir():
        raise FileNotFoundError(f"dataset '{dataset.id}': instance_data_dir {root} is not a folder")
    media = VIDEO_EXTENSIONS | IMAGE_EXTENSIONS
    yield from sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in media)


def read_captions(path: Path, dataset: DatasetConfig) -> list[str]:
    """Captions for a file. Rule: textfile = one caption per non-empty line; an empty file is the empty
    prompt; a missing or non-UTF-8 file quarantines the source (MediaError)."""
    if dataset.caption_strategy == "instanceprompt":
        return [dataset.instance_prompt or ""]
    if dataset.caption_strategy == "filename":
        return [path.stem.replace("_", " ").replace("-", " ").strip()]
    caption_file = path.with_suffix(".txt")
    if not caption_file.is_file():
        raise MediaError("missing_caption", f"{path.name}: no caption file {caption_file.name} (caption_strategy textfile)")
    try:
        text = caption_file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MediaError("caption_not_utf8", f"{caption_file.name} is not UTF-8 ({exc.reason}); re-save it as UTF-8") from None
    return [line.strip() for line in text.splitlines() if line.strip()] or [""]


def probe_cached(path: Path, identity: dict[str, Any], store: Store, known: set[str]) -> Probe:
    """Probe once per file identity; the result lives in the store's `probes` stage."""
    key = content_key(identity=identity, code=CODE_VERSION)
    if key in known:
        return Probe(**{k: v for k, v in store.get("probes", [key])[key].items() if k != "key"})
    result = probe(path)
    store.put("probes", [{"key": key, **asdict(result)}])
    known.add(key)
    return result


def plan_clips(path: Path, info: Probe, dataset: DatasetConfig, family: ModelFamily) -> list[dict[str, Any]]:
    """The clips a source yields: frame indices, bucket size and crop, before any decoding."""
    video = dataset.video
    if info.is_image or dataset.dataset_type == "image":
        clips = [[0]]
    else:
        timeline = buckets.resampled_indices(info.num_frames, info.fps, video.frame_rate or family.flavour.fps)
        if video.min_frames and len(timeline) < video.min_frames:
            raise MediaError("too_short", f"{path.name}: {len(timeline)} frames < min_frames {video.min_frames}")
        if video.max_frames and len(timeline) > video.max_frames and video.frame_extraction != "full":
            raise MediaError("too_long", f"{path.name}: {len(timeline)} frames > max_frames {video.max_frames}")
        try:
            clips = buckets.select_clips(timeline, video.num_frames, video.frame_extraction, video.max_frames,
                                         video.frame_stride, video.frame_sample)
        except buckets.TooShort as exc:
            raise MediaError("too_short", f"{path.name}: {exc} (num_frames {video.num_frames})") from None
    height, width = buckets.bucket_size(info.height, info.width, dataset.resolution, family.spatial_multiple)
    planned = []
    for indices in clips:
        if video.bucket_strategy == "resolution_frames" and len(indices) > 1:
            indices = indices[: buckets.frames_for_bucket(len(indices), video.frame_interval)]
        planned.append({"indices": indices, "height": height, "width": width})
    return planned


def _clip_rows(path: Path, dataset: DatasetConfig, family: ModelFamily, store: Store, probes: set[str]) -> list[dict]:
    identity = file_identity(path, dataset.instance_data_dir or "")
    captions = read_captions(path, dataset)
    info = probe_cached(path, identity, store, probes)
    rows = []
    for plan in plan_clips(path, info, dataset, family):
        size = (plan["height"], plan["width"])
        key = content_key(source=identity, indices=plan["indices"], size=size, crop=dataset.crop_style, code=CODE_VERSION)
        crop = buckets.crop_plan((info.height, info.width), size, dataset.crop_style, seed=key)
        rows.append({
            "key": key, "dataset": dataset.id, "source": identity["path"], "path": str(path),
            "bucket": f"{size[1]}x{size[0]}@{len(plan['indices'])}", "height": size[0], "width": size[1],
            "num_frames": len(plan["indices"]), "indices": plan["indices"], "resize": list(crop.resize),
            "box": list(crop.box), "captions": captions, "repeats": dataset.repeats,
        })
    return rows


def decode_clip(row: dict[str, Any]) -> np.ndarray:
    """uint8 (F, H, W, 3): decode only the kept frames, resized in the decoder, then cut the crop box."""
    frames = decode_frames(row["path"], row["indices"], tuple(row["resize"]))
    top, left, height, width = row["box"]
    return np.ascontiguousarray(frames[:, top : top + height, left : left + width])


def build_clips(config: LoraflowConfig, family: ModelFamily, store: Store) -> StageReport:
    """Plan every dataset, decode what the store lacks, write the manifest of current clips."""
    manifest, quarantine = [], []
    probes = store.keys("probes")
    for dataset in config.training_datasets:
        for path in source_files(dataset):
            try:
                manifest += _clip_rows(path, dataset, family, store, probes)
            except MediaError as exc:
                quarantine.append({"dataset": dataset.id, "file": str(path), "reason": exc.reason, "detail": str(exc)})
    have = store.keys("clips")
    todo = [row for row in manifest if row["key"] not in have]
    failed = _decode_missing(todo, store)
    quarantine += failed
    bad = {q["file"] for q in failed}
    manifest = [row for row in manifest if row["path"] not in bad]
    computed = len(todo) - len(failed)
    store.write_manifest("clips", manifest)
    store.write_manifest("quarantine", quarantine)
    return StageReport(
        data_version=data_version(r["key"] for r in manifest),
        computed=computed,
        reused=len(manifest) - computed,
        quarantined=quarantine,
        tables={"buckets": bucket_table(manifest)},
    )


def _decode_missing(todo: list[dict[str, Any]], store: Store, shard_clips: int = 8) -> list[dict[str, str]]:
    """Decode clips the store lacks, committing a shard per bucket chunk (a killed run keeps its shards)."""
    failed: list[dict[str, str]] = []
    todo = sorted(todo, key=lambda r: r["bucket"])
    progress = tqdm(total=len(todo), desc="clips", unit="clip", disable=not todo)
    for start in range(0, len(todo), shard_clips):
        decoded: dict[str, list[dict[str, Any]]] = {}
        for row in todo[start : start + shard_clips]:
            try:
                decoded.setdefault(row["bucket"], []).append({"key": row["key"], "frames": decode_clip(row)})
            except MediaError as exc:
                failed.append({"dataset": row["dataset"], "file": row["path"], "reason": exc.reason, "detail": str(exc)})
            progress.update()
        for rows in decoded.values():
            store.put("clips", rows)
    progress.close()
    return failed


def bucket_table(manifest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    counts: dict[str, dict[str, Any]] = {}
    for row in manifest:
        entry = counts.setdefault(row["bucket"], {"bucket": row["bucket"], "clips": 0, "frames_bytes": 0})
        entry["clips"] += 1
        entry["frames_bytes"] += row["height"] * row["width"] * row["num_frames"] * 3
    return sorted(counts.values(), key=lambda e: e["bucket"])
