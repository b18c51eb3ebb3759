"""What each config field does to a training run's key: the config's base model (`StrictModel`), its field
(`setting`, which declares `run_key`) and the fields a run's key hashes (`run_key_settings`, what `run_dir` reads).

Every model of the config derives from `StrictModel`, whose subclasses fail at import when a field forgot its rule.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

# What a field does to a training run's key (`run_key_settings`), declared by every field of the config:
#   always:   part of every run's key
#   never:    how a run computes or what validation renders, never what training computes: changing it keeps the run
#   when_set: part of the key only away from its default, so a field added after runs exist leaves theirs alone
RunKey = Literal["always", "never", "when_set"]


def setting(default: Any = ..., *, run_key: RunKey, **kwargs: Any) -> Any:
    """A config field (pydantic `Field`) that declares what it does to the run key."""
    return Field(default, json_schema_extra={"run_key": run_key}, **kwargs)


def run_key_of(model: type[BaseModel], name: str) -> RunKey:
    extra = model.model_fields[name].json_schema_extra
    rule = extra.get("run_key") if isinstance(extra, dict) else None
    if rule not in get_args(RunKey):
        raise TypeError(f"config field `{model.__name__}.{name}` does not declare what it does to the run key: define "
                        f"it with `setting(..., run_key=...)`, run_key one of {', '.join(get_args(RunKey))}")
    return rule  # type: ignore[return-value]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name in cls.model_fields:  # a field that forgot its run key fails at import
            run_key_of(cls, name)


def run_key_settings(model: StrictModel) -> dict[str, Any]:
    """The fields of `model` (nested models too) that change a run's key, as JSON: what `run_dir` hashes."""
    kept = {}
    for name, info in type(model).model_fields.items():
        rule, value = run_key_of(type(model), name), getattr(model, name)
        if rule == "always" or (rule == "when_set" and value != info.get_default(call_default_factory=True)):
            kept[name] = _as_json(value)
    return kept


def _as_json(value: Any) -> Any:
    if isinstance(value, StrictModel):
        return run_key_settings(value)
    if isinstance(value, tuple):
        return [_as_json(v) for v in value]
    return to_jsonable_python(value)
