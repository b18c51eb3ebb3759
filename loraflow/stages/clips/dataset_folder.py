"""What a dataset folder holds: the media files the clips stage reads, and a reason for every other entry.

Nothing in a folder vanishes without a line. Each entry is a media file (clips, or a quarantine row of its own
later), the caption or metadata file of one, or a row here:
`not_a_file` (a folder, fifo or socket named like media; a folder's own files are still read), `linked_folder` (a
link to a folder: not followed, links can loop or leave the dataset), `broken_link` (a link to nothing, or a loop),
`unsupported_format` (media datasets do not take: GIF, HEIC, WMV, ...), `hidden_file` (a
hidden file named like media: the dataset_watch sensor does not watch hidden files, so they are not read),
`link_outside` (a media file that is a link leading outside the dataset folder: not read unless the dataset says
`allow_links_outside: true`; captions, metadata files and masks are held to the same test, `link_outside()`, where
they are read),
`unreadable` (a folder the OS will not list) and `not_used` (any other file nothing reads: a caption whose video is
gone, a scene's caption NAME.nnnn.txt while `video.scene_cuts` is off, `.txt` files under a caption_strategy other
than textfile, notes; `.txt` in any case, as cameras and Windows tools write `.TXT`). Other hidden entries
(.DS_Store, .git) are not data: neither read nor listed. A sound caption (`a.audio.txt`, `a.speech.txt` beside
`a.mp4`: stages/clips/captions.py) is read where the family reads them (`sound_captions`) and is `not_used`
elsewhere; `a.audio.txt` beside a video `a.audio.*` is that video's caption.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from loraflow.config.dataset import DatasetConfig
from loraflow.media.types import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError

T = TypeVar("T")
SCENE_CAPTION = re.compile(r"^(?P<stem>.+)\.(?P<scene>\d{4,})$")  # a scene's caption file's stem: NAME.nnnn

MEDIA_EXTENSIONS = VIDEO_EXTENSIONS | IMAGE_EXTENSIONS
# Formats FFmpeg or Pillow read that datasets do not take: named, so that each is reported with how to convert it.
# (HEIC/HEIF and JPEG XL: this Pillow has no decoder for them.)
OTHER_MEDIA_EXTENSIONS = frozenset({
    ".gif", ".apng", ".bmp", ".heic", ".heif", ".jxl", ".wmv", ".flv", ".3gp", ".ogv", ".y4m",
})


SOUND_CAPTION_KINDS = ("audio", "speech")  # NAME.audio.txt, NAME.speech.txt


@dataclass
class Listing:
    files: list[Path] = field(default_factory=list)  # media files: each becomes clips or its own quarantine row
    others: list[tuple[Path, MediaError]] = field(default_factory=list)  # every other entry, with why


def list_folder(dataset: DatasetConfig, sound_captions: bool = False) -> Listing:
    """Walk `instance_data_dir` (links to folders not followed), sorting every entry into files and others;
    `sound_captions`: the family reads NAME.audio.txt and NAME.speech.txt (`FamilySpec.compose_prompt`)."""
    root = Path(dataset.instance_data_dir or "")
    if not root.is_dir():
        raise FileNotFoundError(f"dataset '{dataset.id}': instance_data_dir {root} is not a folder")
    listing, plain, media_stems = Listing(), [], set()
    for folder, dirs, names in os.walk(root, onerror=lambda exc: listing.others.append(_unlistable(exc))):
        here = Path(folder)
        media_stems |= {(here, Path(n).stem) for n in [*dirs, *names] if _media_name(n)}  # whose captions these are
        dirs[:] = [d for d in dirs if not d.startswith(".") and _walk_into(here / d, listing)]
        names = [n for n in names if not n.startswith(".") or _media_name(n)]
        for name in names:
            problem = _problem(here / name, dataset)
            if problem:
                listing.others.append((here / name, problem))
            elif _media_name(name, MEDIA_EXTENSIONS):
                listing.files.append(here / name)
            else:
                plain.append(here / name)
    listing.others += [(p, e) for p in plain if (e := _unused(p, dataset, root, media_stems, sound_captions))]
    listing.files.sort()
    listing.others.sort(key=lambda item: item[0])
    return listing


def _media_name(name: str, extensions: frozenset[str] = MEDIA_EXTENSIONS | OTHER_MEDIA_EXTENSIONS) -> bool:
    return Path(name).suffix.lower() in extensions


def _walk_into(path: Path, listing: Listing) -> bool:
    """Whether the walk enters a folder; a linked one, or one named like media, also gets a row."""
    if path.is_symlink():
        listing.others.append((path, MediaError(
            "linked_folder", f"{printable(path.name)}: a link to a folder ({printable(os.readlink(path))}); links to "
            "folders are not followed (they can loop or leave the dataset): link or copy the files themselves")))
        return False
    if _media_name(path.name):
        listing.others.append((path, MediaError(
            "not_a_file", f"{printable(path.name)}: a folder named like a video or image, not one; the files in it, "
                          "if any, are read on their own")))
    return True


def _problem(path: Path, dataset: DatasetConfig) -> MediaError | None:
    """Why an entry that is not a folder cannot be read as a file (None: it can)."""
    name = printable(path.name)
    try:
        mode = path.stat().st_mode
    except OSError as exc:  # listed a moment ago: a link to nothing or to itself, or a file deleted since
        return _unstattable(path, exc)
    if not stat.S_ISREG(mode):
        return MediaError("not_a_file", f"{name}: not a regular file (a fifo, socket or device); remove it")
    if path.name.startswith("."):
        return MediaError("hidden_file", f"{name}: hidden files are not read (dataset_watch does not watch them); "
                                         "rename it without the leading dot to train on it")
    if _media_name(path.name, OTHER_MEDIA_EXTENSIONS):
        return MediaError("unsupported_format", f"{name}: {path.suffix.lower()} is not read (datasets take "
                          f"{', '.join(sorted(MEDIA_EXTENSIONS))}); convert it: a video or animated image with "
                          f"`ffmpeg -i '{name}' -pix_fmt yuv420p '{printable(path.stem)}.mp4'`, a still image to .png")
    return link_outside(path, dataset) if _media_name(path.name, MEDIA_EXTENSIONS) else None


def link_outside(path: Path, dataset: DatasetConfig) -> MediaError | None:
    """The quarantine row's error if `path` (a file of `dataset`'s folder, or one the dataset names) leads outside
    that folder: a link from someone else's archive can pull any readable file (/etc/passwd) into caches and logs.
    None: it is inside, or the dataset says `allow_links_outside: true`. The one test of "inside the dataset": call
    it before reading a file."""
    root, target = Path(dataset.instance_data_dir or "").resolve(), path.resolve()
    if dataset.allow_links_outside or target == root or root in target.parents:
        return None
    return MediaError("link_outside", f"{printable(path.name)} leads to {printable(target)}, outside the dataset "
                      f"folder; files outside a dataset are not read: if you linked it there yourself, set "
                      f"`allow_links_outside: true` on dataset '{dataset.id}'")


def _unstattable(path: Path, exc: OSError) -> MediaError:
    name = printable(path.name)
    if exc.errno == errno.ELOOP:
        return MediaError("broken_link", f"{name}: a symlink loop (it leads back to itself); remove or re-point it")
    if path.is_symlink():
        return MediaError("broken_link", f"{name}: a link to {printable(os.readlink(path))}, which does not exist; "
                                         "remove it or restore the file")
    return MediaError("unreadable", f"{name}: {exc.strerror or exc}; check that the file is still there and readable")


def _unused(path: Path, dataset: DatasetConfig, root: Path, media_stems: set[tuple[Path, str]],
            sound_captions: bool = False) -> MediaError | None:
    """None for a caption or metadata file a source reads; otherwise why nothing reads the file."""
    name, strategy = printable(path.name), dataset.caption_strategy
    if strategy == "metadata" and path.resolve() == (root / (dataset.metadata_file or "")).resolve():
        return None  # an absolute metadata_file stays absolute under the join
    caption = path.suffix.lower() == ".txt"
    if caption and strategy in ("textfile", "auto"):
        if (path.parent, path.stem) in media_stems:
            return None
        owner, _, kind = path.stem.rpartition(".")
        if kind in SOUND_CAPTION_KINDS and (path.parent, owner) in media_stems:
            if sound_captions:
                return None
            return MediaError("not_used", f"{name}: the {kind} caption of {printable(owner)}.*, which this model "
                                          "family does not read (its prompts do not describe the sound)")
        scene = SCENE_CAPTION.match(path.stem)
        if scene and (path.parent, scene["stem"]) in media_stems:
            if dataset.video.scene_cuts == "detect":
                return None  # a scene's own caption (captions.read_scene_captions)
            return MediaError("not_used", f"{name}: the caption of scene {int(scene['scene'])} of "
                              f"{printable(scene['stem'])}.*, but scene cuts are off; nothing reads it (`video."
                              "scene_cuts: detect` would)")
        return MediaError("not_used", f"{name}: a caption with no video or image named {printable(path.stem)}.* "
                                      "beside it; nothing reads it")
    if caption:
        return MediaError("not_used", f"{name}: caption_strategy {strategy} reads no .txt files; nothing reads it "
                                      "(caption_strategy textfile would)")
    return MediaError("not_used", f"{name}: not a video, image or caption file; nothing reads it")


def _unlistable(exc: OSError) -> tuple[Path, MediaError]:
    path = Path(exc.filename or "")
    return path, MediaError("unreadable", f"{printable(path.name)}: the folder cannot be listed "
                                          f"({exc.strerror or exc}); its files are not read: check its permissions")


def printable(path: str | Path) -> str:
    """The path as text that always encodes (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def read_or_quarantine(read: Callable[[], T], path: Path) -> T:
    """`read()` of a source file; an OSError (the file deleted or moved since it was listed, no permission) is
    that file's problem, quarantined as `unreadable`, not the stage's. Store errors are never caught here."""
    try:
        return read()
    except OSError as exc:
        raise MediaError("unreadable", f"{printable(path)}: {exc.strerror or exc}; check that the file is still "
                         "there and readable") from None
