"""Captions of a source file, by the dataset's `caption_strategy`.

`textfile` reads NAME.txt beside the file (the extension in any case: cameras and Windows tools write `.TXT`), one
caption per non-empty line;
`filename` uses the file's stem; `instanceprompt` the dataset's `instance_prompt`; `metadata` looks the file up in
`metadata_file` (.jsonl, .csv or .parquet with a file column - file_name, file, filename or path - holding the
dataset-relative path or the bare name, and a caption column - caption, captions, text or prompt - holding a string or a
list; repeated rows add captions); `auto` reads NAME.txt as textfile does where there is one, and leaves a file without
one to the `captions` stage (no captions here: `()`, which that stage fills). Rules, the same for every strategy: an
empty caption trains on the empty prompt; a missing caption (no .txt, not in the metadata) quarantines the file as
`missing_caption`, two caption files (`a.txt` and `a.TXT`) as `ambiguous_caption`; a caption file that is not UTF-8
quarantines it as `caption_not_utf8` (a byte-order mark is read: UTF-16 as Windows editors save "Unicode" text, and
UTF-8); a caption file or a relative metadata_file that leads outside the dataset folder as `link_outside` (unread;
`allow_links_outside`). Limits the dataset sets: more than `max_captions_per_file` captions quarantine the file as
`too_many_captions`, a caption longer than `max_caption_chars` characters as `caption_too_long` (a caption file too
large to fit both is not read past that size). A caption holding a control character (NUL, ESC, DEL, ...; tabs and line
ends are text), a bidi control (U+202A-U+202E, U+2066-U+2069) or a zero-width character (U+200B-U+200D, U+2060, and
U+FEFF past a caption's start; a leading byte-order mark is dropped) quarantines the file as `caption_control_chars`:
such a file is seldom a caption (a NUL is mostly UTF-16 saved without its byte-order mark, or binary data), a bidi or
invisible character makes the caption shown differ from the one trained on (a spoof), and stripping the characters
would train on a guess, so the user is told to fix the file.
With `video.scene_cuts: detect`, a scene may have its own caption file beside the video's, NAME.nnnn.txt for scene
nnnn (from 1, four digits: `a.0003.txt` is the third scene of a.mp4); scenes without one take the file's captions
(`read_scene_captions`).

Sound captions, read only for a family that puts them in its prompt (`FamilySpec.compose_prompt`: Kandinsky 6): the
audio caption (what the clip sounds like) is `NAME.audio.txt` beside the file (textfile; its lines joined by spaces)
or the metadata row's `audio_caption` column; speech (the spoken lines, one per line or list item) `NAME.speech.txt`
or the `speech` column. Both are optional: a clip without them keeps its plain captions. `NAME.audio.txt` where a
video or image `NAME.audio.*` is beside it is that file's own caption, never another's sound: a file whose sound
caption would be one (`a.mp4` beside `a.audio.mp4` and `a.audio.txt`) is quarantined as `ambiguous_caption`. The
caption limits hold for them as for captions.
"""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import json
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from loraflow.config.dataset import DatasetConfig
from loraflow.media.types import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError
from loraflow.stages.clips.dataset_folder import SOUND_CAPTION_KINDS, link_outside, printable, read_or_quarantine

TEXT_FILES = ("textfile", "auto")  # the strategies that read NAME.txt (and scenes' NAME.nnnn.txt)


def read_captions(path: Path, dataset: DatasetConfig) -> list[str]:
    """Captions for a file. Rule: textfile = one caption per non-empty line; an empty file is the empty
    prompt; a missing, ambiguous, outside, non-UTF-8 or over-limit file quarantines the source (MediaError)."""
    if dataset.caption_strategy == "instanceprompt":
        return _checked([dataset.instance_prompt or ""], "instance_prompt", dataset)
    if dataset.caption_strategy == "filename":
        return _checked([path.stem.replace("_", " ").replace("-", " ").strip()], path.name, dataset)
    if dataset.caption_strategy == "metadata":
        return _metadata_captions(path, dataset)
    if dataset.caption_strategy == "auto":  # a user's caption file wins; none: [], captioned by the `captions` stage
        found = _caption_file(path, required=False)
        return [] if found is None else _textfile_captions(found, dataset)
    return _textfile_captions(_caption_file(path), dataset)


