"""A config's errors: `ConfigError` (a config that cannot run, every problem listed), and a pydantic validation error
said the way `loraflow check` prints it (`describe`): the key path, what is wrong, and for an unknown key the nearest
valid one. A value is shown by its start (`shown`): a config error never prints megabytes."""

from __future__ import annotations

import difflib
import reprlib
from typing import Any, get_args

from pydantic import BaseModel

_SHORT = reprlib.Repr()  # a few items of a list, the first 60 characters of a string, two levels deep
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60
_SHORT.maxlevel = 2


class ConfigError(ValueError):
    """A config that cannot run. `problems` lists every issue, each naming the key path."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def shown(value: Any) -> str:
    """`repr(value)` cut short: what an error prints of a value."""
    return _SHORT.repr(value)


def _nearest(key: str, model: type[BaseModel]) -> str:
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(model.model_fields)}"


def _model_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel]:
    """The pydantic model that owns the key at `loc` (for 'did you mean' suggestions)."""
    model = root
    for part in loc[:-1]:
        if not isinstance(part, int):  # an index into a tuple of models stays on that model
            model = _model_in(model.model_fields[part].annotation) or model
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside `X | None` / `tuple[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m), None)


def describe(error: dict[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error of a config whose model is `root`, as `key.path: what is wrong` (unknown keys: the nearest
    valid one)."""
    loc = error["loc"]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "config"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key{_nearest(str(loc[-1]), _model_at(loc, root))}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{path}: required key is missing"
    if "input" in error and error["type"] not in ("value_error",):
        return f"{path}: {message} (got {shown(error['input'])})"
    return f"{path}: {message}"
