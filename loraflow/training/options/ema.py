"""EMA of the adapter (SimpleTuner's `use_ema`, `ema_decay`, `ema_device`, `ema_update_interval`, `ema_validation`).

A shadow copy of the adapter's state dict (peft names, fp32), started from the adapter at step 0 and updated after
every `ema_update_interval`-th optimizer step by torch's own EMA (`torch.optim.swa_utils.get_ema_multi_avg_fn`:
ema <- decay * ema + (1 - decay) * weights). The decay is fixed (no warm-up), so the EMA after updates at steps
t_1..t_n is the closed form decay^n * w_0 + sum_i (1 - decay) decay^(n - i) w_(t_i)
(tests/training/test_adapter_options.py checks it in float64) and the update needs no counter: resuming from a
checkpoint's `ema.safetensors` continues bit for bit. It never feeds back into training: the LoRA trained with or
without it is the same.

    <run>/checkpoints/step-NNNNNNN/ema.safetensors      the shadow at that step
    <run>/pytorch_lora_weights_ema.safetensors          the EMA adapter, written as the LoRA's own files are
                                                        (checkpoints.export_lora: diffusers format at unit scale,
                                                        `..._ema_comfyui.safetensors` beside it), before the LoRA
                                                        file that marks the run finished

`post_hoc_ema` is musubi-tuner's post-hoc EMA over saved LoRA files: the same closed form over files in step order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from loraflow.atomic import write_atomic

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig

EMA_LORA_FILE = "pytorch_lora_weights_ema.safetensors"
EMA_CHECKPOINT_FILE = "ema.safetensors"


class AdapterEma:
    """The shadow of `state` (a peft state dict, tensors sharing the trained parameters' storage)."""

    def __init__(self, state: dict[str, torch.Tensor], decay: float, interval: int, device: torch.device) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        self.names = sorted(state)
        self.device, self.interval = device, interval
        self.shadow = [state[n].detach().to(device=device, dtype=torch.float32, copy=True) for n in self.names]
        self._update = get_ema_multi_avg_fn(decay)

    def after_step(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """After optimizer step `step` (1-based): update on every interval-th step."""
        if step % self.interval == 0:
            self._update(self.shadow, [state[n].detach().to(self.device, torch.float32) for n in self.names], None)

    def state(self) -> dict[str, torch.Tensor]:
        """The shadow as a peft state dict on the CPU (for a checkpoint, or the exported EMA adapter)."""
        return {n: t.detach().cpu().contiguous() for n, t in zip(self.names, self.shadow)}

    def resume(self, checkpoint: Path) -> None:
        """The shadow saved in `checkpoint` (its ema.safetensors)."""
        saved = load_file(checkpoint / EMA_CHECKPOINT_FILE)
        if sorted(saved) != self.names:
            raise RuntimeError(f"{checkpoint / EMA_CHECKPOINT_FILE} holds another adapter's tensors; delete the run "
                               f"folder {checkpoint.parent.parent} to start it again")
        with torch.no_grad():
            for name, tensor in zip(self.names, self.shadow):
                tensor.copy_(saved[name])


def make_ema(config: LoraflowConfig, transformer: torch.nn.Module, checkpoint: Path | None,
             device: torch.device) -> AdapterEma | None:
    """With `use_ema`: the shadow of the adapter as loaded (step 0's, or the checkpoint's own shadow); else None."""
    from peft import get_peft_model_state_dict

    if not config.use_ema:
        return None
    where = device if config.ema_device == "accelerator" else torch.device("cpu")
    ema = AdapterEma(get_peft_model_state_dict(transformer), config.ema_decay, config.ema_update_interval, where)
    if checkpoint is not None:
        ema.resume(checkpoint)
    return ema


def trained_adapters(config: LoraflowConfig, lora_path: str) -> dict[str, str]:
    """What validation renders, by name (SimpleTuner's `ema_validation`): the LoRA, the EMA adapter beside it, or
    both (comparison: the LoRA first); without use_ema the LoRA alone."""
    ema = str(Path(lora_path).with_name(EMA_LORA_FILE))
    if not config.use_ema or config.ema_validation == "none":
        return {"lora": lora_path}
    return {"ema": ema} if config.ema_validation == "ema_only" else {"lora": lora_path, "ema": ema}


def post_hoc_ema(paths: Sequence[str | Path], decay: float, out: str | Path) -> Path:
    """musubi-tuner's post-hoc EMA: the EMA over LoRA files given in step order (the first starts it), written to
    `out` (`write_atomic`) with the first file's header. Every file must hold the same tensor names and shapes."""
    from safetensors import safe_open
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    if not paths:
        raise ValueError("post_hoc_ema: give at least one LoRA file, in step order")
    first = load_file(paths[0])
    names = sorted(first)
    shadow = [first[n].float() for n in names]
    update = get_ema_multi_avg_fn(decay)
    for path in paths[1:]:
        state = load_file(path)
        if sorted(state) != names or any(state[n].shape != t.shape for n, t in zip(names, shadow)):
            raise ValueError(f"post_hoc_ema: {path} holds other tensors than {paths[0]}: average one run's files")
        update(shadow, [state[n].float() for n in names], None)
    with safe_open(str(paths[0]), "pt") as f:
        metadata = f.metadata()
    return write_atomic(Path(out), lambda tmp: save_file(dict(zip(names, shadow)), tmp, metadata=metadata))
