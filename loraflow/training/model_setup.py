"""The model a run trains: the frozen transformer loaded in its precision with fp32 LoRA (resumed or started from
`init_lora`), its memory features (gradient checkpointing, group offloading, block swap, regional compilation), EMA
and CREPA beside it, sharded under FSDP: `setup_model`.

Gradient checkpointing and group offloading are exact (not in the run key: turning them on after an OOM resumes the
run); TREAD is not. base_model_precision stores frozen weights in bf16, fp8 (layerwise casting) or int8 (torchao,
kernels/quantize.py); LoRA weights and gradients are always fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraflow.config import LoraflowConfig
from loraflow.kernels.attention_backend import apply_attention_backend
from loraflow.kernels.checkpointing import enable_checkpointing
from loraflow.kernels.offload import swap_blocks
from loraflow.kernels.quantize import ONE_BYTE_PRECISIONS, frozen_dtype, store_frozen
from loraflow.kernels.tread import resolve_routes
from loraflow.pipelines.base import ModelFamily, load_component, needs_flex_attention, set_flavour_config
from loraflow.pipelines.sources import ModelSource
from loraflow.training.launch.distributed import broadcast_, gathered, parallelize
from loraflow.training.options.adapters import ADAPTER_PARAMETERS, add_adapter, start_adapter
from loraflow.training.options.crepa_training import Crepa, make_crepa
from loraflow.training.options.ema import AdapterEma, make_ema
from loraflow.training.run import RunContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingModel:
    """The transformer a run trains and what trains beside it: its LoRA (and CREPA projector) parameters, CREPA's
    term (None when off), the adapter's EMA (None without use_ema)."""
    transformer: torch.nn.Module
    trainable: Trainable
    crepa: Crepa | None
    ema: AdapterEma | None


def setup_model(run: RunContext, checkpoint: Path | None) -> TrainingModel:
    """Precision, LoRA (resumed from `checkpoint`, else from init_lora), EMA, offloading, CREPA; equal on every rank,
    then sharded under FSDP."""
    config, family, device = run.config, run.family, run.device
    transformer, params = load_transformer(config, family, run.model, device)
    backend = apply_attention_backend(transformer, config.attention_backend, device, needs_flex_attention(transformer))
    log.info("attention: %s (attention_backend: %s) on %s", backend, config.attention_backend, device.type)
    start_adapter(transformer, checkpoint, config.init_lora, family)
    ema = make_ema(config, transformer, checkpoint, device)  # use_ema; from the weights just loaded
    enable_offload(transformer, config, family, device)
    crepa = make_crepa(config, family, transformer, run.store, checkpoint, device)
    params = params + ([] if crepa is None else list(crepa.projector.parameters()))  # trained with the LoRA
    trainable = Trainable(transformer, params, device)
    broadcast_(params, run.world)  # equal already (same seed or checkpoint); DDP's guarantee, made explicit
    trainable.sync_copies()
    if config.fsdp:  # after the broadcast: each rank keeps its slice of equal weights
        trainable = Trainable(transformer, parallelize(transformer, run.world, device), device)
    return TrainingModel(transformer, trainable, crepa, ema)