def read_scene_captions(path: Path, dataset: DatasetConfig, scenes: Iterable[int]) -> dict[int, tuple[str, ...]]:
    """Captions of each of a file's `scenes` (numbers from 1; `video.scene_cuts: detect`). textfile: scene n's own
    caption file NAME.nnnn.txt (n in four digits: `a.0003.txt` is scene 3 of a.mp4) where there is one, else the
    file's NAME.txt, which is then needed (missing_caption names both); every other strategy: the file's captions,
    for every scene. An own caption file is read under the rules of NAME.txt."""
    shared: tuple[str, ...] | None = None
    captions = {}
    for number in scenes:
        own = _caption_file(_scene_path(path, number), required=False) if dataset.caption_strategy in \
            TEXT_FILES else None
        if own is not None:
            captions[number] = tuple(_textfile_captions(own, dataset))
            continue
        if shared is None:
            try:
                shared = tuple(read_captions(path, dataset))
            except MediaError as exc:
                if exc.reason != "missing_caption" or dataset.caption_strategy != "textfile":
                    raise
                own_name = printable(_scene_path(path, number).with_suffix(".txt").name)
                raise MediaError("missing_caption", f"{exc}, nor {own_name} for its scene {number} (video.scene_cuts "
                                 "detect)") from None
        captions[number] = shared
    return captions


def _scene_path(path: Path, number: int) -> Path:
    """NAME.nnnn.EXT beside `path` (NAME.EXT): its scene `number` as a file, whose caption file is NAME.nnnn.txt."""
    return path.with_name(f"{path.stem}.{number:04d}{path.suffix}")


def _textfile_captions(caption_file: Path, dataset: DatasetConfig) -> list[str]:
    if problem := link_outside(caption_file, dataset):
        raise problem
    most = _most_bytes(dataset)
    data = read_or_quarantine(lambda: _read_at_most(caption_file, most), caption_file)
    if len(data) > most:
        size = caption_file.stat().st_size / 2**20
        raise MediaError("caption_too_long", f"{printable(caption_file.name)} holds {size:.1f} MiB, more than fits "
                         f"in max_captions_per_file ({dataset.max_captions_per_file}) captions of max_caption_chars "
                         f"({dataset.max_caption_chars}) characters; it is not read: is it a caption? Raise the "
                         f"limits on dataset '{dataset.id}' if it is")
    return _checked(_clean(_text(data, caption_file).splitlines()), printable(caption_file.name), dataset)


def read_sound_captions(path: Path, dataset: DatasetConfig) -> tuple[str, tuple[str, ...]]:
    """A file's audio caption ("" none) and spoken lines (() none): NAME.audio.txt / NAME.speech.txt (textfile), the
    `audio_caption` / `speech` columns (metadata); other strategies have none. Missing is no problem; a file that
    breaks the caption rules quarantines the source as a caption file does."""
    if dataset.caption_strategy == "metadata":
        row = _metadata_row(path, dataset)
        audio = _checked([" ".join(row.audio)] if row.audio else [], f"{printable(path.name)} audio_caption", dataset)
        return (audio[0] if audio else ""), _checked(list(row.speech), f"{printable(path.name)} speech", dataset)
    if dataset.caption_strategy not in TEXT_FILES:
        return "", ()
    kinds = {kind: [line for line in _sound_caption_lines(path, kind, dataset) if line] for kind in SOUND_CAPTION_KINDS}
    audio = kinds["audio"]
    return (" ".join(audio) if audio else ""), tuple(kinds["speech"])


def _sound_caption_lines(path: Path, kind: str, dataset: DatasetConfig) -> list[str]:
    """The non-empty lines of NAME.<kind>.txt beside `path` ([] when there is none)."""
    try:
        caption_file = _caption_file(path, f".{kind}")
    except MediaError as exc:
        if exc.reason == "missing_caption":
            return []
        raise
    twin = f"{path.stem}.{kind}"
    if any(path.with_name(twin + ext).is_file() for e in MEDIA_SUFFIXES for ext in (e, e.upper())):
        raise MediaError("ambiguous_caption", f"{printable(path.name)}: {printable(caption_file.name)} is the caption "
                         f"of {printable(twin)}.*, beside it, not this file's {kind} caption; rename one of them")
    if problem := link_outside(caption_file, dataset):
        raise problem
    data = read_or_quarantine(lambda: _read_at_most(caption_file, _most_bytes(dataset)), caption_file)
    return _checked(_clean(_text(data, caption_file).splitlines()), printable(caption_file.name), dataset)


MEDIA_SUFFIXES = tuple(sorted(VIDEO_EXTENSIONS | IMAGE_EXTENSIONS))


