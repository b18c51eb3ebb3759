"""Training checkpoints, and the LoRA files users load: safetensors + JSON, written under a temporary name and renamed.

    <run>/checkpoints/step-NNNNNNN/lora.safetensors       the peft state dict of the adapter (fp32), to resume
                                                          from (no alpha in it: not a file for diffusers/ComfyUI)
                                  /optimizer.safetensors  the optimizer's tensors, keyed "<param index>.<name>"
                                  /state.json             step, its param_groups (and plain numbers of its
                                                          state, e.g. Prodigy's step count), the history so far
                                  /pytorch_lora_weights.safetensors (+ _comfyui, _musubi)  the adapter at this
                                                          step for users, as the run's own files (`export_lora`)
A killed save leaves only the .tmp folder, which nothing reads and the next save removes; a failed one (a full disk)
removes it itself. No pickle anywhere.

The files for users (`export_lora`): `pytorch_lora_weights.safetensors`, the family's diffusers format at unit scale
(pipelines/comfyui.py `at_unit_scale`), and beside it, unless `lora_format: diffusers` or where ComfyUI cannot
apply the adapter kind, `..._comfyui.safetensors` in ComfyUI's names, and where musubi-tuner has a loader for the
family and the adapter is a plain LoRA, `..._musubi.safetensors` in musubi-tuner's (pipelines/musubi.py). All are
outputs, not computation: none is in the run key, and a finished run without a twin gets it converted on reuse
(`export_twins`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loraflow.atomic import fsync_path, publish_folder, temporary_folder, write_json
from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.comfyui import at_unit_scale, comfyui_refusal, save_comfyui_lora
from loraflow.pipelines.lycoris import is_lycoris, save_comfyui_lycoris
from loraflow.pipelines.musubi import musubi_refusal, save_musubi_lora
from loraflow.training.launch.distributed import gathered, shard_like

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig

log = logging.getLogger(__name__)
LORA_FILE = "pytorch_lora_weights.safetensors"


class LoraExport(NamedTuple):
    """How to write an adapter's files for users: its LoraConfig (`adapter_config`), the family's writer and names,
    and whether the ComfyUI file (`writes_comfyui`) and the musubi-tuner file (`writes_musubi`) go beside the
    diffusers one."""

    adapter_config: dict
    family: ModelFamily
    comfyui: bool
    musubi: bool = False


def save_checkpoint(out: Path, step: int, lora: dict[str, torch.Tensor],
                    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]], history: list[dict],
                    total_limit: int | None, extra: dict[str, dict[str, torch.Tensor]] | None = None,
                    export: LoraExport | None = None) -> Path:
    """`lora` and `optimizer` as `lora_state` and `optimizer_state` return them (gathered on every rank under FSDP);
    `extra`: more {file name: tensors} the run resumes from (CREPA's projector); `export`: also the adapter's files
    for users, as the run writes its own."""
    final = out / "checkpoints" / f"step-{step:07d}"
    for killed in final.parent.glob("step-???????.tmp"):  # saves a kill interrupted (one writer per run: rank 0)
        shutil.rmtree(killed)
    with temporary_folder(final.with_name(final.name + ".tmp")) as tmp:
        save_file(lora, tmp / "lora.safetensors")
        if export is not None:
            export_lora(tmp, lora, export)
        for name, tensors in (extra or {}).items():
            save_file(tensors, tmp / name)
        tensors, scalars = optimizer
        save_file(tensors, tmp / "optimizer.safetensors")
        write_json(tmp / "state.json", {"step": step, "optimizer": scalars, "history": history})
        publish_folder(tmp, final)
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
    state = load_state(checkpoint / "state.json")
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
        raise unreadable_checkpoint(path, str(err)) from err


def load_state(path: Path) -> dict[str, Any]:
    """A checkpoint's state.json: an object of its step, optimizer scalars and history (a truncated one names itself
    and the folder to delete)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise unreadable_checkpoint(path, str(err)) from None
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("optimizer"), dict)
            and isinstance(state.get("history"), list)):
        raise unreadable_checkpoint(path, "not an object of step, optimizer and history")
    return state


def unreadable_checkpoint(path: Path, why: str) -> RuntimeError:
    return RuntimeError(f"checkpoint file {path} is unreadable ({why}); delete its folder {path.parent} to resume "
                        "from the one before it")


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


