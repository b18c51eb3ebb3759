"""The clips stage's manifest rows, typed: a clip (`ClipRow`, the `clips` manifest) and a file that yields none
(`DroppedFile`, the `quarantine` manifest). One schema each, shared by the stage that writes them, the store writer,
every reader and the clips report.

Frozen dataclasses rather than TypedDicts: a row is one value passed through six stages, and a dataclass lets the
optional paired image (i2i's source image or a loss mask) be one field holding four columns instead of four keys
that are there or not; readers get attributes a type checker follows and nothing can change a row in flight.
`to_row()`/`from_row()` are the store boundary: the Parquet columns, their order and values are those the stage has
always written (a clip without a paired image has no `condition*`/`mask*` columns), so no stored manifest changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow.keys import content_key, file_identity

if TYPE_CHECKING:  # annotations only: contracts stay free of the store's imports
    from loraflow.store import Store

PAIRED_COLUMNS = ("condition", "mask")  # a ClipRow field each, and the prefix of its columns


@dataclass(frozen=True)
class PairedImage:
    """An image cut like its clip (same bucket size, crop style and seed): i2i's source image (`condition`, which the
    text_embeds stage keys i2i prompts by) or a loss mask (`mask`, contracts/masks.py)."""

    key: str  # content key of the image's file identity, resize and box
    path: str
    resize: tuple[int, int]  # (height, width) the decoder resizes to
    box: tuple[int, int, int, int]  # (top, left, height, width) cut from the resized image


@dataclass(frozen=True)
class ClipScene:
    """Where a clip of a long recording sits (`video.scene_cuts: detect`): its scene and its span of the source."""

    number: int  # the scene, from 1 (the caption file NAME.nnnn.txt of scene nnnn: captions.read_scene_captions)
    start_s: float  # the clip's first frame, seconds after the file's first frame
    end_s: float  # the end of its last frame (that frame's time and one frame of the source)


@dataclass(frozen=True)
class ClipRow:
    """One clip of a source file: which frames, at which bucket size and crop, with the file's captions."""

    key: str  # content key: source identity, indices, size, crop style, code version (and the paired image's key)
    dataset: str
    source: str  # the dataset-relative path: stable across machines and re-encodes
    path: str  # where the file is on this machine
    bucket: str  # WIDTHxHEIGHT@FRAMES
    height: int
    width: int
    num_frames: int
    indices: tuple[int, ...]  # source frame indices
    resize: tuple[int, int]
    box: tuple[int, int, int, int]
    captions: tuple[str, ...]
    repeats: int
    # `source_version` of the file when it was cached ("": a manifest written before it was recorded)
    source_version: str = ""
    condition: PairedImage | None = None
    mask: PairedImage | None = None
    # The file's audio caption, where the family composes it into `captions` (Kandinsky 6: `FamilySpec.compose_prompt`;
    # `captions` are then the composed texts); "" none, and the manifest has no such column
    audio_caption: str = ""
    scene: ClipScene | None = None  # scene cuts on; off, the row has no scene columns (its manifest as it was)

    @property
    def condition_key(self) -> str:
        """The i2i source image's key, which its prompts are encoded with (the text stage's image id); "" else."""
        return self.condition.key if self.condition else ""

    def to_row(self) -> dict[str, Any]:
        """The manifest's columns (lists where Parquet stores lists)."""
        row: dict[str, Any] = {
            "key": self.key, "dataset": self.dataset, "source": self.source, "path": self.path,
            "bucket": self.bucket, "height": self.height, "width": self.width, "num_frames": self.num_frames,
            "indices": list(self.indices), "resize": list(self.resize), "box": list(self.box),
            "captions": list(self.captions), "repeats": self.repeats, "source_version": self.source_version,
        }
        if self.audio_caption:
            row["audio_caption"] = self.audio_caption
        for column in PAIRED_COLUMNS:
            image = getattr(self, column)
            if image is not None:
                row |= {column: image.key, f"{column}_path": image.path, f"{column}_resize": list(image.resize),
                        f"{column}_box": list(image.box)}
        if self.scene is not None:
            row |= {"scene": self.scene.number, "start_s": self.scene.start_s, "end_s": self.scene.end_s}
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ClipRow:
        paired = {column: PairedImage(row[column], row[f"{column}_path"], tuple(row[f"{column}_resize"]),
                                      tuple(row[f"{column}_box"]))
                  for column in PAIRED_COLUMNS if row.get(column)}  # a clip without one has no such columns
        scene = ClipScene(row["scene"], row["start_s"], row["end_s"]) if row.get("scene") is not None else None
        return cls(key=row["key"], dataset=row["dataset"], source=row["source"], path=row["path"],
                   bucket=row["bucket"], height=row["height"], width=row["width"], num_frames=row["num_frames"],
                   indices=tuple(row["indices"]), resize=tuple(row["resize"]), box=tuple(row["box"]),
                   captions=tuple(row["captions"]), repeats=row["repeats"],
                   source_version=row.get("source_version") or "", audio_caption=row.get("audio_caption") or "",
                   scene=scene, **paired)


