"""`dynamo_use_regional_compilation`: the tiny Kandinsky 5 Video's blocks compiled by torch.compile (inductor, which
on the CPU builds C++ kernels with the system compiler) give the LoRA gradients of eager within rounding.

Marked `compile`, outside `make test`; `make test-compile` (which .ci/run runs) runs it: inductor's CPU compile of
the three block classes took 270 s on the suite's 2 shared cores (one step eager: 1.4 s).

The bound, from arithmetic: inductor fuses ops and sums in its own order; an fp32 sum of K terms in another order
differs by at most K * 2^-24 of the sum of the terms' magnitudes (Higham's gamma_K). The tiny model's longest
reductions have K <= 2 * model_dim * 4 = 256 (its ff width, a matmul's inner dimension, times 4 for softmax and
norm statistics): 1.5e-5 per op; a LoRA gradient goes through at most 64 such ops (2 visual + 1 text block,
forward and backward, about 10 reductions each, plus the head), so 64 * 1.5e-5 ~ 1e-3 of the gradient's scale.
Measured: 5.5e-7 of a 6.9e-3 gradient (8e-5). Bit-for-bit agreement would be a stronger claim than the compiler
makes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraflow.config import LoraflowConfig
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.training.model_setup import load_transformer
from tests.factory import fixed_batch, loss_and_grads, make_config

BOUND = 1e-3  # of max |gradient|: see the module docstring


@pytest.mark.compile
def test_regional_compilation_gives_eager_gradients_within_rounding(caches: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    eager = make_config(caches, tmp_path / "eager")
    batch = fixed_batch(eager)
    loss, grads = loss_and_grads(eager, batch)
    compiled = make_config(caches, tmp_path / "compiled", dynamo_use_regional_compilation=True)
    compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
    assert (grads != 0).float().mean() > 0.5
    scale = grads.abs().max()
    assert abs(compiled_loss - loss) <= BOUND * abs(loss)
    assert (compiled_grads - grads).abs().max() <= BOUND * scale


def test_the_switch_compiles_each_repeated_block_and_nothing_else(demo_config: LoraflowConfig) -> None:
    """In the suite (no compile runs: torch compiles a module at its first call)."""
    config = demo_config.model_copy(update={"dynamo_use_regional_compilation": True})
    transformer, _ = load_transformer(config, get_family(config), model_source(config), torch.device("cpu"))
    compiled = {type(m).__name__ for m in transformer.modules() if m._compiled_call_impl is not None}
    assert compiled == set(transformer._repeated_blocks)
