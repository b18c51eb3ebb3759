"""Training checkpoints: safetensors + JSON in a folder written as `<name>.tmp` and renamed when complete.

    <run>/checkpoints/step-NNNNNNN/lora.safetensors       the peft state dict of the adapter (fp32)
                                  /optimizer.safetensors  the optimizer's tensors, keyed "<param index>.<name>"
                                  /state.json             step, its param_groups (and plain numbers of its
                                                          state, e.g. Prodigy's step count), the history so far
A killed save leaves only the .tmp folder, which nothing reads and the next save removes; a failed one (a full disk)
removes it itself. No pickle anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loraflow.training.distributed import gathered, shard_like
from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE, save_comfyui_lora
from loraflow.pipelines.lycoris import is_lycoris, save_comfyui_lycoris
from loraflow.store import temporary_folder, write_json

log = logging.getLogger(__name__)
LORA_FILE = "pytorch_lora_weights.safetensors"


def save_checkpoint(out: Path, step: int, lora: dict[str, torch.Tensor],
                    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]], history: list[dict],
                    total_limit: int | None, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """`lora` and `optimizer` as `lora_state` and `optimizer_state` return them (gathered on every rank under FSDP);
    `extra`: more {file name: tensors} the run resumes from (CREPA's projector)."""
    final = out / "checkpoints" / f"step-{step:07d}"
    for killed in final.parent.glob("step-???????.tmp"):  # saves a kill interrupted (one writer per run: rank 0)
        shutil.rmtree(killed)
    with temporary_folder(final.with_name(final.name + ".tmp")) as tmp:
        save_file(lora, tmp / "lora.safetensors")
        for name, tensors in (extra or {}).items():
            save_file(tensors, tmp / name)
        tensors, scalars = optimizer
        save_file(tensors, tmp / "optimizer.safetensors")
        write_json(tmp / "state.json", {"step": step, "optimizer": scalars, "history": history})
        for path in (*tmp.iterdir(), tmp):  # on disk before the rename publishes them (a power cut, not only a kill)
            _fsync(path)
        tmp.rename(final)
    # None keeps every checkpoint (a [:None] slice would delete them all, the new one included)
    for old in sorted((out / "checkpoints").glob("step-???????"))[: -total_limit if total_limit else 0]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (a killed save leaves only a .tmp folder, which is never read)."""
    done = sorted((out / "checkpoints").glob("step-???????"))
    return done[-1] if done else None


def load_lora(checkpoint: Path, transformer: torch.nn.Module) -> None:
    """The adapter's weights at the checkpoint, into the transformer's (already added) adapter."""
    set_peft_model_state_dict(transformer, load_tensors(checkpoint / "lora.safetensors"))


def resume_optimizer(checkpoint: Path, optimizer: torch.optim.Optimizer) -> tuple[int, list[dict]]:
    """Load AdamW's state; return (the step to continue from, the history so far)."""
    state = json.loads((checkpoint / "state.json").read_text())
    tensors = load_tensors(checkpoint / "optimizer.safetensors")
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
    for param, entry in optimizer.state.items():  # under FSDP: each rank keeps its slice of the full moments
        for name, value in entry.items():
            entry[name] = shard_like(value, param)
    log.info("resuming from %s", checkpoint)
    return state["step"], state["history"]


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise RuntimeError(f"checkpoint file {path} is unreadable ({err}); delete its folder {path.parent} to "
                           "resume from the one before it") from err


def lora_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full weights on the CPU (under FSDP every rank calls it: the shards are gathered)."""
    return {k: gathered(v).detach().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def adapter_config(transformer: torch.nn.Module) -> dict:
    """The one adapter's LoraConfig as a dict (rank, lora_alpha, targets) for the exported file's header."""
    (config,) = transformer.peft_config.values()
    # sorted: peft keeps target_modules as a set, whose order can differ between runs (and so the file's bytes)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW's full state as safetensors tensors and JSON scalars (under FSDP every rank calls it, as lora_state)."""
    state = optimizer.state_dict()
    tensors = {f"{pid}.{name}": gathered(value).detach().cpu().contiguous() for pid, entry in state["state"].items()
               for name, value in entry.items() if isinstance(value, torch.Tensor)}
    # plain numbers in a parameter's state (Prodigy's step count) go to the JSON
    numbers = {f"{pid}.{name}": value for pid, entry in state["state"].items() for name, value in entry.items()
               if not isinstance(value, torch.Tensor)}
    return tensors, {"param_groups": state["param_groups"]} | ({"state": numbers} if numbers else {})


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in (tensors | scalars.get("state", {})).items():
        index, field = name.split(".", 1)
        state.setdefault(int(index), {})[field] = value
    return {"state": state, "param_groups": scalars["param_groups"]}


def export_lora(out: Path, lora: dict[str, torch.Tensor], config: dict, family: ModelFamily,
                lora_format: str = "diffusers") -> None:
    """diffusers format through the family's own writer, renamed into place (the file that marks a run finished);
    with `lora_format: comfyui` also the ComfyUI file, converted from it."""
    with temporary_folder(out / "export.tmp") as tmp:
        family.save_lora(lora, tmp, config)
        _fsync(tmp / LORA_FILE)  # this file says "finished": never an empty one under its name after a power cut
        (tmp / LORA_FILE).rename(out / LORA_FILE)
    shutil.rmtree(tmp)
    if lora_format == "comfyui":
        export_comfyui(out, family)


def export_comfyui(out: Path, family: ModelFamily) -> Path:
    """The ComfyUI file from the run's diffusers file (tensors + the LoraConfig in its header): a finished run
    switched to `lora_format: comfyui` is converted, never retrained."""
    from safetensors import safe_open

    with safe_open(str(out / LORA_FILE), "pt") as f:
        state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        header = json.loads((f.metadata() or {}).get("lora_adapter_metadata") or "{}")
    config = {k.removeprefix("transformer."): v for k, v in header.items()}
    if is_lycoris(list(state)):
        return save_comfyui_lycoris(state, config, family.comfyui_names, out / COMFYUI_LORA_FILE)
    return save_comfyui_lora(state, config or None, family.comfyui_names, out / COMFYUI_LORA_FILE)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
