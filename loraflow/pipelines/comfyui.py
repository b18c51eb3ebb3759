"""ComfyUI LoRA files from a peft/diffusers adapter, and the unit scale that lets alpha-blind readers apply it.

How ComfyUI reads a LoRA file (Comfy-Org/ComfyUI, each file read at the commit named: comfy/sd.py
`load_lora_for_models` at a125cd84, comfy/lora_convert.py at 2bffe2f4, comfy/lora.py at ec93dcac,
comfy/weight_adapter/lora.py at 6f98b150):
- comfy/lora_convert.py `convert_lora` renames only a few foreign layouts (BFL control, Wan Fun, USO, fused to_qkv);
  none of them matches loraflow's files, which reach the key map as written.
- comfy/lora.py `model_lora_keys_unet`, the key map: for every model weight `diffusion_model.<name>.weight` the keys
  `diffusion_model.<name>` and `lora_unet_<name with _>` ("generic lora format"), whatever the family; for
  `Kandinsky5` also `<name>` and `transformer.<name>` (its module names are diffusers', so the diffusers file maps);
  for `HunyuanVideo` models `transformer.<name>` / `diffusion_model.<name>` in diffusion-pipe's spelling
  (`img_attn_qkv`, `img_mlp.fc1`). Every entry names a ComfyUI module (`double_blocks.N.img_attn.qkv`), none
  diffusers' `transformer_blocks.N.attn.to_q`, so a diffusers-format HunyuanVideo 1.5 file loads no key there.
- comfy/lora.py `load_lora`: per mapped key `x`, `x.lora_up.weight` + `x.lora_down.weight` or diffusers'
  `x.lora_B.weight` + `x.lora_A.weight` (comfy/weight_adapter/lora.py `LoRAAdapter.load`), and the alpha from
  `x.alpha` only (diffusers' header is not read); keys it cannot map are only logged ("lora key not loaded").
- comfy/weight_adapter/lora.py `calculate_weight`: W += strength * (alpha / rank) * up @ down, rank = down.shape[0];
  without `x.alpha` the factor is 1.

So a file whose alpha is not where ComfyUI looks renders at the wrong strength there whenever peft's scale is not 1.
diffusers' Kandinsky 5 loader refuses `.alpha` keys (0.42.1 `load_lora_weights`: "Invalid LoRA checkpoint. Make sure
all LoRA param names contain `'lora'` substring"), so the diffusers file cannot carry them: it is written at unit
scale instead (`at_unit_scale`: peft's scale multiplied into lora_B, the header's alpha set to the rank), which
diffusers (reading the header), ComfyUI (reading no alpha) and any alpha-blind reader apply at training strength.

Where ComfyUI fuses projections that diffusers keeps apart (HunyuanVideo 1.5's q/k/v), the parts' LoRAs become one
LoRA of the fused weight: down = cat(A_1..A_n) (n*r, in), up = block_diag(B_1..B_n) (n*out, n*r), so
up @ down = cat(B_1 A_1, ..., B_n A_n): each part's update lands in its own rows and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from loraflow.atomic import write_atomic

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


def comfyui_name(rules: Sequence[ComfyRule], module: str, reader: str = "ComfyUI") -> tuple[str, int, int]:
    """(the reader's module, part, parts) for a diffusers module name (`rules`: the family's table for that reader,
    ComfyUI's or musubi-tuner's); no match is an error, never a silent drop."""
    for rule in rules:
        match = re.fullmatch(rule.pattern, module)
        if match:
            return match.expand(rule.target), rule.part, rule.parts
    raise ValueError(f"no {reader} name for LoRA module {module!r}; the family's {reader} names table lacks a rule "
                     "for it")


def alpha_and_rank(adapter_config: Mapping, module: str, rank: int | None = None) -> tuple[float, int]:
    """peft's alpha (LoRA's `lora_alpha`, LoKr/LoHa's `alpha`) and rank of `module`, each from its `alpha_pattern` /
    `rank_pattern` entry where one matches, by peft's own rule; `rank`, where the caller has the tensors, is used as
    it is."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = adapter_config.get("rank_pattern") or {}, adapter_config.get("alpha_pattern") or {}
    alpha = adapter_config["lora_alpha"] if "lora_alpha" in adapter_config else adapter_config["alpha"]
    if rank is None:
        rank = ranks.get(get_pattern_key(ranks.keys(), module), adapter_config["r"])
    return alphas.get(get_pattern_key(alphas.keys(), module), alpha), rank


