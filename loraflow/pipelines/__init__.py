"""Model families. Only this package knows family names: stages ask `get_family(config)` and call methods.

Adding a family = one module with a `FAMILY` object, and one row in `_MODULES`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from loraflow.pipelines.flavours import FLAVOURS

if TYPE_CHECKING:
    from loraflow.pipelines.base import ModelFamily


class FamilyChoice(Protocol):
    """What picks a family: the config's two keys (the config model imports this package, never the reverse)."""

    model_family: str
    model_flavour: str | None

_MODULES = {
    "kandinsky5-video": "loraflow.pipelines.kandinsky5_video",
    "kandinsky5-image": "loraflow.pipelines.kandinsky5_image",
    "hunyuanvideo-1.5": "loraflow.pipelines.hunyuanvideo15",
}


def family_names() -> list[str]:
    return sorted(_MODULES)


def flavour_names(family: str) -> list[str]:
    return sorted(FLAVOURS[family])


def get_family(config: FamilyChoice) -> ModelFamily:
    """The family object for a config, bound to its flavour (the family's default when unset)."""
    module = importlib.import_module(_MODULES[config.model_family])
    return module.make_family(config.model_flavour)
