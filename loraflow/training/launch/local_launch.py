"""`python -m loraflow.training.launch.local_launch N -m MODULE ARGS...`: torchrun's launcher of N processes on this
machine, with every rendezvous on loopback. What the `lora` asset runs for `num_processes > 1`.

The ranks meet through a TCPStore, and a TCPStore server listens on every interface whatever address it is given
(pytorch/pytorch#173909): under plain torchrun or `accelerate launch`, an unauthenticated store on the network for
the whole run. Here the store listens on a socket bound to 127.0.0.1, handed to TCPStore as `master_listen_fd` (the
way PyTorch's maintainers give for binding it elsewhere, pytorch/pytorch#169142, #150215), and reaches torchrun's
agent as a rendezvous backend of its registry; the ranks connect to it as clients (torchrun's agent store). The
collectives' own sockets use the loopback interface too (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), unless the
environment names one. The rest is torchrun's own: supervising the ranks, OMP_NUM_THREADS=1 each, the exit code.
Several machines are launched by the user, at the address they choose (docs/multi-gpu.md).
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "loraflow-loopback"
LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACES = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


class LoopbackRendezvous(RendezvousHandler):
    """The one node of a launch on this machine: its store exists already, listening on loopback."""

    def __init__(self, store: dist.TCPStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks connect to this store; none of them starts a server

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(dist.PrefixStore(self.run_id, self.store), 0, 1,
                              RendezvousStoreInfo(LOOPBACK, self.store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def loopback_store() -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, on a free port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen()
    port = listener.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=listener.detach(), wait_for_workers=False)


def main(argv: list[str]) -> None:
    processes, program = int(argv[0]), argv[1:]
    store = loopback_store()
    rendezvous_handler_registry.register(BACKEND, lambda params: LoopbackRendezvous(store, params.run_id))
    for name, interface in LOOPBACK_INTERFACES.items():
        os.environ.setdefault(name, interface)
    torchrun.main(["--nnodes", "1", "--nproc-per-node", str(processes), "--rdzv-backend", BACKEND,
                   "--rdzv-endpoint", f"{LOOPBACK}:{store.port}", *program])


if __name__ == "__main__":
    main(sys.argv[1:])