def module_scale(adapter_config: Mapping | None, module: str, rank: int | None = None) -> float:
    """What peft multiplies `module`'s update by: alpha / r (alpha / sqrt(r) with rsLoRA); 1 without a config (a
    loader then assumes alpha = rank)."""
    if not adapter_config:
        return 1.0
    alpha, rank = alpha_and_rank(adapter_config, module, rank)
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


# the factor of each adapter kind's update that peft's scale can move into: kron(s * w1, w2), (s * w1_a @ w1_b) * ...
SCALED_FACTOR = re.compile(r"(?:transformer\.)?(.+)\.(lora_B\.weight|lokr_w1|lokr_w1_a|hada_w1_a)")


def at_unit_scale(state_dict: Mapping[str, torch.Tensor],
                  adapter_config: dict | None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The same adapter with every module at scale 1: each module's scale multiplied into its scaled factor (lora_B,
    LoKr's w1 or w1_a, LoHa's w1_a), the config's alpha (and every alpha_pattern entry) set to the rank, rsLoRA off.
    Exact where the scale is a power of two; DoRA's magnitude sees the same W + scale * B @ A. Unchanged at scale 1."""
    if not adapter_config:
        return dict(state_dict), adapter_config
    folded = {}
    for key, tensor in state_dict.items():
        match = SCALED_FACTOR.fullmatch(key)
        scale = module_scale(adapter_config, match[1]) if match else 1.0
        folded[key] = tensor if scale == 1.0 else tensor * scale
    alpha = "lora_alpha" if "lora_alpha" in adapter_config else "alpha"
    ranks = dict(adapter_config.get("rank_pattern") or {})
    unit = {**adapter_config, alpha: adapter_config["r"], "alpha_pattern": ranks}  # alpha = rank everywhere
    if "use_rslora" in unit:
        unit["use_rslora"] = False
    return folded, unit


def comfyui_refusal(rules: Sequence[ComfyRule], use_dora: bool, lycoris: bool) -> str | None:
    """Why ComfyUI cannot apply this adapter kind as peft does on a family with these names; None where it can."""
    if use_dora:
        return ("DoRA: ComfyUI's weight_decompose normalises the magnitude over the input axis (comfyanonymous/ComfyUI "
                "comfy/weight_adapter/base.py at 14c20852), peft over the output axis, and ComfyUI reads "
                "`dora_scale`, not peft's `lora_magnitude_vector`")
    if lycoris and any(rule.parts > 1 for rule in rules):
        return ("LoKr/LoHa where ComfyUI fuses projections (HunyuanVideo 1.5's q/k/v): a Kronecker or Hadamard "
                "product of the parts is not one of the fused weight")
    return None


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
        modules[name] = _Lora(pair["A"], pair["B"], module_scale(adapter_config, name, pair["A"].shape[0]))
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
    return down_up_tensors(state_dict, adapter_config, rules, lambda name: PREFIX + name)


def down_up_tensors(
    state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None, rules: Sequence[ComfyRule],
    stem: Callable[[str], str], reader: str = "ComfyUI",
) -> dict[str, torch.Tensor]:
    """sd-scripts' LoRA layout, which ComfyUI and musubi-tuner read: `<stem(name)>.lora_down.weight` (r, in),
    `.lora_up.weight` (out, r), `.alpha` (fp32 scalar) per module of the reader, named by `rules`."""
    grouped: dict[str, tuple[int, dict[int, _Lora]]] = {}
    for module, lora in _modules(state_dict, adapter_config).items():
        name, part, parts = comfyui_name(rules, module, reader)
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
        tensors[f"{stem(name)}.lora_down.weight"] = down.contiguous()
        tensors[f"{stem(name)}.lora_up.weight"] = up.contiguous()
        tensors[f"{stem(name)}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return tensors


def save_comfyui_lora(
    state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None, rules: Sequence[ComfyRule],
    path: str | Path,
) -> Path:
    """Write `to_comfyui(...)` to `path` (`save_lora_tensors`)."""
    return save_lora_tensors(to_comfyui(state_dict, adapter_config, rules), adapter_config, path)


def save_lora_tensors(tensors: dict[str, torch.Tensor], adapter_config: Mapping | None, path: str | Path) -> Path:
    """Write a reader's tensors to `path` (tmp + rename); the LoraConfig goes into the header for the record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "loraflow_source_format": "peft"}
    if adapter_config:
        metadata["lora_adapter_config"] = json.dumps(dict(adapter_config), sort_keys=True, default=str)
    return write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
