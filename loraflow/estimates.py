"""Peak memory and FLOPs of each stage, before any model loads: what `loraflow check` prints.

Nothing here reads weights. A model is built from its config.json on the meta device (`fake_model`), then every
tensor it holds is replaced by a FakeTensor of the same shape, dtype and device: ops on fake tensors compute
shapes only, so the real code (the family's `velocity`, the flow-matching loss, autograd, diffusers' gradient
checkpointing) runs at released size in seconds and allocates nothing. Each number is then computed so:

- weights, LoRA: the bytes of the fake model's own tensors, in the configured precision (`_keep_in_fp32_modules`
  stay fp32, as from_pretrained keeps them; fp8-layerwise stores the layers diffusers casts in 1 byte); group
  offloading keeps only the non-block modules and the groups on the accelerator (one group, two with streams:
  the next is prefetched).
- optimizer: AdamW's two moments per LoRA parameter, fp32 (8 bytes per parameter) or bf16 with adamw_bf16 (4).
- activations: the peak of the bytes alive during one fake forward + backward of `ops.train.step_losses` (LoRA
  gradients included) above the weights, counted by `LiveBytes` from the storages every op returns. With
  gradient checkpointing diffusers' own checkpointing runs, so the saved block inputs and one block's recompute
  are what is counted. Attention temporaries are what the SDPA kernel returns (output and log-sum-exp: the
  memory-efficient kernels keep no N x N matrix).
- TFLOP: torch's FlopCounterMode over the same fake step (matmuls and convolutions; backward = 2x forward; a
  checkpointed block's forward is counted again when it is recomputed). The CPU flash-attention kernel that SDPA
  takes on fake CPU tensors has no formula in the counter: `attention_flops` gives it one, 4 * B * heads * N_q *
  N_kv * d forward (QK^T and PV, 2 flops per multiply-add) and twice that backward, as the counter's own SDPA
  formula.

The fake step runs on the CPU: with bf16 autocast where a CUDA run uses it (`ops.train.uses_autocast`), so the
activation dtypes are those of a GPU run. What is left out is said where it is: allocator rounding and
fragmentation (CUDA rounds to 512 bytes), CUDA/cuDNN workspaces and the CUDA context (about 0.5 GiB per process).
"""

from __future__ import annotations

import importlib
import json
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily

GIB = 2**30
CARDS_GB = (16, 24, 32, 48, 80, 141)  # common accelerator sizes; a card's "GB" is counted as GiB here
STAGES = ("latents", "text_embeds", "lora", "validation")


@dataclass(frozen=True)
class StageEstimate:
    """One stage's estimated accelerator peak, by what holds the bytes, and the TFLOP of one step (None: not
    estimated). `note` says what the number leaves out."""

    stage: str
    parts: dict[str, int] = field(default_factory=dict)
    tflop: float | None = None
    note: str = ""

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, card_gb: float) -> bool:
        return self.peak_bytes <= card_gb * GIB


# 1. fake models and counting ---------------------------------------------------------------------------------
def model_class(component_config: Mapping[str, Any], library: str = "diffusers") -> type:
    """The class a component's config.json names (`_class_name` for diffusers, `architectures[0]` for
    transformers)."""
    name = component_config.get("_class_name") or component_config["architectures"][0]
    return getattr(importlib.import_module(library if "_class_name" in component_config else "transformers"), name)


def fake_model(component_config: Mapping[str, Any], mode: Any, dtype: torch.dtype, device: str = "cpu",
               adapter: Any = None) -> torch.nn.Module:
    """The component built from its config with fake tensors (no memory) in `dtype`, its `_keep_in_fp32_modules`
    kept fp32 as from_pretrained keeps them; `adapter`: a peft LoraConfig added as training adds it (fp32).

    Built on the meta device (peft cannot add an adapter under FakeTensorMode), then each parameter, buffer and
    plain tensor attribute (Kandinsky 5 keeps its time frequencies as one) becomes a fake tensor."""
    import torch

    cls = model_class(component_config)
    config = {k: v for k, v in component_config.items() if not k.startswith("_")}
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(cls.config_class(**config))
        if adapter is not None:
            model.add_adapter(adapter)
    with mode:
        for module_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                fp32 = "lora_" in module_name or keep & set(module_name.split("."))
                wanted = torch.float32 if fp32 or not p.is_floating_point() else dtype
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=wanted, device=device),
                                                              requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
            for name, t in list(vars(module).items()):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    setattr(module, name, torch.empty(t.shape, dtype=t.dtype, device=device))
    return model


def tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct storages (a tied weight counts once)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _counter_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    formulas = {**flop_registry, **{op: shape_wrapper(f) for op, f in attention_flops().items()}}

    class StepCounter(TorchDispatchMode):
        """Bytes of the storages alive now and at most, from every storage an op returns (each counted once,
        uncounted when it is freed), and the FLOPs of every op torch's flop counter has a formula for. Works on
        real and fake tensors alike: what the allocator would hold, without its rounding. `existing` tensors (the
        model's) are never counted, not even when an op returns a view of them (a weight's transpose in every
        linear). (FlopCounterMode itself is not used: its module hooks keep recomputed activations alive under
        gradient checkpointing, which would be counted.)"""

        def __init__(self, existing: Iterable[Any] = ()) -> None:
            super().__init__()
            # keyed by the C storage: views (and fake tensors' storage objects) share it
            self.live: dict[int, int] = {t.untyped_storage()._cdata: 0 for t in existing}
            self.current = self.peak = self.flops = 0

        def track(self, t: Any) -> None:
            if not hasattr(t, "untyped_storage"):
                return
            storage = t.untyped_storage()
            if storage._cdata in self.live:
                return
            self.live[storage._cdata] = n = storage.nbytes()
            self.current += n
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, storage._cdata)

        def _free(self, key: int) -> None:
            self.current -= self.live.pop(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func._overloadpacket in formulas:
                self.flops += formulas[func._overloadpacket](*args, **kwargs, out_val=out)
            for t in tree_flatten(out)[0]:
                self.track(t)
            return out

    return StepCounter


def attention_flops() -> dict:
    """Formulas for the CPU flash-attention kernel that SDPA takes on (fake) CPU tensors, which torch's flop counter
    lacks: its own SDPA formulas, 4 * B * H * N_q * N_kv * d forward (two batched matmuls, 2 flops per
    multiply-add) and 2x that backward (four matmuls plus the recomputed scores)."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001 (shapes)
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001 (shapes)
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def measured_step(fn: Callable[[], Any], mode: Any, model: torch.nn.Module) -> tuple[int, float]:
    """Run `fn` under the fake `mode`: (peak bytes of the tensors it makes, `model`'s own not counted; TFLOP)."""
    counter = _counter_mode()([*model.parameters(), *model.buffers()])
    with mode, counter:
        fn()
    return counter.peak, counter.flops / 1e12


# 2. the stages -----------------------------------------------------------------------------------------------
def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real CPU tensors made by the code under test (torch.from_numpy in collate_text) become fake constants.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _dtype(precision: str) -> torch.dtype:
    import torch

    return torch.float32 if precision in ("no_change", "fp32") else torch.bfloat16


def weights_bytes(model: torch.nn.Module) -> int:
    """The frozen weights and buffers (not the LoRA)."""
    return tensor_bytes([p for n, p in model.named_parameters() if "lora_" not in n] + list(model.buffers()))


def offloaded_bytes(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> int:
    """Frozen block weights group offloading keeps off the accelerator. block_level: all but the group computing
    now and, with streams, the next one (prefetched); leaf_level: every block but one leaf at a time, counted as
    one block. The LoRA stays resident (`ops.train.Trainable`)."""
    blocks = list(getattr(transformer, family.tread_layout.blocks))
    per_block = [weights_bytes(b) for b in blocks]
    group = config.group_offload_blocks_per_group if config.group_offload_type == "block_level" else 1
    resident = group * (2 if config.group_offload_use_stream else 1)
    return sum(per_block) - sum(sorted(per_block, reverse=True)[:resident])


def training_step(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                  latent_shape: tuple[int, int, int, int], device_type: str = "cuda") -> StageEstimate:
    """One optimizer step of the lora stage at the largest bucket's latent (C, T, h, w), `train_batch_size` samples,
    `max_text_tokens` caption tokens (the longest a caption can be), on a `device_type` accelerator:
    weights + LoRA + AdamW moments + the fake step's activation peak (LoRA gradients included)."""
    import torch
    from peft import LoraConfig

    from loraflow.ops.train import step_losses, uses_autocast
    from loraflow.ops.train_data import MicroBatch, StepDraws

    if family.image_condition_name:
        return StageEstimate("lora", note=f"not estimated for {family.name} {family.flavour.name}: its image "
                                          f"condition ({family.image_condition_name}) is not modelled yet")
    mode = _fake_mode()
    adapter = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha or config.lora_rank,
                         target_modules=family.lora_targets(config.lora_include_ffn))
    transformer = fake_model(transformer_config, mode, _dtype(config.base_model_precision), adapter=adapter)
    if config.base_model_precision in ("fp8-layerwise", "int8-torchao", "int8-quanto"):
        # int8 weight-only stores 1 byte per linear weight too (its per-channel scales are left out)
        with mode:
            transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    lora = [p.requires_grad_(True) for n, p in transformer.named_parameters() if "lora_" in n]
    if config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    device = torch.device("cpu")  # fake tensors on the CPU stand for the accelerator's
    autocast = uses_autocast(config, torch.device(device_type))
    batch = config.train_batch_size

    def step() -> None:
        shape = (batch, *latent_shape)
        text = family.collate_text([family.example_text_row(transformer_config, family.max_text_tokens)] * batch,
                                   device)
        draws = StepDraws(drop_caption=False, noise=torch.zeros(shape), sigma=torch.full((batch,), 0.5), seed=0)
        # collate_text's .to(device) copies the rows into fake tensors: the device copies of a GPU run
        micro = MicroBatch(samples=[], x0=torch.zeros(shape), text=text, draws=draws)
        loss, _ = step_losses(transformer, family, micro, device, autocast)
        loss.backward()

    activations, tflop = measured_step(step, mode, transformer)
    weights = weights_bytes(transformer)
    if config.enable_group_offload:
        weights -= offloaded_bytes(transformer, config, family)
    lora_bytes = tensor_bytes(lora)
    moments = 2 * sum(p.numel() for p in lora) * (2 if config.optimizer == "adamw_bf16" else 4)
    return StageEstimate("lora", {"weights": weights, "lora": lora_bytes, "optimizer": moments,
                                  "activations": activations}, tflop)