def writes_comfyui(config: LoraflowConfig, family: ModelFamily) -> bool:
    """`lora_format`: unset, the ComfyUI file wherever ComfyUI applies the adapter kind as peft does (a log line says
    why not elsewhere); `comfyui`, required: an error before any training where it cannot be; `diffusers` or
    `musubi`, never."""
    refusal = comfyui_refusal(family.comfyui_names, config.use_dora, config.lycoris_config is not None)
    return _writes(config.lora_format, "comfyui", "ComfyUI", refusal)


def writes_musubi(config: LoraflowConfig, family: ModelFamily) -> bool:
    """`lora_format`: unset, the musubi-tuner file wherever musubi-tuner loads the family and the adapter kind (a log
    line says why not elsewhere); `musubi`, required: an error before any training where it cannot be; `diffusers`
    or `comfyui`, never."""
    refusal = musubi_refusal(family.musubi_names, config.use_dora, config.lycoris_config is not None)
    return _writes(config.lora_format, "musubi", "musubi-tuner", refusal)


def _writes(lora_format: str | None, twin: str, reader: str, refusal: str | None) -> bool:
    if lora_format not in (None, twin):
        return False
    if refusal is not None and lora_format == twin:
        raise ValueError(f"`lora_format: {twin}` cannot be written for this adapter: {refusal}; use lora_format "
                         "diffusers (the diffusers file only), or another adapter kind")
    if refusal is not None:
        log.info("no %s file for this adapter (%s)", reader, refusal)
    return refusal is None


def comfyui_twin(lora_file: Path) -> Path:
    """The ComfyUI file beside a diffusers one: pytorch_lora_weights[_ema]_comfyui.safetensors."""
    return lora_file.with_name(f"{lora_file.stem}_comfyui{lora_file.suffix}")


def musubi_twin(lora_file: Path) -> Path:
    """The musubi-tuner file beside a diffusers one: pytorch_lora_weights[_ema]_musubi.safetensors."""
    return lora_file.with_name(f"{lora_file.stem}_musubi{lora_file.suffix}")


def export_lora(folder: Path, lora: dict[str, torch.Tensor], export: LoraExport, name: str = LORA_FILE) -> Path:
    """`folder/name`: the diffusers file through the family's own writer, at unit scale (`at_unit_scale`: diffusers,
    ComfyUI and any reader that ignores alpha apply it at training strength), and with `export.comfyui` its ComfyUI
    twin and with `export.musubi` its musubi-tuner twin, converted from it. Written in a `temporary_folder` (a full
    disk removes it); the twins are renamed into place first: the diffusers file marks a run finished."""
    state, config = at_unit_scale(lora, export.adapter_config)
    with temporary_folder(folder / f"{Path(name).stem}.tmp") as tmp:
        export.family.save_lora(state, tmp, config)
        written = tmp / LORA_FILE
        if export.comfyui:
            export_comfyui(written, export.family).replace(comfyui_twin(folder / name))
        if export.musubi:
            export_musubi(written, export.family).replace(musubi_twin(folder / name))
        fsync_path(written)  # never an empty file under the name that says "finished" after a power cut
        written.replace(folder / name)
    shutil.rmtree(tmp)
    return folder / name


def export_twins(lora_file: Path, export: LoraExport) -> None:
    """The twins `export` asks for that a finished run's diffusers file lacks (written before they were), converted
    from it: never retrained."""
    if export.comfyui and not comfyui_twin(lora_file).is_file():
        export_comfyui(lora_file, export.family)
    if export.musubi and not musubi_twin(lora_file).is_file():
        export_musubi(lora_file, export.family)


def _diffusers_file(lora_file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A diffusers file's tensors and the LoraConfig in its header, without the `transformer.` prefixes."""
    from safetensors import safe_open

    with safe_open(str(lora_file), "pt") as f:
        state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        header = json.loads((f.metadata() or {}).get("lora_adapter_metadata") or "{}")
    return state, {k.removeprefix("transformer."): v for k, v in header.items()}


def export_comfyui(lora_file: Path, family: ModelFamily) -> Path:
    """The ComfyUI twin of a diffusers file, from its tensors and the LoraConfig in its header (so a finished run
    written without it gets it on reuse, never retrained)."""
    state, config = _diffusers_file(lora_file)
    if is_lycoris(list(state)):
        return save_comfyui_lycoris(state, config, family.comfyui_names, comfyui_twin(lora_file))
    return save_comfyui_lora(state, config or None, family.comfyui_names, comfyui_twin(lora_file))


def export_musubi(lora_file: Path, family: ModelFamily) -> Path:
    """The musubi-tuner twin of a diffusers file, as `export_comfyui` makes the ComfyUI one."""
    state, config = _diffusers_file(lora_file)
    return save_musubi_lora(state, config or None, family.musubi_names, musubi_twin(lora_file))
