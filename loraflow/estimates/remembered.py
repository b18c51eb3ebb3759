"""Estimates remembered: a `loraflow check` of an unchanged config answers from its last estimate (`remembered`, in
the user's cache folder `estimates_cache`, keyed by the config, the inputs and `code_version`)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow.estimates.fit import StageEstimate

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig


PACKAGE = Path(__file__).parents[1]  # loraflow/


@cache
def code_version(package: Path = PACKAGE) -> str:
    """What the estimates' numbers depend on besides their inputs: the loraflow package's source (every .py file
    under `package`) and the versions of the libraries that build and trace the models (their metadata: none is
    imported)."""
    import hashlib
    from importlib.metadata import version

    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for library in ("torch", "diffusers", "transformers", "peft"):
        digest.update(f"{library}=={version(library)}".encode())
    return digest.hexdigest()[:16]


def estimates_cache() -> Path:
    """Where `remembered` keeps estimates: $LORAFLOW_ESTIMATES_CACHE, else the XDG user cache (as huggingface_hub
    keeps its own)."""
    import os

    if os.environ.get("LORAFLOW_ESTIMATES_CACHE"):
        return Path(os.environ["LORAFLOW_ESTIMATES_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loraflow" / "estimates"


def remembered(config: LoraflowConfig, what: str, inputs: Mapping[str, Any],
               compute: Callable[[], list]) -> tuple[list, Path | None]:
    """`compute()` (a list of StageEstimates, or of (label, StageEstimate)), or the list a call with the same config,
    `inputs` and `code_version` stored (JSON, written atomically) in the user's cache folder (`estimates_cache`:
    `$XDG_CACHE_HOME/loraflow/estimates`, default ~/.cache; check writes nothing into the project's caches); and
    the file it was read from (None: computed now). The fake-tensor traces take minutes at released size: a second
    `check` of an unchanged config takes seconds. The libraries' warnings (and diffusers' logged ones) during
    `compute()` are not shown: they concern the traces on fake tensors, and landed above check's table.

    Before `compute()`, the objects alive (the imported libraries': millions, kept for the life of the process) are
    moved out of the cyclic garbage collector's reach for good (`gc.freeze`): the traces allocate fast, and each full
    collection walked them all (a first check of HunyuanVideo 1.5 720p: -1.6 to -2.8 s of 25-28 s CPU in 5
    interleaved pairs; unfrozen again after `compute()`, no gain). `loraflow check` is a short process; one that
    calls `check` in itself (the tests) leaves those objects to reference counting alone."""
    import gc
    from dataclasses import asdict

    from loraflow.atomic import write_json
    from loraflow.keys import content_key

    key = content_key(what=what, config=config.model_dump(mode="json"), inputs=inputs, code=code_version())
    path = estimates_cache() / f"{what}-{key}.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        rows = None
    if isinstance(rows, list):
        return [(label, StageEstimate(**row)) if label is not None else StageEstimate(**row) for label, row in rows], \
            path
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    # what diffusers logs building the fake models is no news to the user either: a released config's key this
    # diffusers does not take (Kandinsky 6's `is_multimodal`), once per traced copy
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():  # what torch and diffusers warn of on fake tensors concerns the fake run
            warnings.simplefilter("ignore")  # (a norm's dtypes a fused kernel would not take), not the user's config
            gc.freeze()
            result = compute()
    finally:
        diffusers_logging.set_verbosity(verbosity)
    rows = [[item[0], asdict(item[1])] if isinstance(item, tuple) else [None, asdict(item)] for item in result]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, rows)
    except OSError:  # a read-only cache folder: the estimate stands, unremembered
        pass
    return result, None
