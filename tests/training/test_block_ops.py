"""Inside a Kandinsky 5 visual block, loraflow's own code dispatches no operation when nothing is offloaded (issue
61 item 3): the block's forward and backward are diffusers' block, peft's LoRA wrappers and autograd's engine, as
`benchmarks/bench_block_ops.py` counts them (each ATen operation attributed to the innermost frame of loraflow,
peft or diffusers that called it). A hook, a per-step rebuilt tensor or a wrapper of loraflow's inside the block
would be counted under `loraflow` and fail here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.factory import REPO

sys.path.insert(0, str(REPO))
from benchmarks import bench_block_ops  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.tiny import build_tiny

    return build_tiny("kandinsky5-video", tmp_path_factory.mktemp("k5") / "k5")


@pytest.mark.parametrize("setup", ["lora", "lora + checkpointing"])
def test_loraflow_dispatches_nothing_inside_a_block(tiny: Path, setup: str) -> None:
    ops, origins = bench_block_ops.block_ops(*bench_block_ops.prepared(tiny, **bench_block_ops.SETUPS[setup]))
    assert sum(origins.values()) == sum(ops.values()) > 0
    assert origins["loraflow"] == 0, dict(origins)
    assert origins["peft"] > 0 and origins["diffusers"] > 0 and origins["backward"] > 0, dict(origins)
    assert origins["other"] == 0, dict(origins)  # every operation is attributed