def add_lora(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> list[torch.nn.Parameter]:
    """The configured adapter added to the family's LoRA targets; returns its parameters, fp32 and trainable."""
    add_adapter(transformer, config, family)  # LoRA, DoRA, LoKr or LoHa
    params = [p for n, p in transformer.named_parameters() if any(k in n for k in ADAPTER_PARAMETERS)]
    for p in params:
        p.data = p.data.float()  # fp32 LoRA params even when the base model is bf16 or fp8
        p.requires_grad_(True)
    return params


def load_transformer(config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                     device: torch.device) -> tuple[torch.nn.Module, list]:
    """The frozen transformer in the configured precision with fp32 LoRA; on `device` unless group-offloaded."""
    if config.group_offload_use_stream and device.type != "cuda":
        raise ValueError(f"`group_offload_use_stream` needs a CUDA device; this run is on {device.type}: set "
                         "group_offload_use_stream: false (group offloading itself works without it)")
    # group offloading moves the blocks itself; block swap moves the rest (`enable_offload`). fp8 and int8 load in
    # bf16 and are cast on the CPU before the model moves: loaded on the GPU, Kandinsky 5 Pro fp8 peaked at 40.4 GiB
    # while loading and held 20.7 after (an H200, benchmarks/results/gpu_nvidia-h200.json), past any 24 GB card
    offloaded = config.enable_group_offload or config.blocks_to_swap
    cast_first = config.base_model_precision in ONE_BYTE_PRECISIONS
    where = "cpu" if offloaded or cast_first else str(device)
    transformer = set_flavour_config(load_component(model, "transformer", base_dtype(config), where), family.flavour)
    transformer, params = prepare_transformer(transformer, config, family)
    if cast_first and not offloaded:
        names = {id(p): n for n, p in transformer.named_parameters()}
        order = [names[id(p)] for p in params]
        transformer.to(device)  # may make new Parameter objects (a device of another tensor type): found by name
        moved = dict(transformer.named_parameters())
        params = [moved[n] for n in order]
    return transformer, params


def base_dtype(config: LoraflowConfig) -> torch.dtype:
    """The dtype the frozen transformer is loaded in (fp8 and int8 start from bf16)."""
    return frozen_dtype(config.base_model_precision)


def prepare_transformer(transformer: torch.nn.Module, config: LoraflowConfig,
                        family: ModelFamily) -> tuple[torch.nn.Module, list]:
    """A loaded frozen transformer (in `base_dtype`) made ready to train: quantized storage, fp32 LoRA, gradient
    checkpointing; TREAD's routes checked. The real-size dry runs hand in released-config models built on fake
    tensors (tests/pipelines/test_released_dry_runs.py)."""
    # before the adapter: peft wraps the int8 layers, the casting hooks sit on the base layers only; LoRA stays fp32
    store_frozen(transformer, config.base_model_precision, config.fp32_modules_storage)
    if config.tread_config is not None:  # fail before the first step, naming the route
        if needs_flex_attention(transformer):  # Kandinsky 5's 10 s checkpoints
            raise ValueError("tread_config: this transformer uses NABLA attention, whose block mask covers every "
                             "visual token in a fixed order; TREAD hands its blocks a random subset. Remove "
                             "tread_config for this checkpoint")
        resolve_routes(config.tread_config.routes, len(getattr(transformer, family.tread_layout.blocks)))
    params = add_lora(transformer, config, family)
    enable_checkpointing(transformer, config)
    if config.dynamo_use_regional_compilation:
        transformer.compile_repeated_blocks()  # one compile per block class, reused by its copies
    return transformer, params


def enable_offload(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily,
                   device: torch.device) -> None:
    """`enable_group_offload` (every block streamed) or `blocks_to_swap` (the last N: kernels/offload.py)."""
    if config.blocks_to_swap:
        swap_blocks(transformer, family.tread_layout.blocks, config.blocks_to_swap, device)
    if not config.enable_group_offload:
        return
    block_level = config.group_offload_type == "block_level"
    transformer.enable_group_offload(
        onload_device=device, offload_device=torch.device("cpu"), offload_type=config.group_offload_type,
        num_blocks_per_group=config.group_offload_blocks_per_group if block_level else None,
        use_stream=config.group_offload_use_stream,
    )


class Trainable:
    """The LoRA parameters, on the compute device at every optimizer step, even under group offloading.

    Group offloading moves whole blocks, LoRA included: without streams it moves them to the CPU after their
    forward (values kept), with streams it swaps in the CPU copies it took when enabled (updates lost). So
    gradients are collected after each backward (the next forward's offload would move them), parameters are
    brought back before the step, and the offloader's CPU copies are refreshed after it. Without offloading
    the gradients simply accumulate in the parameters (the same arithmetic, a little less Python per step).
    """

    def __init__(self, transformer: torch.nn.Module, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.params, self.device = params, device
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        hooks = _offload_hooks(transformer)
        self.offloaded = bool(hooks)
        copies = {p: copy for hook in hooks for p, copy in hook.group.cpu_param_dict.items()}  # streams only
        self.copies = [copies.get(p) for p in params]
        self.resident()

    def resident(self) -> None:
        for p in self.params:
            if p.device != self.device:  # an offload hook moved it
                p.data = p.data.to(self.device)

    def collect(self) -> None:
        """After each backward: take the gradients out of the parameters (accumulated here, in fp32)."""
        for i, p in enumerate(self.params if self.offloaded else ()):
            if p.grad is not None:  # None for a layer whose output is unused (e.g. HV1.5's last text stream)
                self.grads[i] = p.grad if self.grads[i] is None else self.grads[i] + p.grad
                p.grad = None

    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients accumulated since the last step, one per parameter."""
        return self.grads if self.offloaded else [p.grad for p in self.params]

    def fill_missing(self) -> None:
        """A zero gradient for each parameter that got none since the last step: where whether a layer runs depends
        on the data (`train_audio`: a batch without sound skips the audio stream), so every rank averages the same
        list and the optimizer steps the same parameters on one process as on N."""
        for i, p in enumerate(self.params):
            if self.offloaded and self.grads[i] is None:
                self.grads[i] = torch.zeros_like(p, device=self.device)
            elif not self.offloaded and p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float, method: str = "norm") -> float:
        """Clip (`grad_clip_method`: the total norm to max_grad_norm, or each element to +-max_grad_norm), step, zero;
        returns the gradient norm before clipping."""
        if self.offloaded:
            self.resident()
            for p, grad in zip(self.params, self.grads):
                p.grad = grad
            self.grads = [None] * len(self.params)
        limit = max_grad_norm if method == "norm" else float("inf")  # value: the norm measured, nothing scaled
        norm = gathered(torch.nn.utils.clip_grad_norm_(self.params, limit)).item()
        if method == "value":  # not under FSDP (config validation): plain tensors
            torch.nn.utils.clip_grad_value_(self.params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.sync_copies()
        return norm

    def sync_copies(self) -> None:
        """The offloader's CPU copies (with streams) get the parameters' current values."""
        with torch.no_grad():
            for p, copy in zip(self.params, self.copies):
                if copy is not None:
                    copy.copy_(p)


def _offload_hooks(transformer: torch.nn.Module) -> list[Any]:
    """diffusers' group offloading hooks (each holds its group's CPU copies of the parameters, with streams)."""
    registries = [getattr(m, "_diffusers_hook", None) for m in transformer.modules()]
    hooks = [r.get_hook("group_offloading") for r in registries if r is not None]
    return [h for h in hooks if h is not None]