def _most_bytes(dataset: DatasetConfig) -> int:
    return dataset.max_captions_per_file * (dataset.max_caption_chars + 2) * 4 + 4  # 4 bytes per character at most


# every case of ".txt": .txt, .TXT, .Txt, ...
_CAPTION_SUFFIXES = tuple("".join(letters) for letters in itertools.product(*zip(".txt", ".TXT")))


def _caption_file(path: Path, kind: str = "", required: bool = True) -> Path | None:
    """The caption file beside `path`: NAME.txt (`kind` ".audio": NAME.audio.txt), the extension in any case; two
    quarantine the file, and so does none where `required` (else: None)."""
    found: dict[tuple[int, int], Path] = {}
    for suffix in _CAPTION_SUFFIXES:
        candidate = path.with_suffix(kind + suffix)
        try:
            info = candidate.stat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):  # one file under two spellings (a case-insensitive disk) is one file
            found.setdefault((info.st_dev, info.st_ino), candidate)
    if not found and not required:
        return None
    if not found:
        raise MediaError("missing_caption", f"{printable(path.name)}: no caption file "
                         f"{printable(path.with_suffix(kind + '.txt').name)} (caption_strategy textfile)")
    if len(found) > 1:
        names = ", ".join(printable(p.name) for p in sorted(found.values()))
        raise MediaError("ambiguous_caption", f"{printable(path.name)}: {len(found)} caption files ({names}); keep one")
    return next(iter(found.values()))


def _read_at_most(path: Path, most: int) -> bytes:
    """The file's bytes, one past `most` at most (a larger file is not read whole)."""
    with open(path, "rb") as f:
        return f.read(most + 1)


# Control characters but tab and the line ends (line ends split a caption file's captions; a metadata caption may
# hold them), the bidi controls (embeddings, overrides, isolates: a displayed caption can be spoofed by them) and the
# zero-width characters (a byte-order mark only past a caption's start: a leading one is the mark, and dropped).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200b-\u200d\u2060]"
                      r"|(?!^)\ufeff")


def _what_control(character: str) -> str:
    """What the control character `character` mostly means in a caption, and what to do."""
    code = ord(character)
    if code == 0:
        return "a NUL mostly means UTF-16 saved without its byte-order mark, or not text"
    if code == 0x1B:
        return "an ESC begins a terminal colour or cursor code: is it a log?"
    if 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069:
        return "a bidi control reorders the text around it: the caption shown is not the caption trained on"
    if code in (0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF):
        return "a zero-width character is invisible: the caption shown is not the caption trained on"
    return "not text"


def _checked(captions: list[str], where: str, dataset: DatasetConfig) -> list[str]:
    """The captions, if they keep the dataset's limits and hold no control character; `where`: what names them."""
    if len(captions) > dataset.max_captions_per_file:
        raise MediaError("too_many_captions", f"{where}: {len(captions)} captions, more than max_captions_per_file "
                         f"({dataset.max_captions_per_file}); is it a caption file (a log, a word list)? Raise the "
                         f"limit on dataset '{dataset.id}' if it is")
    for number, caption in enumerate(captions, 1):
        if len(caption) > dataset.max_caption_chars:
            raise MediaError("caption_too_long", f"{where}: caption {number} is {len(caption)} characters, more "
                             f"than max_caption_chars ({dataset.max_caption_chars}); text encoders read its first few "
                             f"hundred tokens: shorten it, or raise the limit on dataset '{dataset.id}'")
        if control := _CONTROL.search(caption):
            raise MediaError("caption_control_chars", f"{where}: caption {number} holds the control character "
                             f"U+{ord(control.group()):04X} at character {control.start() + 1} "
                             f"({_what_control(control.group())}): re-save it as UTF-8 text without it")
    return [caption.removeprefix("\ufeff") for caption in captions]


def _clean(captions: list[str]) -> list[str]:
    return [c.strip() for c in captions if c and c.strip()] or [""]


