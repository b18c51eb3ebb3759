"""LyCORIS adapters (peft's LoKr and LoHa) in the files users load them from.

diffusers/peft: the family's `save_lora` writes the peft state dict (`<module>.lokr_w1`, `.lokr_w2` or
`.lokr_w2_a`/`.lokr_w2_b`, ...; `.hada_w1_a` ... for LoHa) with the peft config in its header; diffusers'
`load_lora_adapter` builds a LoraConfig only, so `load_lycoris_file` adds the header's own peft config
(`add_adapter`, which injects it with peft) and loads the tensors with `set_peft_model_state_dict`, as peft reads
its files. Either way peft makes the adapter in its base layer's dtype; `adapter_in_fp32` makes it fp32 again, as
training holds it (base.load_lora_file, for renders of a bf16/fp8 base).

ComfyUI (comfyanonymous/ComfyUI, read at the revisions in the index):
- comfy/weight_adapter/lokr.py `LoKrAdapter.load`: `<key>.lokr_w1` | `.lokr_w1_a` + `.lokr_w1_b`, `.lokr_w2` |
  `.lokr_w2_a` + `.lokr_w2_b`, optional `.alpha`; `calculate_weight`: W += kron(w1, w2) * alpha / dim, where dim is
  the rank of a decomposed factor (w2's if both) and the factor is 1 when neither is decomposed or alpha is absent.
- comfy/weight_adapter/loha.py `LoHaAdapter.load`: `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`,
  optional `.alpha`; `calculate_weight`: W += (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / w1_b.shape[0].
peft's names are the same (its LyCORIS layers follow LyCORIS), and its scale is alpha / r for every module
(peft/tuners/lokr/layer.py `make_kron`, loha `make_weight`): the file carries alpha = peft's alpha where ComfyUI
divides by the rank; a module kept whole is at scale 1 in both (training/options/adapters.py trains it so).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraflow.atomic import write_atomic
from loraflow.pipelines.comfyui import PREFIX, ComfyRule, alpha_and_rank, comfyui_name

LYCORIS_NAMES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
                 "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def is_lycoris(keys: Sequence[str]) -> bool:
    return any(k.rsplit(".", 1)[-1] in LYCORIS_NAMES for k in keys)


def load_lycoris_file(transformer: torch.nn.Module, path: str | Path, adapter_name: str) -> None:
    """A LoKr/LoHa file (diffusers format, its peft config in the header) as adapter `adapter_name`."""
    from peft import PeftConfig, set_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        header = json.loads((f.metadata() or {}).get("lora_adapter_metadata") or "{}")
    if not header:
        raise ValueError(f"{path}: a LyCORIS adapter without its peft config in the header; loraflow reads the "
                         "files its lora stage writes (the config says the factorization and alpha)")
    config = PeftConfig.from_peft_type(**{k.removeprefix("transformer."): v for k, v in header.items()})
    transformer.add_adapter(config, adapter_name=adapter_name)  # diffusers' bookkeeping: set_adapters weighs it
    adapter_in_fp32(transformer, adapter_name)  # before its values are set: the file's, not rounded to the base's
    result = set_peft_model_state_dict(transformer, state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(f"{path}: {len(result.unexpected_keys)} tensors fit no adapted module "
                         f"(e.g. {result.unexpected_keys[:2]})")


def lycoris_to_comfyui(state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping,
                       rules: Sequence[ComfyRule]) -> dict[str, torch.Tensor]:
    """ComfyUI's LoKr/LoHa tensors (`diffusion_model.<name>.lokr_w1` ..., `.alpha`) for a peft state dict."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        module, name = key.removeprefix("transformer.").rsplit(".", 1)
        if name not in LYCORIS_NAMES:
            raise ValueError(f"not a peft LoKr/LoHa key: {key!r}")
        modules.setdefault(module, {})[name] = tensor.detach().float().cpu()
    tensors = {}
    for module, parts in sorted(modules.items()):
        name, _, count = comfyui_name(rules, module)
        if count != 1:
            raise ValueError(f"LoRA module {module!r} is part of ComfyUI's fused {name!r}: a Kronecker or Hadamard "
                             "product of parts is not one of the fused weight; use lora_format diffusers")
        alpha, rank = alpha_and_rank(adapter_config, module)
        scale = alpha / rank
        decomposed = "lokr_w2_a" in parts or "lokr_w1_a" in parts or "hada_w1_a" in parts
        # loraflow trains these at scale 1 (training/options/adapters.py), as LyCORIS
        if not decomposed and scale != 1.0:
            raise ValueError(f"LoKr module {module!r} keeps both factors whole at peft scale {scale}; ComfyUI "
                             "applies such a module at scale 1: train it with loraflow's lora_type lycoris")
        for part, tensor in parts.items():
            tensors[f"{PREFIX}{name}.{part}"] = tensor.contiguous()
        if decomposed:
            tensors[f"{PREFIX}{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return tensors


def adapter_in_fp32(transformer: torch.nn.Module, adapter_name: str) -> bool:
    """The adapter's tensors in fp32, as training keeps them; True if any was not. peft makes an adapter in its base
    layer's dtype (`_move_adapter_to_device_of_base_layer`): bf16, or fp8 under layerwise casting, which would
    round the file's values before a render computes with them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    cast = False
    for module in transformer.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for name in (*module.adapter_layer_names, *module.other_param_names):
            tensors = getattr(module, name, None)
            if isinstance(tensors, (torch.nn.ModuleDict, torch.nn.ParameterDict)) and adapter_name in tensors:
                for p in tensors[adapter_name].parameters() if isinstance(tensors, torch.nn.ModuleDict) \
                        else [tensors[adapter_name]]:
                    if p.is_floating_point() and p.dtype != torch.float32:
                        p.data, cast = p.data.float(), True
    return cast


def _peft_scale(config: Mapping, module: str) -> tuple[float, float]:
    """(peft's scale alpha / r, alpha) for `module`, its `alpha_pattern` / `rank_pattern` entry if any, matched by
    peft's own rule."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rank = ranks.get(get_pattern_key(ranks.keys(), module), config["r"])
    alpha = alphas.get(get_pattern_key(alphas.keys(), module), config["alpha"])
    return alpha / rank, float(alpha)


def save_comfyui_lycoris(state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping,
                         rules: Sequence[ComfyRule], path: str | Path) -> Path:
    """Write `lycoris_to_comfyui(...)` to `path` (`write_atomic`), the peft config in the header for the record."""
    metadata = {"format": "pt", "loraflow_source_format": "peft",
                "lora_adapter_config": json.dumps(dict(adapter_config), sort_keys=True, default=str)}
    tensors = lycoris_to_comfyui(state_dict, adapter_config, rules)
    return write_atomic(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))
