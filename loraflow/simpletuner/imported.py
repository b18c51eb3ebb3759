"""What an import made: the loraflow config, every key not carried with its reason, notes, and the SimpleTuner
defaults written (each key's comment naming SimpleTuner's source line); and how it is written as YAML."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from loraflow.simpletuner.defaults import Default

WHY = {  # reasons for keys people ask about; any other unknown key is "no loraflow equivalent"
    "optimizer": "loraflow has adamw, adamw_bf16 (bf16 moments, stochastic rounding), muon (torch.optim.Muon), "
                 "prodigy (prodigyopt) and adamw_schedulefree (schedulefree's AdamWScheduleFree, its defaults)",
    "cache_dir_vae": "latents are keyed by content under the config's cache_dir",
    "frame_rate": "set `video.frame_rate` per dataset",
    "framerate": "set `video.frame_rate` per dataset",
    "num_train_epochs": "set max_train_steps",
    "report_to": "loraflow reports to tensorboard, wandb or none",
    "push_to_hub": "loraflow never uploads",
    "hub_model_id": "loraflow never uploads",
    "ema_cpu_only": "the EMA is updated where ema_device keeps it",
    "ema_foreach_disable": "torch's EMA update (get_ema_multi_avg_fn) is one foreach lerp",
}
# Keys whose reason depends on the value: (key, value) -> why; any other value of the key: (key, None) -> why.
WHY_VALUE = {
    ("text_encoder_2_precision", "no_change"): "nothing to set: loraflow runs the second text encoder (CLIP-L, "
                                               "Glyph-ByT5) unquantised in fp32, which is what no_change asks",
    ("text_encoder_2_precision", None): "the second text encoder (CLIP-L, Glyph-ByT5) is small and always runs "
                                        "unquantised in fp32",
    ("base_model_default_dtype", "bf16"): "nothing to set: it is the dtype of a quantised base model's other "
                                          "weights, which loraflow (fp8-layerwise) keeps in bf16 already",
    ("base_model_default_dtype", None): "loraflow keeps a quantised base model's other weights in bf16 "
                                        "(fp8-layerwise); for an fp32 base set base_model_precision no_change",
    ("optimizer", "sdnq-muon"): "loraflow's muon is torch.optim.Muon on the fp32 LoRA matrices, no quantised state: "
                                "set optimizer: muon",
    ("optimizer", "adamw_schedulefree+aggressive"): "loraflow runs schedulefree's AdamWScheduleFree with its own "
                                                    "defaults: set optimizer: adamw_schedulefree",
    ("optimizer", "adamw_schedulefree+no_kahan"): "loraflow runs schedulefree's AdamWScheduleFree on fp32 LoRA "
                                                  "weights, where Kahan summation has nothing to do: set optimizer: "
                                                  "adamw_schedulefree",
}


def is_text(value: Any) -> bool:
    return isinstance(value, str)


def truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


@dataclass
class Imported:
    config: dict[str, Any]
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # (key path, value, why)
    notes: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # SimpleTuner defaults not taken, each with why (defaults.LEFT)
    # (the dict holding the key: the config or one of its datasets, key, comment): SimpleTuner's defaults written
    comments: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)

    def skip(self, key: str, value: Any, why: str | None = None) -> None:
        name = key.rsplit(".", 1)[-1]
        if why is None and isinstance(value, (str, int, float)):  # a dict or list value is no key of WHY_VALUE
            why = WHY_VALUE.get((name, value))
        why = why or WHY_VALUE.get((name, None)) or WHY.get(name, "no loraflow equivalent")
        self.unmapped.append((key, value, why))

    def default(self, default: Default, where: dict[str, Any] | None = None) -> None:
        """Write SimpleTuner's default for a key its config leaves unset, with its source line as the comment."""
        holder = self.config if where is None else where
        holder[default.key] = default.value
        self.commented(holder, default)

    def commented(self, holder: dict[str, Any], default: Default) -> None:
        self.comments.append((holder, default.key, default.comment()))


def _one_line(text: str) -> str:
    """A comment's text on one YAML line: newlines, control characters and lone surrogates (JSON allows them)
    written as escapes, which YAML's reader would otherwise refuse."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def to_yaml(imported: Imported, sources: list[str]) -> str:
    """The config as YAML, headed by where it came from and every key that was not carried over; each SimpleTuner
    default the import wrote has its source line as a comment on its key."""
    lines = [f"# imported by `loraflow import-simpletuner` from {', '.join(sources)}"]
    if imported.unmapped:
        lines.append(f"# {len(imported.unmapped)} SimpleTuner key(s) not carried over:")
        lines += [f"#   {key} = {json.dumps(value, default=str)}: {why}" for key, value, why in imported.unmapped]
    lines += [f"# note: {note}" for note in imported.notes]
    lines += [f"# SimpleTuner default not taken: {left}" for left in imported.left]
    lines = [_one_line(line) for line in lines]
    body = []
    for key, value in imported.config.items():
        if key == "datasets" and isinstance(value, list) and value:
            body.append("datasets:")
            body += [_commented(yaml.safe_dump([d], sort_keys=False), d, imported, "  ") for d in value]
        else:
            body.append(_commented(yaml.safe_dump({key: value}, sort_keys=False), imported.config, imported, ""))
    return "\n".join(lines) + "\n" + "".join(part if part.endswith("\n") else part + "\n" for part in body)


def _commented(text: str, holder: dict[str, Any], imported: Imported, indent: str) -> str:
    """`text` (one key, or one dataset as a list item) with each default's comment after its key's first line."""
    notes = {key: comment for where, key, comment in imported.comments if where is holder}
    out = []
    for line in text.splitlines():
        name = line.removeprefix("- ").removeprefix("  ") if holder is not imported.config else line
        key = name.split(":", 1)[0]
        if not name.startswith(" ") and key in notes and ":" in name:
            line = f"{line}  # {_one_line(notes.pop(key))}"
        out.append(indent + line if holder is not imported.config else line)
    return "\n".join(out) + "\n"
