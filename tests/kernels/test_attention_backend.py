"""The `attention_backend` setting (loraflow/kernels/attention_backend.py) on the CPU: the kernels the CPU has give
the same model output (in float64, to the agreement of two summation orders), one it lacks is refused naming those
it has, and a masked call on a kernel that takes no mask (flash) runs torch's SDPA instead of failing."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from loraflow.kernels.attention_backend import (
    apply_attention_backend,
    attention_backend_of,
    available_backends,
    choose_backend,
)
from loraflow.pipelines.base import load_component
from tests.numerics import assert_float64_close

CPU = torch.device("cpu")


def test_the_cpu_has_sdpa_flash_and_math_and_refuses_cuda_kernels() -> None:
    have = available_backends(CPU, torch.float32, 64)
    assert {"sdpa", "sdpa_flash", "sdpa_math"} <= set(have) and "sdpa_cudnn" not in have
    assert choose_backend("auto", CPU, torch.float32, 64, needs_flex=False) == "sdpa"
    assert choose_backend("auto", CPU, torch.float32, 64, needs_flex=True) == "flex"
    with pytest.raises(ValueError, match="attention_backend: sdpa_cudnn does not run on this cpu.*available here: "
                                         "sdpa, sdpa_flash, sdpa_math"):
        choose_backend("sdpa_cudnn", CPU, torch.float32, 64, needs_flex=False)
    with pytest.raises(ValueError, match="NABLA"):
        choose_backend("sdpa_flash", CPU, torch.float32, 64, needs_flex=True)


@pytest.mark.parametrize("alike", [True, False])
def test_the_cpus_kernels_give_the_same_hunyuanvideo_output(tiny_hv15: Path, alike: bool) -> None:
    """HunyuanVideo 1.5 through loraflow's attention (pipelines/hunyuanvideo15/attention.py) under sdpa, sdpa_flash
    and sdpa_math: texts padded alike (no mask) and unlike (a key mask, which flash hands to sdpa)."""
    from loraflow.pipelines.hunyuanvideo15.attention import key_mask_attention
    from tests.pipelines.test_hv_attention import forward_and_grads

    base = load_component(tiny_hv15, "transformer").double().requires_grad_(True)
    key_mask_attention(base)
    outputs = {}
    for setting in ("sdpa", "sdpa_flash", "sdpa_math"):
        model = copy.deepcopy(base)
        assert apply_attention_backend(model, setting, CPU, needs_flex=False) == setting
        assert attention_backend_of(model) == setting
        assert {str(b.attn.processor._attention_backend.value) for b in model.transformer_blocks} == {
            {"sdpa": "native", "sdpa_flash": "_native_flash", "sdpa_math": "_native_math"}[setting]}
        outputs[setting] = forward_and_grads(model, batch=2, alike=alike)[0]
    for setting in ("sdpa_flash", "sdpa_math"):
        assert_float64_close(outputs[setting], outputs["sdpa"])
    assert not torch.equal(outputs["sdpa"], torch.zeros_like(outputs["sdpa"]))
