"""What an estimate is and whether it fits a card: `StageEstimate` (one stage's peak by what holds the bytes, its
TFLOP), the margin a card keeps (`CUDA_CONTEXT`, `FIT_SHARE`, `usable_bytes`), the cards `loraflow check` marks
(`CARDS_GB`) and the card to fit (`card_gb`: `gpu_memory_gb`, else the GPU present)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig

GIB = 2**30
CARDS_GB = (16, 24, 32, 48, 80, 141)  # common accelerator sizes; a card's "GB" is counted as GiB here
# What a card holds besides the estimate: the CUDA context of the process (0.5-1 GiB: CUDA's own state, cuBLAS and
# cuDNN handles) outside the allocator, and within it the cache and fragmentation the caching allocator keeps
# (5-10% of what it serves): a stage fits a card when its peak plus CUDA_CONTEXT is under FIT_SHARE of the card,
# and is "tight" up to all of it (a run may fit, or may not).
CUDA_CONTEXT = GIB // 2
FIT_SHARE = 0.9
FIT_MARKS = (f"✓: the peak + {CUDA_CONTEXT / GIB:.2g} GiB of CUDA context is under {FIT_SHARE:.0%} of the card; "
             "tight: under all of it; ✗: over it")


@dataclass(frozen=True)
class StageEstimate:
    """One stage's estimated accelerator peak, by what holds the bytes, and the TFLOP of one step (None: not
    estimated). `note` says what the number leaves out; `host`: the peak bytes the step holds in host memory
    instead (activation offload's copies), not in the peak."""

    stage: str
    parts: dict[str, int] = field(default_factory=dict)
    tflop: float | None = None
    note: str = ""
    host: int = 0

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, card_gb: float) -> bool:
        """Fits with the margin: peak + CUDA_CONTEXT under FIT_SHARE of the card."""
        return usable_bytes(card_gb) >= self.peak_bytes

    def mark(self, card_gb: float) -> str:
        """`check`'s table cell: ✓ (fits with the margin), tight (the peak and the context fit the whole card, not
        the margin) or ✗."""
        if self.fits(card_gb):
            return "✓"
        return "tight" if self.peak_bytes + CUDA_CONTEXT <= card_gb * GIB else "✗"


def usable_bytes(card_gb: float) -> int:
    """What an estimate may take of a card and still fit: FIT_SHARE of it, less the CUDA context."""
    return int(FIT_SHARE * card_gb * GIB) - CUDA_CONTEXT


# The device files a Linux process reaches a GPU through, that torch.cuda would find: NVIDIA's (/dev/nvidia0, ...),
# WSL 2's (/dev/dxg) and ROCm's (/dev/kfd, which torch.cuda also answers for).
GPU_DEVICE_FILES = ("nvidia[0-9]*", "dxg", "kfd")


def no_gpu_device() -> bool:
    """True where torch.cuda cannot find a GPU: a Linux machine with none of GPU_DEVICE_FILES in /dev. False (ask
    torch) anywhere else: such files, or another system."""
    import sys

    return sys.platform == "linux" and not any(any(Path("/dev").glob(name)) for name in GPU_DEVICE_FILES)


def card_gb(config: LoraflowConfig) -> tuple[float | None, str]:
    """The accelerator to fit: `gpu_memory_gb`, else the CUDA GPU this machine has, else none (`no_gpu_device`: no
    need to import torch, seconds, to learn that)."""
    if config.gpu_memory_gb is not None:
        return config.gpu_memory_gb, "gpu_memory_gb"
    if no_gpu_device():
        return None, ""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    return None, ""
