"""Data-parallel LoRA training with plain torch.distributed (no Dagster, no accelerate at run time).

`accelerate launch` or `torchrun` start one process per GPU and set WORLD_SIZE, RANK and LOCAL_RANK. Every rank
holds the whole model and the same LoRA. Rank r's local micro-step j is micro-step `j * size + r` of the seeded
batch plan, with that micro-step's random draws, and the LoRA gradients are averaged once per optimizer step. So N
processes with gradient_accumulation_steps A compute what one process computes with A * N (the same batches and
draws), up to the order of float sums; every batch is still one (bucket, text length) group. Only rank 0 writes.

With `fsdp: true` (FSDP2) each rank holds 1/N of every parameter, frozen base and LoRA alike, and of AdamW's state;
`parallelize` shards, `gathered` brings a full tensor back for checkpoints and export (every rank must call it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from loraflow.kernels.devices import fixed_mkl_threads, pick_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints, history and the adapter."""
        return self.rank == 0

    def micro_step(self, local: int) -> int:
        """The global micro-step (batch plan index and seed of the draws) of this rank's local micro-step."""
        return local * self.size + self.rank


def world_from_env() -> World:
    """The launch this process is part of (one process when no launcher set WORLD_SIZE)."""
    env = os.environ
    return World(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")))


def join(num_processes: int, fsdp: bool = False) -> tuple[World, torch.device]:
    """Check the launch against `num_processes` and `fsdp`, join the process group (once); this rank's device."""
    world = world_from_env()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # never ignored silently: loraflow has no DeepSpeed
        raise ValueError("the accelerate config asks for DEEPSPEED, which loraflow does not implement: drop it from "
                         "the accelerate config (docs/multi-gpu.md), or use FSDP with fsdp: true")
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and not fsdp:
        raise ValueError("the accelerate config asks for FSDP but the loraflow config has fsdp: false: set fsdp: true "
                         "to shard the model, or drop FSDP from the accelerate config to train data parallel")
    if world.size != num_processes:
        how = "train in this process" if num_processes == 1 else f"launch {num_processes} processes"
        raise ValueError(f"`num_processes` is {num_processes} but this launch has {world.size} process(es) "
                         f"(WORLD_SIZE): set num_processes: {world.size}, or {how} (e.g. `accelerate launch "
                         f"--multi_gpu --num_processes {num_processes} -m loraflow.train_main CONFIG`)")
    if world.size == 1:
        return world, pick_device()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", world.local_rank) if cuda else torch.device("cpu")
    fixed_mkl_threads()
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    log.info("rank %d of %d on %s (%s)", world.rank, world.size, device, dist.get_backend())
    return world, device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(transformer: torch.nn.Module, world: World, device: torch.device) -> list[torch.nn.Parameter]:
    """FSDP2 as torchtitan's parallelize(): `fully_shard` each block of the transformer's block lists, then the root.

    A block's weights are gathered just before its forward (and again in backward) and freed after it, so a rank
    holds its 1/N share plus one block unsharded. The weights must already be equal on every rank: each keeps its
    slice. Returns the LoRA parameters, which are now new DTensor parameters (the old ones are stale).
    """
    mesh = init_device_mesh(device.type, (world.size,))
    for blocks in transformer.children():
        if isinstance(blocks, torch.nn.ModuleList):
            for block in blocks:
                fully_shard(block, mesh=mesh)
    fully_shard(transformer, mesh=mesh)  # the rest: embeddings, modulation, the output layer
    return [p for name, p in transformer.named_parameters() if "lora_" in name]


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP shard (a collective: every rank calls it), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full tensor (a resumed AdamW moment) sharded as its parameter is; unchanged for unsharded parameters."""
    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def broadcast_(tensors: list[torch.Tensor], world: World) -> None:
    """Rank 0's values into every rank's tensors (in place), as DDP does with the initial weights."""
    if world.size == 1:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.broadcast(flat, 0)
    with torch.no_grad():
        for t, value in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(value.view_as(t))


def average_gradients_(grads: list[torch.Tensor | None], world: World) -> None:
    """Every rank's gradients become the mean over ranks, in place, in one all-reduce.

    A None gradient (a layer whose output is unused) is None on every rank: it depends on the model, not the data
    (where it depends on the data, `train_audio`'s batches without sound, the loop fills zeros first:
    `Trainable.fill_missing`).
    """
    # FSDP's backward has reduce-scattered (averaged) its DTensor gradients already
    present = [g for g in grads if g is not None and not isinstance(g, DTensor)]
    if world.size == 1 or not present:
        return
    flat = torch.cat([g.reshape(-1) for g in present])
    dist.all_reduce(flat)
    flat /= world.size
    for g, value in zip(present, flat.split([g.numel() for g in present])):
        g.copy_(value.view_as(g))


def sum_over_ranks(values: list[float], world: World, device: torch.device) -> list[float]:
    """Scalars summed over ranks (float64: a logged loss matches one process's to the last digits)."""
    if world.size == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def check_same_everywhere(what: str, fingerprint: Callable[[], str], world: World, device: torch.device) -> None:
    """Raise on every rank unless all ranks compute the same hex fingerprint (no pickle: 60 bits as an int64).

    The fingerprint is computed only when there is more than one rank.
    """
    if world.size == 1:
        return
    value = int(fingerprint()[:15], 16)
    bounds = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)  # max of the values and minus their min
    if bounds[0].item() != value or -bounds[1].item() != value:
        raise RuntimeError(f"the ranks disagree on {what}: the caches or the config changed while the processes "
                           "started; launch again")

