"""The adapter: its kind (peft LoRA, DoRA, LyCORIS LoKr/LoHa) and where it starts.

Kinds (`lora_type`, `lycoris_config`, `use_dora`), all peft's own: the standard LoRA is built exactly as before
they existed. LoKr keeps LyCORIS's scale: LyCORIS trains a module whose two Kronecker factors are both whole at
scale 1 whatever `linear_alpha` says (lycoris/modules/lokr.py: "use scale = 1", alpha = lora_dim), and ComfyUI
applies such a module at scale 1 (comfy/weight_adapter/lokr.py: alpha / dim only where a factor is decomposed).
peft scales every module by alpha / r, so those modules get alpha = r through peft's `alpha_pattern`, which
travels in the file's header.

Start: a checkpoint (resume), else `init_lora` (an existing LoRA file), else peft's init.

`init_lora` reads the files users have: diffusers/peft key names (`transformer.<module>.lora_A.weight`, with or
without the prefix; what loraflow writes), ComfyUI's (`diffusion_model.<module>.lora_down.weight` / `lora_up` /
`alpha`, loraflow's ComfyUI file, pipelines/comfyui.py) or musubi-tuner's (`lora_unet_<module, _>.lora_down.weight`
..., loraflow's musubi file or musubi's own LoRA of the same modules, pipelines/musubi.py). The file must hold
exactly the adapter being trained
(same modules, same rank): anything else is refused, naming the keys, never loaded in part. A ComfyUI module fused
from several diffusers linears (HunyuanVideo 1.5's q/k/v) is split back into its parts' blocks. The file's scale
(ComfyUI's alpha / rank, 1 without alpha; a diffusers file's header LoraConfig, which loraflow writes at unit
scale) is moved into the scaled factor (lora_B, LoKr's w1, LoHa's w1_a) where it differs from this config's, so
the adapter applies the same update; a diffusers-named file without a header (a checkpoint's lora.safetensors) is
taken at this config's scale. The file's content hash is one of the run's inputs (`init_lora_version`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.comfyui import PREFIX, SCALED_FACTOR, ComfyRule, comfyui_name, module_scale
from loraflow.pipelines.musubi import MUSUBI_PREFIX, musubi_key
from loraflow.safetensors_header import non_finite_problem, read_adapter_header

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.config.adapter_kinds import LycorisConfig


ADAPTER_PARAMETERS = ("lora_", "lokr_", "hada_")  # peft's LoRA (and DoRA's magnitude), LoKr, LoHa


def adapter_targets(config: LoraflowConfig, family: ModelFamily) -> list[str] | str:
    """peft `target_modules`: the config's `peft_lora_target_modules` (SimpleTuner's key), else the family's."""
    if config.peft_lora_target_modules:
        return list(config.peft_lora_target_modules)
    return family.lora_targets(config.lora_include_ffn)


def add_adapter(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> None:
    """The configured adapter on `transformer` (`adapter_targets`), its init drawn from `config.seed` (same seed,
    same adapter)."""
    from peft import LoraConfig

    targets = adapter_targets(config, family)
    torch.manual_seed(config.seed)
    if config.lycoris_config is None:
        transformer.add_adapter(LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha or config.lora_rank, lora_dropout=config.lora_dropout,
            target_modules=targets, init_lora_weights=True, use_dora=config.use_dora,
        ))
        return
    peft_config = lycoris_peft_config(config.lycoris_config, targets)
    if config.lycoris_config.algo == "lokr":  # whole-factor modules at scale 1, as LyCORIS (module docstring)
        transformer.add_adapter(peft_config)
        whole = [name for name, module in transformer.named_modules()
                 if "default" in getattr(module, "lokr_w1", {}) and "default" in getattr(module, "lokr_w2", {})]
        transformer.delete_adapters("default")
        peft_config.alpha_pattern = {f"^{re.escape(name)}": peft_config.r for name in whole}
        torch.manual_seed(config.seed)
    transformer.add_adapter(peft_config)


def lycoris_peft_config(lycoris: LycorisConfig, targets: list[str] | str) -> Any:
    """peft's LoKrConfig / LoHaConfig for SimpleTuner's lycoris_config (the fields config/adapter_kinds.py accepts)."""
    from peft import LoHaConfig, LoKrConfig

    common = {"r": lycoris.linear_dim, "alpha": lycoris.linear_alpha, "rank_dropout": lycoris.rank_dropout,
              "module_dropout": lycoris.module_dropout, "target_modules": targets, "init_weights": True}
    if lycoris.algo == "loha":
        return LoHaConfig(**common)
    return LoKrConfig(**common, decompose_both=lycoris.decompose_both, decompose_factor=lycoris.factor)


def init_lora_version(path: str) -> str:
    """The content hash of the tensors `init_lora` starts from (not its path: a copy keeps the run)."""
    from loraflow.keys import safetensors_sha256

    return safetensors_sha256(path)


