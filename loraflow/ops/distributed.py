"""Data-parallel LoRA training with plain torch.distributed (no Dagster, no accelerate at run time).

`accelerate launch` or `torchrun` start one process per GPU and set WORLD_SIZE, RANK and LOCAL_RANK. Every rank
holds the whole model and the same LoRA. Rank r's local micro-step j is micro-step `j * size + r` of the seeded
batch plan, with that micro-step's random draws, and the LoRA gradients are averaged once per optimizer step. So N
processes with gradient_accumulation_steps A compute what one process computes with A * N (the same batches and
draws), up to the order of float sums; every batch is still one (bucket, text length) group. Only rank 0 writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loraflow.ops.devices import fixed_mkl_threads, pick_device

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


def join(num_processes: int) -> tuple[World, torch.device]:
    """Check the launch against `num_processes`, join the process group (once); this rank's device."""
    world = world_from_env()
    sharded = [name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}") == "true"]
    if sharded:  # accelerate sets these for its Accelerator, which loraflow does not use: never ignore them silently
        raise ValueError(f"the accelerate config asks for {sharded[0]}, which loraflow does not implement: every "
                         "process holds the whole model (data parallel); drop it from the accelerate config (README, "
                         "Multi-GPU)")
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

    A None gradient (a layer whose output is unused) is None on every rank: it depends on the model, not the data.
    """
    present = [g for g in grads if g is not None]
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


def tensors_fingerprint(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
