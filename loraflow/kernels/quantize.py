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
# stored in one byte per weight (from a bf16 load): `store_frozen` casts them
ONE_BYTE_PRECISIONS = ("fp8-layerwise", *INT8_PRECISIONS)


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


def frozen_dtype(precision: str) -> torch.dtype:
    """The dtype a frozen transformer is loaded in for `base_model_precision` (fp8 and int8 start from bf16)."""
    return torch.float32 if precision == "no_change" else torch.bfloat16


# fp32_modules_storage -> the dtype the modules a class keeps in fp32 are stored in (they compute in fp32)
KEPT_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def store_frozen(transformer: torch.nn.Module, precision: str, kept: str = "fp32") -> None:
    """A loaded frozen transformer (in `frozen_dtype`) stored as `base_model_precision` says, before any adapter is
    added (the LoRA then stays fp32): int8 (`quantize_base_int8`), or fp8 with diffusers' layerwise casting (each
    layer's weights cast to bf16 for its forward); bf16 and no_change are stored as loaded. The modules the class keeps
    in fp32 (`_keep_in_fp32_modules`, which both leave alone) are stored as `kept` says (`fp32_modules_storage`:
    `store_kept`). Training, renders and the estimates' meta models store it so."""
    if precision in INT8_PRECISIONS:
        quantize_base_int8(transformer)
    if precision == "fp8-layerwise":
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    if precision != "no_change":
        store_kept(transformer, kept)


def store_kept(transformer: torch.nn.Module, kept: str) -> None:
    """The modules `transformer`'s class keeps in fp32 stored in bf16 or fp8 (`kept`; "fp32": left as they are),
    still computing in fp32: diffusers' `LayerwiseCastingHook` on each of their linear layers, so each weight is cast
    to fp32 for its layer's forward and back after it. Registered under its own name (KEPT_HOOK), not diffusers' own:
    the model's `dtype` (what pipelines and `compute_dtype` read) is the compute dtype of the first hook registered as
    "layerwise_casting", which would then say fp32 for a bf16 model. musubi-tuner stores Kandinsky 5's modulations
    in fp8 too, with a scale per 64 weights of a row (kohya-ss/musubi-tuner
    src/musubi_tuner/modules/fp8_optimization_utils.py, `quantize_weight`); layerwise casting has no scale: a weight
    below fp8's smallest normal (2^-6) keeps fewer bits (docs/families.md measures what each storage changes)."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    keep = set(type(transformer)._keep_in_fp32_modules or ())
    if kept == "fp32" or not keep:
        return
    for name, module in transformer.named_modules():
        if keep & set(name.split(".")) and isinstance(module, torch.nn.Linear):  # what they hold: linear layers
            hook = LayerwiseCastingHook(KEPT_STORAGE[kept], torch.float32, non_blocking=False)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, KEPT_HOOK)


KEPT_HOOK = "loraflow_kept_storage"
