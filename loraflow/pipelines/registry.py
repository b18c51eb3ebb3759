"""The family registry: `FAMILIES` (family name -> the spec module holding its `SPEC`), what a config's two keys pick
(`get_family`: the adapter; `plan_family`: its plain data for planning, `FamilyPlanning` what planning asks of
either), and the blocks bucket sides come in (a spec's `bucket_rule`).

A family's `SPEC` (`flavours.FamilySpec`: flavours, default flavour, description, SimpleTuner names) is plain data at
the top of its `spec.py`, read here when a config is validated; the adapter lives in `SPEC.module` (its `family.py`)
and the tiny builder in `SPEC.tiny_module` (its `tiny.py`), imported only when needed. docs/families.md says how to
add one; `loraflow.pipelines` re-exports these names.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.flavours import BucketBlocks, FamilySpec, Flavour
    from loraflow.pipelines.sources import ModelSource


class FamilyPlanning(Protocol):
    """What planning asks of a family (the clips stage, bucket plans, `loraflow check`, the estimates' inputs):
    `FamilyPlan` answers it from the family's plain `SPEC` (no torch), and the family object (`ModelFamily`) alike."""

    name: str
    flavour: Flavour
    spatial_multiple: int  # pixel sizes must be multiples of this (VAE factor x patch size)
    vae_temporal_factor: int
    max_text_tokens: int

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        """Why a clip of this bucket size cannot be trained ("" when it can), known before decoding."""


class FamilyChoice(Protocol):
    """What picks a family: the config's two keys (the config model imports this package, never the reverse)."""

    model_family: str
    model_flavour: str | None


# model_family -> the module whose `SPEC` declares it. Each of these keeps torch and diffusers out of its imports
# (its SPEC.module has them), so validating a config and loading the code location import neither.
FAMILIES: dict[str, str] = {
    "kandinsky5-video": "loraflow.pipelines.kandinsky5.video.spec",
    "kandinsky5-image": "loraflow.pipelines.kandinsky5.image.spec",
    "hunyuanvideo-1.5": "loraflow.pipelines.hunyuanvideo15.spec",
    "kandinsky6": "loraflow.pipelines.kandinsky6.spec",
}


def family_names() -> list[str]:
    return sorted(FAMILIES)


def family_spec(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {family_names()}")
    spec = importlib.import_module(FAMILIES[name]).SPEC
    if spec.name != name:
        raise ValueError(f"FAMILIES row {name!r} names {FAMILIES[name]}, whose SPEC is family {spec.name!r}")
    return spec


def family_specs() -> list[FamilySpec]:
    return [family_spec(name) for name in FAMILIES]


def describe_families() -> str:
    """One line per family for the config's help: name (description)."""
    return " | ".join(f"{spec.name} ({spec.description})" for spec in family_specs())


def flavour_names(family: str) -> list[str]:
    return family_spec(family).flavour_names()


def known_flavour(family: str | None, flavour: str | None) -> Flavour | None:
    """The flavour a config's two keys pick, or None when either names nothing registered (validation says so)."""
    if not isinstance(family, str) or family not in FAMILIES:  # any YAML value: validation names a wrong one
        return None
    if flavour is not None and (not isinstance(flavour, str) or flavour not in flavour_names(family)):
        return None
    return family_flavour(family, flavour)


def family_flavour(family: str, flavour: str | None) -> Flavour:
    """The family's flavour called `flavour` (None: its default)."""
    return family_spec(family).flavour(flavour)


def load_family(name: str, flavour: str | None = None) -> ModelFamily:
    """The family object bound to a flavour (None: the family's default); imports the family's torch side."""
    return importlib.import_module(family_spec(name).module).make_family(flavour)


def get_family(config: FamilyChoice) -> ModelFamily:
    """The family object for a config, bound to its flavour (the family's default when unset)."""
    family = load_family(config.model_family, config.model_flavour)
    if getattr(config, "i2v_mode", "first") == "first_last":  # validated by the config: a clean-frame i2v flavour
        family = replace(family, flavour=replace(family.flavour, last_frame_given=True))
    template = getattr(config, "kandinsky5_prompt_template", "original")
    if template != "original":  # validated by the config: a family whose SPEC offers it
        family = replace(family, template=template)
    if getattr(config, "train_audio", False):  # validated by the config: a flavour with an audio VAE (Kandinsky 6)
        family = replace(family, trains_audio=True)
    return family


@dataclass(frozen=True)
class FamilyPlan:
    """What planning asks of a family (the clips stage, bucket plans, `loraflow check`), answered from its plain
    `SPEC`: torch and diffusers stay unimported (importing them took 6-7 s, ten times the clips stage's own work).
    The family object (`get_family`) answers the same questions."""

    spec: FamilySpec
    flavour: Flavour

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def spatial_multiple(self) -> int:
        return self.spec.spatial_multiple

    @property
    def vae_temporal_factor(self) -> int:
        return self.spec.vae_temporal_factor

    @property
    def max_text_tokens(self) -> int:
        """Caption tokens the first text encoder keeps after the template: the flavour's `text_tokens`."""
        return self.flavour.text_tokens

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        """`ModelFamily.size_problem`, from the family module only for the flavours whose spec says it checks."""
        if self.flavour.name not in self.spec.size_checked:
            return ""
        return load_family(self.spec.name, self.flavour.name).size_problem(model, height, width)

    def validation_size_problem(self, model: ModelSource | None, height: int, width: int) -> str:
        """Why validation cannot render at (height, width) ("" when it can, or cannot tell yet): a size off the
        spatial multiple, or one the flavour's pipeline would silently replace by its own (`FamilySpec.render_size`;
        `model` None: no checkpoint to ask yet)."""
        blocks = bucket_blocks(self, model)  # no model: blocks only where the flavour's mode asks them
        multiple = bucket_multiple(self, model)
        asked = f"`validation_resolution` {width}x{height}"
        if height % multiple or width % multiple:
            near = f"{nearest_multiple(width, multiple)}x{nearest_multiple(height, multiple)}"
            why = "VAE x patch" + ("" if blocks is None else f" x {blocks.short}")
            return f"{asked}: {self.name} needs multiples of {multiple} ({why}); use {near}"
        rendered = model and self.spec.render_size and self.spec.render_size(self.flavour, model, height, width)
        if rendered and rendered != (height, width):
            return (f"{asked}: {self.name} {self.flavour.name} renders at its size bucket {rendered[1]}x{rendered[0]} "
                    "(WxH) for that aspect; set validation_resolution to it, or leave it out (default: the bucket of "
                    "the image validation renders from)")
        return ""


def nearest_multiple(value: int, multiple: int) -> int:
    """The size in multiples of `multiple` nearest `value` (one multiple at least)."""
    return max(multiple, round(value / multiple) * multiple)


def plan_family(config: FamilyChoice) -> FamilyPlan:
    """The planning side of a config's family, bound to its flavour; imports no model code."""
    spec = family_spec(config.model_family)
    return FamilyPlan(spec, spec.flavour(config.model_flavour))


def bucket_blocks(family: FamilyPlanning, model: ModelSource | str | Path | None) -> BucketBlocks | None:
    """The blocks the family's bucket sides come in for this checkpoint (its spec's `bucket_rule`: Kandinsky 5's
    NABLA), None where multiples of the spatial multiple train. The rule reads the transformer's config.json on disk,
    else (not downloaded yet) the flavour's released config, which the download will bring; no model: the flavour's
    mode alone. No torch."""
    return _bucket_blocks(family.name, family.flavour, model)


@cache
def _bucket_blocks(name: str, flavour: Flavour, model: ModelSource | str | Path | None) -> BucketBlocks | None:
    spec = family_spec(name)
    if spec.bucket_rule is None:
        return None
    return spec.bucket_blocks(flavour, _transformer_config(model, flavour))


def _transformer_config(model: ModelSource | str | Path | None, flavour: Flavour) -> dict:
    if model is None:
        return {}
    from loraflow.pipelines.sources import as_source

    path = as_source(model).folder("transformer") / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from loraflow.pipelines.released import FLAVOURS, released_config

    return released_config(flavour.name, "transformer") if flavour.name in FLAVOURS else {}


def bucket_multiple(family: FamilyPlanning, model: ModelSource | str | Path | None) -> int:
    """The pixel multiple of bucket sides: the family's, times its blocks' side where its checkpoint asks blocks."""
    blocks = bucket_blocks(family, model)
    return family.spatial_multiple * (1 if blocks is None else blocks.factor)


def bucket_note(family: FamilyPlanning, model: ModelSource | str | Path) -> str:
    """`loraflow check`'s line on why the buckets are sized as they are ("" where the spatial multiple is all)."""
    blocks = bucket_blocks(family, model)
    if blocks is None:
        return ""
    return (f"{blocks.attention} (the transformer as {family.flavour.name} runs it): bucket sides are multiples of "
            f"{family.spatial_multiple * blocks.factor} px, "
            f"{family.spatial_multiple} (VAE x patch) x {blocks.factor} ({blocks.blocks}); a `resolution` off it is "
            "rounded to the nearest")
