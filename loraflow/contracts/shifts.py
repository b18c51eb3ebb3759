"""The two sigma shifts of a run, one rule for every family: the one training draws with and the one renders sample
with, each with where it comes from (`loraflow check` prints both and warns when they differ). No torch.

Renders: `validation_flow_shift`, else the checkpoint's own scheduler config (what its pipeline renders with), else
the flavour's cited `flow_shift`.
Training: `flow_schedule_shift`, else (`flow_schedule_auto_shift`) the token count's, else the checkpoint's scheduler
config where the flavour's released recipe is to train at the shift it renders at (`Flavour.training_shift_from_
checkpoint`: Kandinsky 6, whose release states no training shift), else the flavour's cited `training_shift` (a
guide's training default: Kandinsky 5, HunyuanVideo 1.5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.pipelines.flavours import Flavour

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.sources import ModelSource

SCHEDULER_CONFIG = "scheduler/scheduler_config.json"


@dataclass(frozen=True)
class Shift:
    value: float | None  # None: set per step from the token count (`flow_schedule_auto_shift`)
    source: str  # where it comes from, for `loraflow check`


def scheduler_shift(model: ModelSource | str | Path | None) -> float | None:
    """The sigma shift the checkpoint's own scheduler config names (what its pipeline renders with), or None (no
    model on disk, no such config, no shift in it)."""
    if model is None:
        return None
    from loraflow.pipelines.sources import as_source

    config = as_source(model).folder("scheduler") / "scheduler_config.json"
    shift = json.loads(config.read_text()).get("shift") if config.is_file() else None
    return float(shift) if shift is not None else None


def render_shift(config: LoraflowConfig, flavour: Flavour, model: ModelSource | str | Path | None) -> Shift:
    if config.validation_flow_shift is not None:
        return Shift(config.validation_flow_shift, "validation_flow_shift")
    from_checkpoint = scheduler_shift(model)
    if from_checkpoint is not None:
        return Shift(from_checkpoint, f"the checkpoint's {SCHEDULER_CONFIG}")
    return Shift(flavour.flow_shift, f"flavour '{flavour.name}' flow_shift ({flavour.source('flow_shift')})")


def training_shift(config: LoraflowConfig, flavour: Flavour, model: ModelSource | str | Path | None) -> Shift:
    if config.flow_schedule_shift is not None:
        return Shift(config.flow_schedule_shift, "flow_schedule_shift")
    if config.flow_schedule_auto_shift:
        return Shift(None, "flow_schedule_auto_shift (by each batch's token count)")
    from_checkpoint = scheduler_shift(model) if flavour.training_shift_from_checkpoint else None
    if from_checkpoint is not None:
        return Shift(from_checkpoint, f"the checkpoint's {SCHEDULER_CONFIG} (flavour '{flavour.name}' trains at its "
                                      "render shift)")
    return Shift(float(flavour.training_shift or flavour.flow_shift),
                 f"flavour '{flavour.name}' training_shift ({flavour.source('training_shift')})")


def shifts_warning(training: Shift, render: Shift) -> str:
    """`loraflow check`'s warning when training and renders sample different sigma shifts ("" when they agree)."""
    if training.value is None or training.value == render.value:
        return ""
    return (f"training draws sigmas at shift {training.value:g} ({training.source}), renders sample at shift "
            f"{render.value:g} ({render.source}): set flow_schedule_shift or validation_flow_shift if they should "
            "agree")