# Windows editors save "Unicode" text as UTF-16 with a byte-order mark: the mark says how to read the file.
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _text(data: bytes, path: Path) -> str:
    """A caption or metadata file's text: UTF-16 or UTF-8 by its byte-order mark, else UTF-8."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise MediaError("caption_not_utf8", f"{path.name} is not {encoding.upper().removesuffix('-SIG')} "
                         f"({exc.reason}); re-save it as UTF-8") from None


FILE_COLUMNS = ("file_name", "file", "filename", "path")
CAPTION_COLUMNS = ("caption", "captions", "text", "prompt")
SOUND_COLUMNS = {"audio": "audio_caption", "speech": "speech"}  # read only where the family composes its prompt


@dataclass(frozen=True)
class MetadataRow:
    """What the metadata file says of one file, its rows together."""

    captions: tuple[str, ...]
    audio: tuple[str, ...] = ()  # the distinct non-empty `audio_caption` values
    speech: tuple[str, ...] = ()


def _metadata_captions(path: Path, dataset: DatasetConfig) -> list[str]:
    row = _metadata_row(path, dataset)
    relative = path.relative_to(Path(dataset.instance_data_dir or "")).as_posix()
    where = f"{printable(relative)} in {printable(Path(dataset.metadata_file or '').name)}"
    return _checked(_clean(list(row.captions)), where, dataset)


def _metadata_row(path: Path, dataset: DatasetConfig) -> MetadataRow:
    root = Path(dataset.instance_data_dir or "")
    given = Path(dataset.metadata_file or "")
    meta = given if given.is_absolute() else root / given
    if not meta.is_file():
        raise MediaError("missing_caption", f"dataset '{dataset.id}': metadata_file {meta} does not exist")
    # an absolute metadata_file is the user's own choice; a relative one is the dataset's, held to it like its files
    if not given.is_absolute() and (problem := link_outside(meta, dataset)):
        raise problem
    info = read_or_quarantine(meta.stat, meta)
    table, error = _load_metadata(str(meta), info.st_size, info.st_mtime_ns)
    if error:
        raise MediaError(*error)
    relative = path.relative_to(root).as_posix()
    for name in (relative, path.name):
        if name in table:
            return table[name]
    raise MediaError("missing_caption", f"{relative}: not in metadata_file {meta.name}; add a row for it")


@lru_cache(maxsize=8)
def _load_metadata(path: str, size: int, mtime_ns: int) -> tuple[dict[str, MetadataRow], tuple[str, str] | None]:
    """file -> its captions (and sound captions), read once per file version; a broken file is an error every
    source reports."""
    meta = Path(path)
    try:
        rows = _metadata_rows(meta)
    except MediaError as exc:
        return {}, (exc.reason, str(exc))
    except (pa.ArrowException, OSError) as exc:  # a .parquet file that is not one
        return {}, ("bad_metadata", f"{meta.name} cannot be read as Parquet ({exc}); re-export it")
    if not all(isinstance(row, dict) for row in rows):
        return {}, ("bad_metadata", f"{meta.name}: each row must be an object with a file and a caption column "
                                    "(.json/.jsonl: one object per line)")
    columns = set(rows[0]) if rows else set()
    file_col = next((c for c in FILE_COLUMNS if c in columns), None)
    caption_col = next((c for c in CAPTION_COLUMNS if c in columns), None)
    if rows and (file_col is None or caption_col is None):
        return {}, ("bad_metadata", f"{meta.name}: needs a file column ({', '.join(FILE_COLUMNS)}) and a caption "
                                    f"column ({', '.join(CAPTION_COLUMNS)}); found {sorted(columns)}")
    table: dict[str, dict[str, list[str]]] = {}
    for number, row in enumerate(rows, 1):
        if row.get(file_col) is None:
            return {}, ("bad_metadata", f"{meta.name}: row {number} has no `{file_col}` (the file column row 1 "
                                        "uses); give every row one")
        entry = table.setdefault(str(row[file_col]).removeprefix("./"), {"captions": [], "audio": [], "speech": []})
        entry["captions"] += _items(row.get(caption_col))
        for kind, column in SOUND_COLUMNS.items():
            entry[kind] += [v for v in _items(row.get(column)) if v.strip() and v not in entry[kind]]
    return {k: MetadataRow(tuple(v["captions"]), tuple(v["audio"]), tuple(v["speech"])) for k, v in table.items()}, None


def _items(value: Any) -> list[str]:
    """A metadata cell as strings: a list's items, one string, or none."""
    items = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    return [str(c) for c in items if c is not None]


def _metadata_rows(meta: Path) -> list[dict[str, Any]]:
    suffix = meta.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(meta).to_pylist()
    text = _text(meta.read_bytes(), meta)
    if suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    if suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as exc:
                raise MediaError("bad_metadata", f"{meta.name} line {number} is not JSON ({exc.msg})") from None
        return rows
    raise MediaError("bad_metadata", f"metadata_file {meta.name}: use .jsonl, .csv or .parquet")

