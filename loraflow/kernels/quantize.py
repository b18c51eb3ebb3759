"""int8 weight-only quantization (torchao) of a frozen model's linear layers: the first text encoder
(`text_encoder_1_precision: int8-torchao`) and the base transformer (`base_model_precision: int8-torchao`).

Each weight row is stored as int8 with one fp32 scale (symmetric, scale = max |row| / 127.5, so a weight moves by at
most half a scale) and an int8 zero point: about half the bf16 bytes. The matmul runs in the activations' dtype (bf16)
on the int8 values, then scales (torchao's Int8Tensor `linear`).

`int8-quanto` (SimpleTuner's guides) runs as int8-torchao: optimum-quanto is not a dependency, and its int8 weights are
the same per-channel symmetric int8 (`INT8_PRECISIONS`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

# base_model_precision values that store the transformer in int8 -> the implementation that runs
INT8_PRECISIONS = {"int8-torchao": "int8-torchao", "int8-quanto": "int8-torchao"}


def quantize_int8(model: torch.nn.Module, key: str, keep: Collection[str] = ()) -> None:
    """Every linear weight of `model` to int8, in place, except in modules with a name part in `keep`. `key` is the
    config key asking for it (for the error when torchao is missing)."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from torchao.quantization.quant_api import _is_linear
    except ImportError as exc:
        raise ImportError(f"{key} int8-torchao needs torchao: `pip install torchao` (or the `int8` extra), or use "
                          "bf16") from exc
    kept = lambda module, name: _is_linear(module, name) and not keep.intersection(name.split("."))  # noqa: E731
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=kept if keep else _is_linear)


def quantize_base_int8(transformer: torch.nn.Module) -> None:
    """`base_model_precision` int8: the frozen transformer's linear weights in int8, except the modules its class keeps
    in fp32 (diffusers' `_keep_in_fp32_modules`: Kandinsky 5's time embeddings and modulations). Call it before
    `add_adapter`: the LoRA layers then stay fp32 and peft wraps each int8 layer (its TorchaoLoraLinear)."""
    quantize_int8(transformer, "base_model_precision", frozenset(type(transformer)._keep_in_fp32_modules or ()))
