"""Where SimpleTuner finds the files and folders its config names, and reading them.

SimpleTuner runs from its own folder and reads `config/config.json` there (helpers/configuration/json_file.py
`_candidate_json_paths`, at defaults.COMMIT), so a relative path in its config starts from that folder: the parent of
`config/` (`simpletuner_root`). A path starting `config/examples/` is its package's examples folder instead
(json_file.py `_resolve_example_path`: simpletuner/examples/...). Files it opens as given (`user_prompt_library`,
safety_check.py:95 `os.path.exists`; `lycoris_config`, trainer.py:3393; the dataset list) resolve from there; loraflow
reads a config's JSON files relative to the YAML (config/loraflow_config.py `parse_config`), so the importer writes
each found file absolute. Folders (`output_dir`, `cache_dir`, a dataset's `instance_data_dir`) are read from the
working directory by both: the import says where that is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraflow.simpletuner.imported import Imported, is_text

EXAMPLES = "config/examples/"
# Files a loraflow config names, read relative to the YAML: written absolute, as SimpleTuner found them
FILE_KEYS = ("user_prompt_library", "validation_adapter_config", "init_lora")
FOLDER_KEYS = ("output_dir", "cache_dir")


class ImportProblem(ValueError):
    """Input that is not SimpleTuner's shape: the message names the file or key and what to do."""


def json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        if not path.is_file():
            raise ImportProblem(f"{path} does not exist (or is not a file)")
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ImportProblem(f"{path} is not valid JSON: {exc}; fix it (SimpleTuner reads it with json.load)") from None
    except UnicodeDecodeError:
        raise ImportProblem(f"{path} is not UTF-8 text: save it as UTF-8 JSON") from None
    except RecursionError:
        raise ImportProblem(f"{path} nests deeper than Python's JSON reader goes: it is no SimpleTuner config") \
            from None
    except OSError as exc:
        raise ImportProblem(f"{path} cannot be read ({exc.strerror or exc}): check its permissions") from None


def simpletuner_root(base_dir: Path | None) -> Path:
    """SimpleTuner's folder, where its relative paths start: the folder holding the `config/` that holds config.json
    (also `config/<env>/config.json`); for a config.json elsewhere, its folder's parent (the layout's guess)."""
    if base_dir is None:
        return Path.cwd()
    here = Path.cwd() / base_dir
    for folder in (here, *here.parents):
        if folder.name == "config":
            return folder.parent
    return here.parent


def candidates(value: str, base_dir: Path | None) -> list[Path]:
    """Where SimpleTuner may read `value` from, in order: its examples folder (config/examples/...), its root, the
    config file's folder, the working directory."""
    path = Path(value)
    if path.is_absolute():
        return [path]
    found = []
    here = Path.cwd() / (base_dir or Path())
    if value.startswith(EXAMPLES):
        found += [folder / path.relative_to("config") for folder in (here, *here.parents)]
    return found + [simpletuner_root(base_dir) / path, here / path, Path.cwd() / path]


def find(value: str, base_dir: Path | None) -> Path | None:
    """The file `value` names, found as SimpleTuner finds it, or None."""
    for candidate in candidates(value, base_dir):
        try:
            if candidate.is_file():
                return candidate.resolve()
        except (OSError, ValueError):  # a name too long, or with a NUL: no such file
            continue
    return None


def file_settings(out: Imported, base_dir: Path | None, root: Path) -> None:
    """Each relative file the config names (`FILE_KEYS`), written absolute: where it was found, else where
    SimpleTuner would read it."""
    for key in FILE_KEYS:
        value = out.config.get(key)
        if not is_text(value) or not value or Path(value).is_absolute():
            continue
        found = find(value, base_dir)
        if found is not None:
            out.config[key] = str(found)
            out.notes.append(f"{key} {value!r} is {found}, where SimpleTuner reads it: written absolute")
        elif key != "init_lora":
            out.config[key] = str(root / value)
            out.notes.append(f"{key} {value!r} was not found; SimpleTuner reads it from {root / value} (its folder, "
                             "the parent of config/): written so, put the file there or change the path")


def folder_note(config: dict[str, Any], root: Path) -> str | None:
    """Where relative folders point: the working directory, in SimpleTuner and loraflow alike."""
    named = [f"{k} {config[k]}" for k in FOLDER_KEYS if is_text(config.get(k)) and not Path(config[k]).is_absolute()]
    for dataset in config.get("datasets") or []:
        folder = dataset.get("instance_data_dir")
        if is_text(folder) and not Path(folder).is_absolute():
            named.append(f"datasets {dataset.get('id')!r} instance_data_dir {folder}")
    if not named:
        return None
    return (f"relative folders ({'; '.join(named)}) are read from the working directory, as SimpleTuner reads them "
            f"from its folder: run loraflow from {root} for the same ones")
