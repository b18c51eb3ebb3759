"""Gradient checkpointing as the peers' memory switches shape it, through diffusers' own hook: the function a model's
block loop calls for each block (`enable_gradient_checkpointing(gradient_checkpointing_func)`).

- `gradient_checkpointing_interval` N (SimpleTuner's name): the blocks at positions 0, N, 2N, ... of each block list
  are checkpointed, the others keep their activations (faster backward, more memory).
- `gradient_checkpointing_cpu_offload` (musubi-tuner's name): the inputs a checkpointed block keeps for its
  recompute (the only activations checkpointing keeps) are held on the CPU and brought back for the recompute.

Both change no number: a block computes the same ops on the same values either way, and a CPU copy is exact. (On
the CPU, where the offload's copies are the tensors themselves, the LoRA is the same bit for bit. Forced to copy
there, as on a GPU, the loss stayed equal and the gradients differed in the last bits: each copy is an autograd
node, which changes the order the gradients of a tensor used by several blocks are summed in.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class CheckpointingSwitches(Protocol):
    """The switches by the peers' names, as plain values (a `LoraflowConfig` has them)."""

    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def gradient_checkpointing_interval(self) -> int: ...
    @property
    def gradient_checkpointing_cpu_offload(self) -> bool: ...


def enable_checkpointing(transformer: torch.nn.Module, switches: CheckpointingSwitches, host: str = "cpu") -> None:
    """Turn on the checkpointing `switches` ask for in a diffusers transformer (training/model_setup.py passes the
    config, and so does the estimates' fake step, whose activation offload holds its copies on `host` "meta": fake CPU
    tensors stand for the accelerator's there, and its counter counts meta ones as host memory)."""
    if not switches.gradient_checkpointing:
        return
    interval, offload = switches.gradient_checkpointing_interval, switches.gradient_checkpointing_cpu_offload
    if interval == 1 and not offload:
        transformer.enable_gradient_checkpointing()  # plain checkpointing: diffusers' own function
        return
    import torch

    positions = {id(block): i for blocks in transformer.modules() if isinstance(blocks, torch.nn.ModuleList)
                 for i, block in enumerate(blocks)}

    def run_block(block: torch.nn.Module, *args: Any) -> Any:
        if positions.get(id(block), 0) % interval:
            return block(*args)
        return checkpoint(block, args, host if offload else None)

    transformer.enable_gradient_checkpointing(run_block)


def checkpoint(block: torch.nn.Module, args: tuple, host: str | None) -> Any:
    """`block(*args)` under torch's non-reentrant checkpoint (as diffusers calls it); with a `host` device, its
    tensor arguments are handed to the checkpoint as copies on the host, which is all it keeps, and copied back
    inside the recompute. The copy's autograd node keeps no tensor, so the accelerator copy is freed once the block
    loop moves on."""
    import torch
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    if host is None:
        return torch_checkpoint(block, *args, use_reentrant=False)
    devices = [a.device if torch.is_tensor(a) else None for a in args]
    held = [a if d is None else a.to(host) for a, d in zip(args, devices)]

    def on_device(*kept: Any) -> Any:
        return block(*(k if d is None else k.to(d) for k, d in zip(kept, devices)))

    return torch_checkpoint(on_device, *held, use_reentrant=False)
