"""ComfyUI LoRA files from a peft/diffusers adapter: ComfyUI's module names, lora_up/lora_down, one alpha per module.

How ComfyUI reads such a file (comfyanonymous/ComfyUI, read at the revisions in the index):
- comfy/lora.py `model_lora_keys_unet`: for every model weight `diffusion_model.<name>.weight` the LoRA key
  `diffusion_model.<name>` is accepted ("generic lora format"), whatever the model family.
- comfy/lora.py `load_lora`: `<key>.lora_up.weight`, `<key>.lora_down.weight` and an optional `<key>.alpha`; keys
  it cannot map are only logged ("lora key not loaded"), so a wrong name fails silently there (tests pin the names).
- comfy/weight_adapter/lora.py `calculate_weight`: W += strength * (alpha / rank) * up @ down, rank = down.shape[0];
  without `.alpha` the factor is 1, which is why a peft file with lora_alpha != r renders at the wrong strength.

Where ComfyUI fuses projections that diffusers keeps apart (HunyuanVideo 1.5's q/k/v), the parts' LoRAs become one
LoRA of the fused weight: down = cat(A_1..A_n) (n*r, in), up = block_diag(B_1..B_n) (n*out, n*r), so
up @ down = cat(B_1 A_1, ..., B_n A_n): each part's update lands in its own rows and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from loraflow.store import write_atomic

COMFYUI_LORA_FILE = "pytorch_lora_weights_comfyui.safetensors"
PREFIX = "diffusion_model."


class ComfyRule(NamedTuple):
    """diffusers module name (regex, full match) -> ComfyUI module name (`re` template); `part` of `parts` when ComfyUI
    concatenates several diffusers linears along the output dim (in part order) into one."""

    pattern: str
    target: str
    part: int = 0
    parts: int = 1


class _Lora(NamedTuple):
    down: torch.Tensor  # lora_A (r, in)
    up: torch.Tensor  # lora_B (out, r)
    scale: float  # what peft multiplies B @ A by


def comfyui_name(rules: Sequence[ComfyRule], module: str) -> tuple[str, int, int]:
    """(ComfyUI module, part, parts) for a diffusers module name; no match is an error, never a silent drop."""
    for rule in rules:
        match = re.fullmatch(rule.pattern, module)
        if match:
            return match.expand(rule.target), rule.part, rule.parts
    raise ValueError(f"no ComfyUI name for LoRA module {module!r}; the family's COMFYUI_NAMES table lacks a rule for it")


def peft_scale(adapter_config: Mapping | None, rank: int) -> float:
    """peft's scaling for a module of this rank: lora_alpha / r (or / sqrt(r) with rsLoRA); alpha = r without config."""
    config = adapter_config or {}
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise NotImplementedError("per-module rank_pattern/alpha_pattern adapters are not converted to ComfyUI")
    alpha = config.get("lora_alpha", rank)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _modules(state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None) -> dict[str, _Lora]:
    """peft state dict (keys `<module>.lora_A.weight`, optionally `transformer.`-prefixed) -> one _Lora per module."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = re.fullmatch(r"(?:transformer\.)?(.+)\.lora_([AB])\.weight", key)
        if match is None:
            raise ValueError(f"not a peft LoRA key: {key!r} (expected `<module>.lora_A.weight` / `.lora_B.weight`)")
        halves.setdefault(match[1], {})[match[2]] = tensor.detach().float().cpu()
    modules = {}
    for name, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA module {name!r} has only lora_{''.join(pair)}")
        modules[name] = _Lora(pair["A"], pair["B"], peft_scale(adapter_config, pair["A"].shape[0]))
    return modules


def _fuse(parts: dict[int, _Lora], count: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One LoRA of `count` output-concatenated linears: (down, up, alpha); a part without an adapter gets zero rows."""
    present = [parts[i] for i in sorted(parts)]
    out_dims = {p.up.shape[0] for p in present}
    if len(out_dims) != 1:
        raise ValueError(f"fused parts of unequal output size {sorted(out_dims)}: cannot place the missing ones")
    (out_dim,) = out_dims
    scale = present[0].scale
    down = torch.cat([p.down for p in present])  # (sum r, in)
    up = torch.zeros(count * out_dim, down.shape[0])  # (count * out, sum r), block diagonal
    col = 0
    for i in sorted(parts):
        part = parts[i]
        rank = part.down.shape[0]
        # a part whose scale differs from the first's carries the ratio in its block (one alpha per fused module)
        up[i * out_dim:(i + 1) * out_dim, col:col + rank] = part.up * (part.scale / scale)
        col += rank
    return down, up, scale * down.shape[0]


def to_comfyui(
    state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None, rules: Sequence[ComfyRule]
) -> dict[str, torch.Tensor]:
    """The ComfyUI tensors: `diffusion_model.<name>.lora_down.weight` / `.lora_up.weight` / `.alpha`, fp32.

    alpha = peft's scale * rank (for an unfused module: lora_alpha), so ComfyUI's alpha / rank is peft's scale; with
    ComfyUI's strength 1 the file applies exactly the adapter that was trained.
    """
    grouped: dict[str, tuple[int, dict[int, _Lora]]] = {}
    for module, lora in _modules(state_dict, adapter_config).items():
        name, part, parts = comfyui_name(rules, module)
        count, members = grouped.setdefault(name, (parts, {}))
        if count != parts or part in members:
            raise ValueError(f"ComfyUI module {name!r} gets conflicting parts from {module!r}")
        members[part] = lora
    tensors = {}
    for name, (count, members) in sorted(grouped.items()):
        if count == 1:
            (lora,) = members.values()
            down, up, alpha = lora.down, lora.up, lora.scale * lora.down.shape[0]
        else:
            down, up, alpha = _fuse(members, count)
        tensors[f"{PREFIX}{name}.lora_down.weight"] = down.contiguous()
        tensors[f"{PREFIX}{name}.lora_up.weight"] = up.contiguous()
        tensors[f"{PREFIX}{name}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return tensors


def save_comfyui_lora(
    state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None, rules: Sequence[ComfyRule],
    path: str | Path,
) -> Path:
    """Write `to_comfyui(...)` to `path` (tmp + rename); the LoraConfig goes into the header for the record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "loraflow_source_format": "peft"}
    if adapter_config:
        metadata["lora_adapter_config"] = json.dumps(dict(adapter_config), sort_keys=True, default=str)
    tensors = to_comfyui(state_dict, adapter_config, rules)
    return write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