def read_clips(store: Store, parts: Iterable[str] | None = None, captioned: bool = True) -> list[ClipRow]:
    """The current clips (of the datasets `parts`; None: every dataset) as the stage wrote them. `captioned`: a clip
    without captions (`caption_strategy: auto`, no user caption) takes its caption from the `captions` stage's
    manifest where that has one (stages/captions/captions.py); without, it keeps none (`uncaptioned()` lists them)."""
    clips = [_clip(store, row) for row in store.read_manifest("clips", parts=parts)]
    waiting = {clip.dataset for clip in clips if not clip.captions}
    if not captioned or not waiting:
        return clips
    there = [part for part in store.manifest_parts("captions") if part in waiting]
    made = {row["clip"]: row["caption"] for row in store.read_manifest("captions", parts=there)} if there else {}
    return [replace(clip, captions=(made[clip.key],)) if not clip.captions and clip.key in made else clip
            for clip in clips]


def _clip(store: Store, row: Mapping[str, Any]) -> ClipRow:
    """A clips manifest row as a ClipRow; a row of another schema names its manifest file (CacheFileRefused)."""
    from loraflow.store import CacheFileRefused

    try:
        return ClipRow.from_row(row)
    except (KeyError, TypeError, ValueError) as exc:
        parts = store.manifest_parts("clips")
        named = [row["dataset"]] if row.get("dataset") in parts else parts  # its own part, else every one it may be
        where = " or ".join(store.manifest_file("clips", part) for part in named) or store.manifest_file("clips")
        raise CacheFileRefused(where, f"is not a clips manifest loraflow wrote ({type(exc).__name__}: "
                               f"{str(exc)[:100]})") from None


def stored_clips(store: Store, limit: int) -> list[dict[str, Any]]:
    """The stored rows (`frames`; i2i: `condition_frames`) of the first `limit` current clips, in manifest order: what
    the clips asset's preview shows (`media.previews.clip_preview`)."""
    keys = [clip.key for clip in read_clips(store, captioned=False)][:limit]
    stored = store.get("clips", keys)
    return [stored[key] for key in keys]


def uncaptioned(clips: Iterable[ClipRow]) -> str:
    """"" when every clip has a caption; else what to run, per dataset (`caption_strategy: auto`, not captioned yet)."""
    missing = sorted({clip.dataset for clip in clips if not clip.captions})
    return "".join(f"dataset '{d}' (caption_strategy auto) has clips without a caption yet: materialize the `captions` "
                   f"asset for it (partition '{d}'; `loraflow cache CONFIG --dataset {d}`) first\n" for d in missing)


def source_version(identity: Mapping[str, Any]) -> str:
    """What a clip row records of its source file, from `keys.file_identity` (dataset-relative path, size, mtime):
    replacing or touching the file changes it."""
    return content_key(source=identity)


@dataclass(frozen=True)
class ChangedSource:
    """A clip source whose file is no longer the one its cached clips were cut from."""

    dataset: str
    source: str  # the dataset-relative path
    change: str  # "changed" (another size or mtime) or "deleted"


def changed_sources(store: Store, folders: Mapping[str, str]) -> list[ChangedSource]:
    """The cached clips' sources (of the datasets in `folders`: id -> instance_data_dir) that changed or went away
    since they were cached: one stat per source file, nothing read. Nothing cached yet: []."""
    try:
        clips = read_clips(store, parts=[p for p in folders if p in store.manifest_parts("clips")])
    except FileNotFoundError:
        return []
    judged: dict[tuple[str, str], str] = {}
    for clip in clips:
        if not clip.source_version or (clip.dataset, clip.source) in judged:
            continue  # cached before versions were recorded: not judged
        folder = folders[clip.dataset]
        try:
            now = source_version(file_identity(Path(folder) / clip.source, folder))
        except (FileNotFoundError, NotADirectoryError):  # or the dataset folder is now a file
            judged[(clip.dataset, clip.source)] = "deleted"
            continue
        judged[(clip.dataset, clip.source)] = "" if now == clip.source_version else "changed"
    return [ChangedSource(dataset, source, change) for (dataset, source), change in judged.items() if change]


def changed_sources_warning(changed: list[ChangedSource]) -> str:
    """One warning for the run, `loraflow check` and the UI: the files per dataset and what refreshes them."""
    lines = []
    for dataset in sorted({c.dataset for c in changed}):
        files = [f"{c.source} ({c.change})" for c in changed if c.dataset == dataset]
        shown = ", ".join(files[:10]) + (f" and {len(files) - 10} more" if len(files) > 10 else "")
        lines.append(f"dataset '{dataset}': {len(files)} source file(s) changed since it was cached: {shown}. "
                     f"Training reads the clips cached before; re-cache it with the `cache_dataset` job (partition "
                     f"'{dataset}'; `loraflow cache CONFIG --dataset {dataset}`), then run `train_and_validate`")
    return "\n".join(lines)


@dataclass(frozen=True)
class DroppedFile:
    """A source file that yields no clip: a row of the store's `quarantine` manifest (and of `loraflow check`'s
    dropped table)."""

    dataset: str
    file: str  # printable: a name that is not UTF-8 shows its bytes escaped
    reason: str  # a short machine code (MediaError.reason)
    detail: str  # what was wrong and what to do

    def to_row(self) -> dict[str, str]:
        return asdict(self)
