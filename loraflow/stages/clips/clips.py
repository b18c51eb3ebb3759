"""The clips stage: probe sources, choose clips, bucket, crop, decode only the kept frames, caption.

Flow for one file: identity -> probe (cached by path+size+mtime) -> frame plan -> clip keys -> decode the
missing clips at their bucket size -> store frames -> manifest row with captions. A file that cannot be
used becomes a quarantine row with a reason; every other file proceeds. Every folder entry that is no media file
(a broken link, a GIF, a stray note: `dataset_folder`) gets a quarantine row too.

Captions: stages/clips/captions.py (each caption_strategy, and its rules). A family whose release captions the sound
in its prompt (`FamilySpec.compose_prompt`, Kandinsky 6) gets each caption composed with the file's audio caption and
speech (`read_sound_captions`): the row's `captions` are then what the text encoder reads.

i2v: the conditioning image is the first frame of the stored clip (`condition_frame`), i.e. source frame
indices[0] after cropping, so it always matches the clip's first latent frame.
i2i: each image of a dataset with `conditioning_data` is paired with the file of the same relative path (any image
extension) in that conditioning dataset; the source image is cropped to the target's bucket like the target and
stored beside its frames (`condition_frames`). The row's `condition` names it (source file, size, crop): the
text_embeds stage keys the prompt embedding by it (i2i's prompt embedding sees the source image).
Masked loss pairs each file with its mask image the same way, into `mask*` columns and `mask_frames`
(contracts/masks.py): a mask is no source image, and no prompt embedding sees it.
"""

from __future__ import annotations

import glob
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from loraflow.config import DatasetConfig, LoraflowConfig, select_datasets
from loraflow.config.dataset import DEFAULT_MAX_UPSCALE, is_mask_dataset
from loraflow.contracts.clip_rows import ClipRow, ClipScene, DroppedFile, PairedImage, source_version
from loraflow.contracts.reports import ClipsReport, DropReason, SceneRow
from loraflow.keys import content_key, data_version, file_identity
from loraflow.media.frames import ProbeCache, decode_frames
from loraflow.media.types import IMAGE_EXTENSIONS, MediaError, Probe
from loraflow.pipelines import bucket_multiple, family_spec
from loraflow.pipelines.sources import ModelSource
from loraflow.stages.clips import buckets
from loraflow.stages.clips.buckets import LatentGeometry, latent_geometry, tally_buckets
from loraflow.stages.clips.captions import TEXT_FILES, read_captions, read_scene_captions, read_sound_captions
from loraflow.stages.clips.dataset_folder import SCENE_CAPTION, Listing, link_outside, printable, read_or_quarantine
from loraflow.stages.clips.hub_dataset import readable
from loraflow.store import Store

if TYPE_CHECKING:  # planning asks the plain protocol (`FamilyPlanning`): no torch
    from loraflow.pipelines import FamilyPlanning

log = logging.getLogger(__name__)
CODE_VERSION = "clips-1"  # bump when the decoded frames would change for the same plan
@dataclass(frozen=True)
class ClipPlan:
    """One clip a source yields, before decoding: its source frame indices, its bucket size, and its scene (from 1;
    None: the file is one scene)."""
    indices: list[int]
    height: int
    width: int
    scene: int | None


