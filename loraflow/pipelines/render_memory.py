"""How a render holds its models on the accelerator (`RenderPlan`), and putting a loaded render pipeline so.

A plan is chosen by `loraflow.estimates.render_plan` (the smallest change that fits the card: `gpu_memory_gb`, or the
GPU present) on top of what the config asks (`vae_enable_tiling`, `enable_group_offload`, `blocks_to_swap`), and
`place` applies it to the pipeline `load_pipeline` built:
- precision: the transformer stored as training stored it (`base_model_precision`: bf16, fp8 layerwise casting,
  int8), computing in bf16 as training does; fp32 (no_change) as before;
- blocks: every block streamed from the CPU (diffusers' group offloading of the model) or the last N
  (`kernels/offload.py`), the rest resident;
- VAE tiling: diffusers' own `enable_tiling` (spatial tiles blended at their seams; Kandinsky 5's VAE also decodes
  in chunks of frames, as it always does), approximate: its numbers are part of the validation key;
- parking: the transformer (what of it is resident) leaves the accelerator while the VAE (and HunyuanVideo 1.5 i2v's
  image encoder) runs, and they leave while the transformer runs: accelerate's model hooks (`Parked`), which diffusers
  calls from `vae.encode` / `vae.decode` too (`apply_forward_hook`). Exact: the same numbers, moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

from loraflow.kernels.offload import CPU, move_resident, swap_blocks


@dataclass(frozen=True)
class RenderPlan:
    precision: str = "no_change"  # the base_model_precision the transformer is stored in (training's)
    kept: str = "fp32"  # and its fp32-kept modules (fp32_modules_storage)
    blocks_to_swap: int = 0  # the last N blocks streamed from the CPU (kernels/offload.py)
    offload_all: bool = False  # every block streamed (enable_group_offload: diffusers' group offloading)
    vae_tiling: bool = False  # the VAE decodes in spatial tiles (diffusers' enable_tiling)
    park: bool = False  # the transformer off the accelerator while the VAE runs, and the VAE while it denoises
    attention_backend: str = "auto"  # the config's attention_backend (kernels/attention_backend.py): no number moves

    def numbers(self) -> dict[str, Any]:
        """What changes a render's numbers (the validation key's part): precision and tiling, when not the default
        (so a key made before plans existed stays as it was); offload and parking move the same numbers."""
        return {**({"render_precision": self.precision} if self.precision != "no_change" else {}),
                **({"render_kept": self.kept} if self.precision != "no_change" and self.kept != "fp32" else {}),
                **({"vae_tiling": True} if self.vae_tiling else {})}

    def describe(self) -> str:
        blocks = "every block streamed" if self.offload_all else \
            f"{self.blocks_to_swap} blocks swapped" if self.blocks_to_swap else "all blocks resident"
        precision = "fp32" if self.precision == "no_change" else self.precision
        return ", ".join([f"transformer {precision}", blocks, *(["VAE tiled"] if self.vae_tiling else []),
                          *(["transformer and VAE take turns on the GPU"] if self.park else [])])


class Parked(ModelHook):
    """accelerate's model hook on each part of a render: before a part runs, the other parts leave the accelerator and
    it comes on (`move(device)` of each), and its tensor arguments follow it. `execution_device` is what diffusers'
    `pipeline._execution_device` reads from a hooked component, so the pipeline builds its latents there."""

    def __init__(self, device: torch.device, moves: dict[str, Callable[[torch.device], Any]], part: str) -> None:
        self.execution_device, self.moves, self.part = device, moves, part

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for name, move in self.moves.items():
            if name != self.part:
                move(CPU)
        self.moves[self.part](self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def place(pipe: Any, plan: RenderPlan, blocks: str, device: torch.device, own_transformer: bool = True) -> None:
    """Put the loaded pipeline's models as `plan` says. `own_transformer` False: the transformer is training's (a
    render during training), which stays where training keeps it; only the other parts move to `device`."""
    if plan.vae_tiling:
        pipe.vae.enable_tiling()
    parts = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    transformer = parts.pop("transformer")
    if not own_transformer:
        for part in parts.values():
            part.to(device)
        return
    if plan.offload_all:
        transformer.enable_group_offload(onload_device=device, offload_device=CPU, offload_type="block_level",
                                         num_blocks_per_group=1, use_stream=device.type == "cuda")
    elif plan.blocks_to_swap:
        swap_blocks(transformer, blocks, plan.blocks_to_swap, device)
    else:
        transformer.to(device)
    if not plan.park:
        for part in parts.values():
            part.to(device)
        return
    moves = {name: part.to for name, part in parts.items()}
    if plan.offload_all:  # diffusers' hooks move every block itself, and refuse `.to()`
        moves["transformer"] = lambda where: None
    elif plan.blocks_to_swap:
        moves["transformer"] = lambda where: move_resident(transformer, blocks, plan.blocks_to_swap, where)
    else:
        moves["transformer"] = transformer.to
    for name, part in {**parts, "transformer": transformer}.items():
        add_hook_to_module(part, Parked(device, moves, name))
