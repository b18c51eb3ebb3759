"""Where a transformer's frozen blocks live while it runs: every block streamed from the CPU (`enable_group_offload`:
diffusers' group offloading of the whole model) or only the last N (`blocks_to_swap`, musubi-tuner's name), the rest
resident on the accelerator. Training and renders call the same functions, and `loraflow.estimates` counts what
stays on the accelerator by the same rule (`swapped`).

musubi-tuner keeps blocks[: num_blocks - blocks_to_swap] on the GPU and swaps the last `blocks_to_swap`
(kohya-ss/musubi-tuner src/musubi_tuner/modules/custom_offloading_utils.py, `ModelOffloader.
prepare_block_devices_before_forward`), moving each swapped block's weights in place of another on a side thread.
Here each swapped block is its own diffusers group (`diffusers.hooks.apply_group_offloading` on that block alone:
block_level on a module without a block list makes the whole block one group, moved to the accelerator before its
forward and back after it), so the mechanism is diffusers' own; what it lacks is the overlap: without a prefetch
chain between the swapped blocks each waits for its copy (diffusers builds that chain only for the groups of one
model whose forward it traces, so `group_offload_use_stream` applies to `enable_group_offload` alone).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

CPU = torch.device("cpu")


def swapped(num_blocks: int, blocks_to_swap: int) -> range:
    """The indices of the blocks `blocks_to_swap` streams: the last ones, as musubi-tuner swaps them."""
    if blocks_to_swap > num_blocks:
        raise ValueError(f"`blocks_to_swap` {blocks_to_swap}: this transformer has {num_blocks} blocks; swap at most "
                         f"{num_blocks} (or set enable_group_offload: true, which streams every block)")
    return range(num_blocks - blocks_to_swap, num_blocks)


def swap_blocks(transformer: torch.nn.Module, blocks: str, blocks_to_swap: int, device: torch.device) -> None:
    """The last `blocks_to_swap` blocks of `transformer.<blocks>` each made one diffusers offload group (on the CPU
    between their forwards), everything else moved to `device`. The transformer comes in on the CPU."""
    from diffusers.hooks import apply_group_offloading

    block_list = getattr(transformer, blocks)
    for i in swapped(len(block_list), blocks_to_swap):
        apply_group_offloading(block_list[i], onload_device=device, offload_device=CPU, offload_type="block_level",
                               num_blocks_per_group=1)
    move_resident(transformer, blocks, blocks_to_swap, device)


def move_resident(transformer: torch.nn.Module, blocks: str, blocks_to_swap: int, device: torch.device) -> None:
    """Every tensor of `transformer` that no swapped block holds, to `device` (the swapped blocks' groups move
    themselves; diffusers refuses `.to()` on a model with offloaded groups): what renders move out of the way of the
    VAE decode and back."""
    for module in resident_modules(transformer, blocks, blocks_to_swap):
        for name, p in module.named_parameters(recurse=False):
            p.data = p.data.to(device)
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = b.to(device)


def resident_modules(transformer: torch.nn.Module, blocks: str, blocks_to_swap: int) -> Iterator[torch.nn.Module]:
    """Each module of `transformer` (the transformer itself too) outside the swapped blocks."""
    block_list = getattr(transformer, blocks)
    gone = {id(block_list[i]) for i in swapped(len(block_list), blocks_to_swap)}

    def walk(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield module
        for child in module.children():
            if id(child) not in gone:
                yield from walk(child)

    return walk(transformer)
