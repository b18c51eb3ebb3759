"""The device's bf16 matmul peak, measured: a loop of large bf16 matrix products (the MFU denominator).

Random inputs (zeros run faster on Hopper: less switching power), warm-up first, CUDA events around the timed
loop. Smoke: fp32 256x256 on the CPU (the number only shows the code ran).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def measure(work: Path, smoke: bool, size: int = 8192, warmup: int = 3, repeats: int = 20) -> dict[str, Any]:
    import torch

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    size = 256 if smoke else size
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=g) for _ in range(2))
    for _ in range(warmup):
        a @ b
    if smoke:
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - began
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
    flops = 2 * size**3 * repeats
    return {"tflops": round(flops / seconds / 1e12, 4), "size": size, "dtype": str(dtype), "repeats": repeats}