def plan_clips(
    path: Path, info: Probe, dataset: DatasetConfig, family: FamilyPlanning, model: ModelSource | str,
    images_allowed: bool = False, cuts: Sequence[int] | None = None,
) -> list[ClipPlan]:
    """The clips a source yields: frame indices, bucket size and crop, before any decoding.

    `images_allowed`: the dataset i2v validation renders from (`config.render_dataset_id`) may hold images.
    `cuts`: the video's scene cuts (`video.scene_cuts: detect`, the first frame of each new scene): each clip then
    lies inside one scene, whose number (from 1) its plan says; None: the file is one scene, the plans say none.
    """
    video = dataset.video
    is_image = info.is_image or dataset.dataset_type == "image"
    _check_aspect(path, info, dataset)
    fps = video.frame_rate or family.flavour.fps
    if is_image:
        clips: list[tuple[list[int], int | None]] = [([0], None if cuts is None else 1)]
    elif cuts is None:
        clips = [(indices, None) for indices in _video_clips(path, info, dataset, fps)]
    else:
        clips = _scene_clips(path, info, dataset, fps, cuts)
    height, width = buckets.bucket_size(info.height, info.width, dataset.resolution, bucket_multiple(family, model),
                                        dataset.resolution_type, dataset.crop_aspect, dataset.crop_aspect_buckets)
    problem = family.size_problem(model, height, width)
    if problem:  # the bucket, whatever the source: the config's problem, said first
        raise MediaError("source_too_large", f"{path.name}: {problem}: lower `resolution` ({dataset.resolution}) of "
                         f"dataset '{dataset.id}'")
    _check_source_size(path, info, dataset, (height, width))
    planned = []
    for indices, scene in clips:
        if video.bucket_strategy == "resolution_frames" and len(indices) > 1:
            indices = indices[: buckets.frames_for_bucket(len(indices), video.frame_interval)]
        planned.append(ClipPlan(indices, height, width, scene))
    _check_clip_lengths(path, {len(p.indices) for p in planned}, family, images_allowed, is_image)
    return planned


def _video_clips(path: Path, info: Probe, dataset: DatasetConfig, target_fps: float | None) -> list[list[int]]:
    """A video's clips as source frame indices; a drop for its length names both rates and both frame counts."""
    timeline = buckets.resampled_indices(info.num_frames, info.fps, target_fps, info.frame_times)
    counts = f"{path.name}: {buckets.resampling_note(info.num_frames, info.fps, target_fps, len(timeline))}; "
    return _timeline_clips(timeline, dataset, counts)