def start_adapter(transformer: torch.nn.Module, checkpoint: Path | None, init_lora: str | None,
                  family: ModelFamily) -> None:
    """The adapter's weights at the first step to run: the checkpoint's, else the init_lora file's, else as added."""
    from loraflow.training.checkpoints import load_lora

    if checkpoint is not None:
        load_lora(checkpoint, transformer)
    elif init_lora is not None:
        load_init_lora(init_lora, transformer, family)


def load_init_lora(path: str, transformer: torch.nn.Module, family: ModelFamily) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    from loraflow.training.checkpoints import adapter_config

    header = read_adapter_header(path, "init_lora")  # checked at load; read again: the file may have changed since
    # training would start from NaN values and its first loss be NaN
    if problem := non_finite_problem(path, "init_lora", header, "export the LoRA again, or remove init_lora"):
        raise ValueError(problem)
    wanted, config = get_peft_model_state_dict(transformer), adapter_config(transformer)
    found = load_file(path)
    if any(k.startswith(PREFIX) for k in found):
        state = _from_down_up(found, wanted, config, family.comfyui_names, lambda name: PREFIX + name, "ComfyUI",
                              path)
    elif any(k.startswith(MUSUBI_PREFIX) for k in found):
        if not family.musubi_names:
            raise ValueError(f"`init_lora` {path}: a musubi-tuner LoRA file (`{MUSUBI_PREFIX}...` keys), and "
                             f"musubi-tuner has no model of {family.name}: give a diffusers or ComfyUI file")
        state = _from_down_up(found, wanted, config, family.musubi_names, musubi_key, "musubi-tuner", path)
    else:
        state = _from_diffusers(found, _header_config(path), config)
    missing, extra = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if missing or extra:
        raise ValueError(f"`init_lora` {path} does not hold the adapter this config trains ({len(missing)} of its "
                         f"tensors missing, e.g. {missing[:2]}; {len(extra)} others, e.g. {extra[:2]}): set "
                         "lora_rank, lora_include_ffn and the adapter kind as the file was trained, or remove "
                         "init_lora")
    for key, tensor in state.items():
        if tensor.shape != wanted[key].shape:
            raise ValueError(f"`init_lora` {path}: {key} has shape {tuple(tensor.shape)}, this config's adapter "
                             f"{tuple(wanted[key].shape)}: set lora_rank to the file's rank")
    set_peft_model_state_dict(transformer, {k: v.to(wanted[k].dtype) for k, v in state.items()})


def _header_config(path: str) -> dict | None:
    """The LoraConfig a diffusers-format file carries in its header (diffusers' `lora_adapter_metadata`), if any."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        header = json.loads((f.metadata() or {}).get("lora_adapter_metadata") or "{}")
    return {k.removeprefix("transformer."): v for k, v in header.items()} or None


def _from_diffusers(found: dict[str, torch.Tensor], file_config: dict | None,
                    config: dict) -> dict[str, torch.Tensor]:
    """peft tensors from diffusers/peft names, each module's file scale moved into its scaled factor where it
    differs from this config's (none without a header)."""
    state = {}
    for key, tensor in found.items():
        key = key.removeprefix("transformer.")
        match = SCALED_FACTOR.fullmatch(key)
        ratio = module_scale(file_config, match[1]) / module_scale(config, match[1]) if match and file_config else 1.0
        state[key] = tensor if ratio == 1.0 else tensor * ratio
    return state


def _from_down_up(found: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], config: dict,
                  rules: tuple[ComfyRule, ...], stem: Any, reader: str, path: str) -> dict[str, torch.Tensor]:
    """peft tensors for `wanted`'s modules from a file in sd-scripts' layout, ComfyUI's or musubi-tuner's names
    (`rules`, `stem`: the inverse of comfyui.down_up_tensors)."""
    state, used = {}, set()
    for key in wanted:
        match = re.fullmatch(r"(.+)\.lora_A\.weight", key)
        if match is None:
            continue  # lora_B: taken with its lora_A
        module = match[1]
        name, part, parts = comfyui_name(rules, module, reader)
        down_key, up_key, alpha_key = (f"{stem(name)}.{s}" for s in ("lora_down.weight", "lora_up.weight", "alpha"))
        if down_key not in found or up_key not in found:
            continue  # reported as missing
        down, up = found[down_key].float(), found[up_key].float()
        rank, out = wanted[key].shape[0], wanted[f"{module}.lora_B.weight"].shape[0]
        a = down[part * rank:(part + 1) * rank]
        b = up[part * out:(part + 1) * out, part * rank:(part + 1) * rank] if parts > 1 else up
        file_scale = float(found[alpha_key]) / down.shape[0] if alpha_key in found else 1.0
        ratio = file_scale / module_scale(config, module, rank)
        state[key], state[f"{module}.lora_B.weight"] = a, b if ratio == 1.0 else b * ratio
        used |= {down_key, up_key, alpha_key}
    unused = sorted(set(found) - used)
    if unused:
        raise ValueError(f"`init_lora` {path}: {len(unused)} {reader} tensors have no module in this config's "
                         f"adapter (e.g. {unused[:2]}): set lora_include_ffn as the file was trained, or remove "
                         "init_lora")
    return state