def _scene_clips(path: Path, info: Probe, dataset: DatasetConfig, target_fps: float | None,
                 cuts: Sequence[int]) -> list[tuple[list[int], int]]:
    """The clips of each scene (numbered from 1), each scene taken as a video of its own; a scene too short or too
    long for the dataset yields none, and a file none of whose scenes yields a clip is dropped, saying why for each."""
    timeline = buckets.resampled_indices(info.num_frames, info.fps, target_fps, info.frame_times)
    scenes = buckets.scene_timelines(timeline, cuts)
    bounds = [0, *cuts, info.num_frames]
    clips, skipped = [], []
    for number, scene in enumerate(scenes, 1):
        where = f"scene {number} (frames {bounds[number - 1]}-{bounds[number] - 1}): "
        try:
            clips += [(indices, number) for indices in _timeline_clips(scene, dataset, where)]
        except MediaError as exc:
            skipped.append(exc)
    if not clips:
        note = buckets.resampling_note(info.num_frames, info.fps, target_fps, len(timeline))
        shown = "; ".join(str(exc) for exc in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        raise MediaError(skipped[0].reason, f"{path.name}: {note}; none of its {len(scenes)} scenes (video.scene_cuts "
                         f"detect) yields a clip: {shown}")
    return clips


def _timeline_clips(timeline: list[int], dataset: DatasetConfig, counts: str) -> list[list[int]]:
    """The clips of a (resampled) timeline under the dataset's clip mode; `counts` starts each drop's message."""
    video = dataset.video
    if video.min_frames and len(timeline) < video.min_frames:
        raise MediaError("too_short", f"{counts}{len(timeline)} < min_frames {video.min_frames}")
    if video.max_frames and len(timeline) > video.max_frames and video.frame_extraction != "full":
        raise MediaError("too_long", f"{counts}{len(timeline)} > max_frames {video.max_frames}")
    try:
        if not timeline:
            raise buckets.TooShort
        return buckets.select_clips(timeline, video.num_frames, video.frame_extraction, video.max_frames,
                                    video.frame_stride, video.frame_sample)
    except buckets.TooShort:
        raise MediaError("too_short", f"{counts}{len(timeline)} < num_frames {video.num_frames}") from None


def _check_aspect(path: Path, info: Probe, dataset: DatasetConfig) -> None:
    """SimpleTuner's limits on the source's width / height as shown, before any crop (see DatasetConfig)."""
    ratio, low, high = info.width / info.height, dataset.minimum_aspect_ratio, dataset.maximum_aspect_ratio
    if low is not None and ratio < low:
        raise MediaError("aspect_too_tall", f"{path.name}: a {info.width}x{info.height} source, aspect ratio (width / "
                         f"height) {ratio:.3g} < minimum_aspect_ratio {low:g}; crop it, or lower the limit")
    if high is not None and ratio > high:
        raise MediaError("aspect_too_wide", f"{path.name}: a {info.width}x{info.height} source, aspect ratio (width / "
                         f"height) {ratio:.3g} > maximum_aspect_ratio {high:g}; crop it, or raise the limit")


def _check_source_size(path: Path, info: Probe, dataset: DatasetConfig, bucket: tuple[int, int]) -> None:
    """A source far smaller than its bucket would be upscaled into blur and trained on as if it were detail."""
    edge, floor = buckets.source_edge(info.height, info.width, dataset.resolution_type), dataset.minimum_source_edge()
    if edge >= floor:
        return
    measure = "shorter side" if dataset.resolution_type == "pixel" else "area edge (square root of its area)"
    limit = (f"minimum_image_size {dataset.minimum_image_size}" if dataset.minimum_image_size is not None else
             f"minimum_image_size (unset: resolution {dataset.resolution} / {DEFAULT_MAX_UPSCALE} = {floor:g})")
    raise MediaError("source_too_small", f"{path.name}: a {info.width}x{info.height} source, {measure} {edge:g} px < "
                     f"{limit}; its {bucket[1]}x{bucket[0]} bucket would upscale it "
                     f"{buckets.source_edge(*bucket, dataset.resolution_type) / edge:.3g}x: use a larger source, or "
                     "lower `minimum_image_size` (0 keeps every size)")


def _check_clip_lengths(path: Path, lengths: set[int], family: FamilyPlanning, images_allowed: bool,
                        is_image: bool) -> None:
    """What the flavour can train on, by the planned lengths (`frame_extraction: full` ignores `num_frames`)."""
    if family.flavour.num_frames == 1 and lengths - {1}:
        raise MediaError("too_long", f"{path.name}: clips of {max(lengths)} frames; {family.name} trains on single "
                         "frames: set `video.num_frames: 1` and a frame_extraction other than full")
    if family.flavour.conditioning_frames and 1 in lengths and not images_allowed:  # K5 i2v scores frames 1..
        what = ("single_image", "an image") if is_image else ("too_short", "a 1-frame clip")
        raise MediaError(what[0], f"{path.name}: {what[1]}; flavour '{family.flavour.name}' trains on the frames "
                         "after a clean first frame, so it needs videos")


def plan_files(config: LoraflowConfig, family: FamilyPlanning, model: ModelSource | str,
               dataset: DatasetConfig, listing: Listing, probes: ProbeCache,
               progress: bool = False) -> tuple[list[ClipRow], list[DroppedFile]]:
    """The one per-file planner, for the clips stage and `loraflow check`'s plan (bucket_plan.py): the clips of
    each media file of the listing, and a quarantine row for every entry that yields none."""
    manifest, quarantine = [], [dropped(dataset.id, path, exc) for path, exc in listing.others]
    files = listing.files
    for path in tqdm(files, desc=f"probe {dataset.id}", unit="file", disable=not progress or not files):
        try:
            manifest += _clip_rows(path, dataset, family, model, probes,
                                   images_allowed=dataset.id == config.render_dataset_id,
                                   sources=config.source_images(dataset))
        except MediaError as exc:
            quarantine.append(dropped(dataset.id, path, exc))
        quarantine += _unmatched_scene_captions(path, dataset, probes)
    return manifest, quarantine


def _unmatched_scene_captions(path: Path, dataset: DatasetConfig, probes: ProbeCache) -> list[DroppedFile]:
    """A `not_used` row for each scene caption file NAME.nnnn.txt beside `path` whose scene the cut list lacks."""
    cuts = probes.scene_lists.get(str(path))
    if cuts is None or dataset.caption_strategy not in TEXT_FILES:
        return []
    rows, video = [], dataset.video
    for caption in sorted(path.parent.glob(f"{glob.escape(path.stem)}.*")):
        scene = SCENE_CAPTION.match(caption.stem)
        if caption.suffix.lower() == ".txt" and scene and scene["stem"] == path.stem and \
                not 1 <= int(scene["scene"]) <= len(cuts) + 1:
            rows.append(dropped(dataset.id, caption, MediaError(
                "not_used", f"{printable(caption.name)}: the caption of scene {int(scene['scene'])}, but "
                f"{printable(path.name)} has {len(cuts) + 1} scenes (scene_threshold {video.scene_threshold:g}, "
                f"min_scene_len {video.min_scene_len:g} s); nothing reads it: rename or remove it")))
    return rows


def _clip_rows(path: Path, dataset: DatasetConfig, family: FamilyPlanning, model: ModelSource | str,
               probes: ProbeCache, images_allowed: bool, sources: DatasetConfig | None = None) -> list[ClipRow]:
    """The file's clips; `sources`: the conditioning dataset holding its i2i source image or its loss mask."""
    check_name(path)
    identity = read_or_quarantine(lambda: file_identity(path, dataset.instance_data_dir or ""), path)
    scenes_on = dataset.video.scene_cuts == "detect"
    # scenes: the captions are read once the scenes are known
    captions, audio_caption = ((), "") if scenes_on else composed_captions(path, dataset, family)
    info = probes.probe(path, identity)
    cuts = _cuts(path, identity, info, dataset, probes) if scenes_on else None
    source = _source_image(path, dataset, sources, probes) if sources else None
    column = "mask" if is_mask_dataset(sources) else "condition"
    plans = plan_clips(path, info, dataset, family, model, images_allowed, cuts)
    by_scene = {number: compose_sound(captions, path, dataset, family) for number, captions in
                read_scene_captions(path, dataset, sorted({p.scene for p in plans})).items()} if scenes_on else {}
    rows = []
    for plan in plans:
        if scenes_on:
            captions, audio_caption = by_scene[plan.scene]
        size = (plan.height, plan.width)
        paired = {column: source[0]} if source else {}  # t2v/t2i keys stay as they were
        key = content_key(source=identity, indices=plan.indices, size=size, crop=dataset.crop_style,
                          code=CODE_VERSION, **paired)
        crop = buckets.crop_plan((info.height, info.width), size, dataset.crop_style, seed=key)
        rows.append(ClipRow(
            key=key, dataset=dataset.id, source=identity["path"], path=str(path),
            bucket=buckets.bucket_label(*size, len(plan.indices)), height=size[0], width=size[1],
            num_frames=len(plan.indices), indices=tuple(plan.indices), resize=crop.resize, box=crop.box,
            captions=captions, repeats=dataset.repeats,
            source_version=source_version(identity), audio_caption=audio_caption,
            scene=_clip_scene(plan.scene, plan.indices, info) if scenes_on else None,
            **({column: _paired_image(source, size, dataset.crop_style, key)} if source else {}),
        ))
    return rows


def composed_captions(path: Path, dataset: DatasetConfig,
                      family: FamilyPlanning) -> tuple[tuple[str, ...], str]:
    """The file's captions as its family's text encoder reads them, and its audio caption ("" none): each caption
    composed with the audio caption and speech where the family composes its prompt; the plain captions else."""
    return compose_sound(tuple(read_captions(path, dataset)), path, dataset, family)


def compose_sound(captions: tuple[str, ...], path: Path, dataset: DatasetConfig,
                  family: FamilyPlanning) -> tuple[tuple[str, ...], str]:
    """`captions` (the file's, or one scene's) composed with the file's audio caption and speech where the family
    composes its prompt; the plain captions else. With the audio caption ("" none)."""
    compose = family_spec(family.name).compose_prompt
    if compose is None:
        return captions, ""
    audio, speech = read_sound_captions(path, dataset)
    if not audio and not speech:
        return captions, ""  # the plain captions: their text keys stay as they were
    return tuple(compose(caption, audio, speech) for caption in captions), audio


def _cuts(path: Path, identity: dict[str, Any], info: Probe, dataset: DatasetConfig,
          probes: ProbeCache) -> tuple[int, ...]:
    """A video's scene cuts (cached with its probe); an image is one scene, without cuts."""
    if info.is_image or dataset.dataset_type == "image":
        return ()
    return probes.scenes(path, identity, info, dataset.video.scene_threshold, dataset.video.min_scene_len)


def _clip_scene(number: int, indices: Sequence[int], info: Probe) -> ClipScene:
    """The clip's scene and its span of the source in seconds (a VFR file by its frame times)."""
    if info.is_image:
        return ClipScene(number, 0.0, 0.0)

    def time(i: int) -> float:
        return info.frame_times[i] if info.frame_times else i / info.fps

    return ClipScene(number, round(time(indices[0]), 6), round(time(indices[-1]) + 1 / info.fps, 6))


def _source_image(path: Path, dataset: DatasetConfig, sources: DatasetConfig,
                  probes: ProbeCache) -> tuple[dict[str, Any], Path, Probe]:
    """i2i: the source image paired with `path`, its identity and its (cached) probe."""
    found = check_name(find_source_image(path, dataset, sources))
    relative = path.relative_to(dataset.instance_data_dir or "")
    if problem := link_outside(found, sources):
        raise MediaError(problem.reason, f"{relative}: its {_paired_word(sources)} {problem}")
    identity = read_or_quarantine(lambda: file_identity(found, sources.instance_data_dir or ""), found)
    try:
        info = probes.probe(found, identity)
    except MediaError as exc:
        raise MediaError(exc.reason, f"{relative}: its {_paired_word(sources)} {identity['path']}: {exc}") from None
    return identity, found, info


def reads_sound_captions(family: FamilyPlanning) -> bool:
    """Whether the family reads NAME.audio.txt and NAME.speech.txt (`FamilySpec.compose_prompt`)."""
    return family_spec(family.name).compose_prompt is not None


def check_name(path: Path) -> Path:
    """Paths go into Parquet rows (UTF-8 strings) and to the decoders: a name that is not UTF-8 cannot."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise MediaError("bad_filename", f"{printable(path)}: the file name is not UTF-8 (an old archive's "
                         "encoding?); rename the file") from None
    return path


def dropped(dataset: str, path: str | Path, exc: MediaError) -> DroppedFile:
    """A quarantine row."""
    return DroppedFile(dataset=dataset, file=printable(path), reason=exc.reason, detail=str(exc))


def find_source_image(path: Path, dataset: DatasetConfig, sources: DatasetConfig) -> Path:
    """i2i (or masked loss): the file in `sources` with `path`'s relative folder and stem and an image extension."""
    relative = path.relative_to(dataset.instance_data_dir or "")
    folder = Path(sources.instance_data_dir or "") / relative.parent
    found = sorted(p for p in (read_or_quarantine(lambda: list(folder.iterdir()), folder) if folder.is_dir() else ())
                   if p.stem == relative.stem and p.suffix.lower() in IMAGE_EXTENSIONS)
    word = _paired_word(sources)
    reason = word.replace(" ", "_")
    if not found:
        raise MediaError(f"missing_{reason}", f"{relative}: no {word} {relative.with_suffix('.*')} in dataset "
                         f"'{sources.id}' ({sources.instance_data_dir}); {_pairing(sources)} pairs each file with one")
    if len(found) > 1:
        raise MediaError(f"ambiguous_{reason}", f"{relative}: {len(found)} {word}s share its name in "
                         f"dataset '{sources.id}' ({', '.join(p.name for p in found)}); keep one")
    return found[0]


def _paired_word(sources: DatasetConfig) -> str:
    return "mask" if is_mask_dataset(sources) else "source image"


def _pairing(sources: DatasetConfig) -> str:
    return "masked loss" if is_mask_dataset(sources) else "i2i"


def _paired_image(source: tuple[dict[str, Any], Path, Probe], size: tuple[int, int], crop_style: str,
                  key: str) -> PairedImage:
    """The source image (or mask) cut like the target: same bucket size, same crop style and seed (aligned when the
    two images have the same size, as edit pairs and masks do)."""
    identity, path, info = source
    crop = buckets.crop_plan((info.height, info.width), size, crop_style, seed=key)
    return PairedImage(key=content_key(source=identity, resize=crop.resize, box=crop.box, code=CODE_VERSION),
                       path=str(path), resize=crop.resize, box=crop.box)


def decode_clip(row: ClipRow) -> dict[str, np.ndarray]:
    """The stored columns of a clip: uint8 `frames` (F, H, W, 3), decoding only the kept frames, resized in the
    decoder, then cut to the crop box; i2i: also its source image, `condition_frames` (1, H, W, 3); masked loss:
    its mask, `mask_frames` (1, H, W, 3)."""
    stored = {"frames": _decode_cropped(row.path, row.indices, row.resize, row.box)}
    for column, word, image in (("condition", "source image", row.condition), ("mask", "mask", row.mask)):
        if image is not None:
            try:
                stored[f"{column}_frames"] = _decode_cropped(image.path, (0,), image.resize, image.box)
            except MediaError as exc:
                raise MediaError(exc.reason, f"its {word} {image.path}: {exc}") from None
    return stored


def _decode_cropped(path: str, indices: tuple[int, ...], resize: tuple[int, int],
                    box: tuple[int, int, int, int]) -> np.ndarray:
    try:
        frames = decode_frames(path, indices, resize)
    except ValueError as exc:  # planned frames the file no longer has
        raise MediaError("changed_during_run", f"{path} changed after this run planned it ({exc}); materialize "
                         "the stage again") from None
    top, left, height, width = box
    return np.ascontiguousarray(frames[:, top : top + height, left : left + width])


def build_clips(
    config: LoraflowConfig, family: FamilyPlanning, model: ModelSource, store: Store,
    datasets: list[str] | None = None,
) -> ClipsReport:
    """Plan the datasets (`datasets` ids; None: every training dataset), decode what the store lacks, and write
    each dataset's manifest part of current clips (one dataset's run never touches another's part)."""
    store = store.named(config.manifest_names)  # its manifests named by what they are made from, whoever opened it
    selected = select_datasets(config, datasets)
    for dataset in selected:  # a missing source folder fails like a missing dataset folder, before any work
        sources = config.source_images(dataset)
        if sources is not None and not Path(sources.instance_data_dir or "").is_dir():
            raise FileNotFoundError(f"dataset '{sources.id}' (source images of '{dataset.id}'): instance_data_dir "
                                    f"{sources.instance_data_dir} is not a folder")
    manifest, quarantine = [], []
    probes = ProbeCache(store)
    for dataset in selected:
        rows, dropped_rows = _plan_dataset(config, family, model, dataset, probes)
        manifest, quarantine = manifest + rows, quarantine + dropped_rows
    have = store.keys("clips")
    todo = [row for row in manifest if row.key not in have]
    failed = _decode_missing(todo, store)
    quarantine += failed
    bad = {q.file for q in failed}
    manifest = [row for row in manifest if row.path not in bad]
    computed = len(todo) - len(failed)
    for dataset in selected:
        store.write_manifest("clips", [r.to_row() for r in manifest if r.dataset == dataset.id], part=dataset.id)
        store.write_manifest("quarantine", [q.to_row() for q in quarantine if q.dataset == dataset.id],
                             part=dataset.id)
    return ClipsReport(
        # Captions and repeats are part of what this asset stands for (text_embeds reads them), not of the frames.
        data_version=data_version(content_key(clip=r.key, captions=r.captions, repeats=r.repeats) for r in manifest),
        computed=computed,
        reused=len(manifest) - computed,
        quarantined=tuple(quarantine),
        buckets=tuple(tally_buckets([(r.dataset, r.height, r.width, r.num_frames) for r in manifest],
                                    _geometry(model, family))),
        dropped=dropped_table(quarantine),
        scenes=scene_table(manifest, probes),
    )


def scene_table(manifest: list[ClipRow], probes: ProbeCache) -> tuple[SceneRow, ...]:
    """Per file with scene cuts on: the scenes its cut list says, and those yielding a clip."""
    used: dict[tuple[str, str, str], set[int]] = {}
    for row in manifest:
        if row.scene is not None and row.path in probes.scene_lists:
            used.setdefault((row.dataset, row.source, row.path), set()).add(row.scene.number)
    return tuple(SceneRow(dataset, source, len(probes.scene_lists[path]) + 1, len(numbers),
                          probes.scene_lists[path], path) for (dataset, source, path), numbers in used.items())


def _plan_dataset(config: LoraflowConfig, family: FamilyPlanning, model: ModelSource,
                  dataset: DatasetConfig, probes: ProbeCache) -> tuple[list[ClipRow], list[DroppedFile]]:
    """A dataset's clips, and a quarantine row for every entry of its folder (or row of its Hugging Face dataset)
    that yields none."""
    folder_dataset, listing = readable(dataset, config.cache_dir, reads_sound_captions(family))
    planned = plan_files(config, family, model, folder_dataset, listing, probes)
    probes.commit()
    return planned


def _decode_missing(todo: list[ClipRow], store: Store, shard_clips: int = 8) -> list[DroppedFile]:
    """Decode clips the store lacks, committing a shard per bucket chunk (a killed run keeps its shards)."""
    failed: list[DroppedFile] = []
    todo = sorted(todo, key=lambda r: r.bucket)
    progress = tqdm(total=len(todo), desc="clips", unit="clip", disable=not todo)
    for start in range(0, len(todo), shard_clips):
        decoded: dict[str, list[dict[str, Any]]] = {}
        for row in todo[start : start + shard_clips]:
            try:
                decoded.setdefault(row.bucket, []).append({"key": row.key, **decode_clip(row)})
            except MediaError as exc:
                failed.append(dropped(row.dataset, row.path, exc))
            progress.update()
        for rows in decoded.values():
            store.put("clips", rows)
    progress.close()
    return failed


def _geometry(model: ModelSource, family: FamilyPlanning) -> LatentGeometry | None:
    """The VAE's factors for the latent estimate; None (estimate unknown) when the checkpoint has no vae config."""
    try:
        return latent_geometry(model, family)
    except FileNotFoundError as exc:
        log.warning("no latent estimate: %s", exc)
        return None


def dropped_table(quarantine: list[DroppedFile]) -> tuple[DropReason, ...]:
    """Why files were dropped: one row per (dataset, reason) with a count and its first file's detail as example."""
    files = Counter((q.dataset, q.reason) for q in quarantine)
    example = {}
    for q in quarantine:
        example.setdefault((q.dataset, q.reason), q.detail)
    return tuple(DropReason(dataset, reason, count, example[dataset, reason])
                 for (dataset, reason), count in sorted(files.items()))
