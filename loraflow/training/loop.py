"""The lora stage: flow-matching LoRA training from the latent and text caches only (no VAE, no text encoder).

Resume is exact (training/batches.py: samples, batches, draws): an epoch's batch order comes from (seed, epoch) and
every random draw of a micro-step (caption dropout, noise, sigmas, TREAD's tokens, LoRA dropout, scheduled
sampling's rollouts) from (seed, micro-step). A run
lives in output_dir/runs/<key>, keyed by the input caches' data versions and every config key that changes numbers:
    checkpoints/step-NNNNNNN/   lora + optimizer .safetensors, state.json (written as .tmp, then renamed)
    history.json, tensorboard/  per step: loss, lr, grad norm, ms, samples/s, peak GiB (CUDA), crepa_loss (CREPA);
                                the event files per `report_to` (training/tracking.py)
    crepa_projector.safetensors CREPA's projector (also in each checkpoint; training/crepa_training.py)
    pytorch_lora_weights_ema.safetensors   use_ema: the adapter's EMA (also in each checkpoint; training/ema.py)
    pytorch_lora_weights.safetensors   the adapter, diffusers format, written last: the run is done
Gradient checkpointing and group offloading are exact (not in the key: turning them on after an OOM resumes the
run); TREAD is not. base_model_precision stores frozen weights in bf16, fp8 (layerwise casting) or int8 (torchao,
kernels/quantize.py); the forward runs under bf16 autocast on CUDA; LoRA weights and gradients are always fp32, AdamW's
moments too unless `optimizer: adamw_bf16`.
Under a launcher (num_processes > 1) each rank trains its share of every step and only rank 0 writes
(loraflow/training/distributed.py; loraflow/train_main.py is the launched entry point).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save_file

from loraflow.config import LoraflowConfig
from loraflow.config.dataset import run_key_settings
from loraflow.keys import content_key, data_version, tensors_fingerprint
from loraflow.kernels.checkpointing import enable_checkpointing
from loraflow.kernels.flow_matching import flow_mse, lr_at, noisy_sample
from loraflow.kernels.offload import swap_blocks
from loraflow.kernels.losses import LossType
from loraflow.kernels.scheduled_sampling import roll_out
from loraflow.kernels.tread import resolve_routes, tread_routing
from loraflow.training.row_cache import RowCache, prefetched
from loraflow.training.adapters import ADAPTER_PARAMETERS, add_adapter, init_lora_version, start_adapter
from loraflow.training.checkpoints import (
    LORA_FILE, LoraExport, adapter_config, comfyui_twin, export_comfyui, export_lora, latest_checkpoint, lora_state,
    optimizer_state, resume_optimizer, save_checkpoint, writes_comfyui,
)
from loraflow.store import write_json
from loraflow.contracts.clip_rows import changed_sources, changed_sources_warning, read_clips
from loraflow.contracts.latent_rows import read_latent_rows
from loraflow.contracts.teacher_features import teacher_keys, teacher_version
from loraflow.stages.teacher.teacher_features import cache_teacher_features
from loraflow.training.crepa_training import Crepa, capturing, make_crepa, projector_state
from loraflow.kernels.devices import free_models, peak_memory_gib
from loraflow.training.distributed import (
    World, average_gradients_, barrier, broadcast_, check_same_everywhere, gathered, join, parallelize, sum_over_ranks,
)
from loraflow.contracts.text_set import text_lookup
from loraflow.training.progress_renders import ProgressRenders
from loraflow.kernels.quantize import ONE_BYTE_PRECISIONS, frozen_dtype, store_frozen
from loraflow.contracts.reports import LoraReport, TrainStep
from loraflow.training.tracking import open_sink
from loraflow.training.batches import BatchPlan, MicroBatch, build_samples, load_micro_batch, step_seed, training_texts
from loraflow.training.ema import EMA_CHECKPOINT_FILE, EMA_LORA_FILE, AdapterEma, make_ema
from loraflow.training.optimizers import averaged_weights, exported, make_optimizer, set_lr
from loraflow.pipelines.base import (
    ModelFamily, load_component, set_flavour_config,
)
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "train-2"


# 1. the run: its inputs and where it lives ----------------------------------------------------------------
def upstream_versions(store: Store, config: LoraflowConfig | None = None,
                      family: ModelFamily | None = None) -> dict[str, str]:
    """The data versions training reads: the lineage of an adapter.

    Only the texts training reads (captions and the empty prompt): a new validation prompt re-renders, never retrains.
    With CREPA on (`config`, and its `family` as the caller resolved it), the teacher features too (other teacher
    weights in the same folder: a new run).
    """
    read = set(training_texts(read_clips(store)))
    text_keys = [key for item, key in text_lookup(store).items() if item in read]
    versions = {"latents": data_version(r.key for r in read_latent_rows(store)),
                "text_embeds": data_version(text_keys)}
    if config is not None and config.crepa_enabled:
        versions["teacher_features"] = teacher_version(config, family, store)
    if config is not None and config.init_lora is not None:  # the tensors training starts from
        versions["init_lora"] = init_lora_version(config.init_lora)
    return versions


def run_dir(config: LoraflowConfig, upstream: dict[str, str]) -> Path:
    """Where one training run lives: keyed by its inputs' data versions and the config, so a change starts fresh."""
    key = content_key(inputs=upstream, config=run_key_settings(config), code=CODE_VERSION)
    return Path(config.output_dir) / "runs" / key


def current_lora_path(config: LoraflowConfig, family: ModelFamily, store: Store) -> str:
    path = run_dir(config, upstream_versions(store, config, family)) / LORA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA trained for the current caches and config ({path}): materialize `lora` first")
    return str(path)


# 2. model: precision, LoRA, memory features -------------------------------------------------------------------
def add_lora(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> list[torch.nn.Parameter]:
    add_adapter(transformer, config, family.lora_targets(config.lora_include_ffn))  # LoRA, DoRA, LoKr or LoHa
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
        if transformer.config.get("attention_type") == "nabla":  # Kandinsky 5's 10 s checkpoints
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


def uses_autocast(config: LoraflowConfig, device: torch.device) -> bool:
    auto = device.type == "cuda" or config.base_model_precision != "no_change"  # bf16 weights need bf16 compute
    return config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and auto)


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

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
        """Clip, step, zero; returns the gradient norm before clipping."""
        if self.offloaded:
            self.resident()
            for p, grad in zip(self.params, self.grads):
                p.grad = grad
            self.grads = [None] * len(self.params)
        norm = gathered(torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)).item()
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


# 3. one micro-step ---------------------------------------------------------------------------------------------
def flow_loss(
    transformer: torch.nn.Module, family: ModelFamily, batch: MicroBatch, device: torch.device, autocast: bool,
) -> torch.Tensor:
    """The flow-matching loss of a micro-step alone (`step_losses` without CREPA)."""
    return step_losses(transformer, family, batch, device, autocast)[0]


def step_losses(
    transformer: torch.nn.Module, family: ModelFamily, batch: MicroBatch, device: torch.device, autocast: bool,
    crepa: Crepa | None = None, loss: LossType = LossType(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MSE between the predicted velocity and noise - x0 at x_t = (1 - sigma) x0 + sigma noise (fp32); i2v: frame 0
    of x_t is x0's (the image) and the loss covers the generated frames only (`noisy_sample`, `flow_mse`),
    each element weighted by the batch's loss masks when it has them (`flow_mse`'s `mask`).
    Scheduled sampling replaces x_t by the model's own rollout (the target stays); with CREPA, also its weighted
    term (else None). `loss`: the config's loss_type (kernels/losses.py)."""
    x0, noise, sigma = batch.x0.to(device), batch.draws.noise.to(device), batch.draws.sigma.to(device)
    text = {k: v.to(device) for k, v in batch.text.items()}
    given, last = family.flavour.conditioning_frames, family.flavour.last_frame_given
    x_t = noisy_sample(x0, noise, sigma, given, last)
    if batch.draws.rollout is not None:
        x_t = rolled_out(transformer, family, x_t, x0, noise, sigma, batch.draws.rollout, text, autocast)
    with capturing(crepa, transformer) as capture, torch.autocast(device.type, dtype=torch.bfloat16,
                                                                  enabled=autocast):
        prediction = family.velocity(transformer, x_t, sigma, text)
    term = None if crepa is None else crepa.term(transformer, capture, batch.teacher, tuple(x0.shape[2:]))
    return flow_mse(prediction, x0, noise, given, last, loss, sigma, batch.mask), term


def rolled_out(transformer: torch.nn.Module, family: ModelFamily, x_t: torch.Tensor, x0: torch.Tensor,
               noise: torch.Tensor, sigma: torch.Tensor, offsets: torch.Tensor, text: dict[str, torch.Tensor],
               autocast: bool) -> torch.Tensor:
    """Scheduled sampling's input: the current model's no-grad Euler rollout from the later sigma. In eval mode:
    LoRA dropout off, so the rollout is the model's own prediction and draws nothing from the global RNG."""
    def predict(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            return family.velocity(transformer, x, at, text).float()

    transformer.eval()
    try:
        return roll_out(predict, x_t, x0, noise, sigma, offsets.to(x_t.device), family.flavour.conditioning_frames,
                        family.flavour.last_frame_given)
    finally:
        transformer.train()


def routing(transformer: torch.nn.Module, family: ModelFamily, config: LoraflowConfig,
            seed: int) -> AbstractContextManager:
    """TREAD for one forward + backward (a checkpoint recompute reuses the subset), or nothing."""
    if config.tread_config is None:
        return nullcontext()
    return tread_routing(transformer, family.tread_layout, config.tread_config.routes,
                         torch.Generator().manual_seed(seed))


# 4. the loop ---------------------------------------------------------------------------------------------------
def train_lora(config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store) -> LoraReport:
    """Train (or resume, or reuse) the run of these caches and config; under a launcher, as one of its ranks."""
    # 1. plan: inputs, run folder, samples, the same on every rank; a finished run is reused as it is
    world, device = join(config.num_processes, config.fsdp)
    changed = changed_sources(store, config.dataset_folders) if world.main else []
    if changed:  # the caches are what they are: trained on as they are, with a warning naming the files
        log.warning(changed_sources_warning(changed))
    if config.crepa_enabled and world.main:  # the teacher_features stage: computes what the store lacks
        cache_teacher_features(config, family, store)
    barrier(world)
    upstream = upstream_versions(store, config, family)
    out = run_dir(config, upstream)
    finished = (out / LORA_FILE).is_file()
    check_same_everywhere("the run folder", lambda: content_key(run=out.name, finished=finished), world, device)
    comfyui = writes_comfyui(config, family)  # `lora_format: comfyui` that cannot be: an error before any training
    if finished:
        if comfyui and world.main:  # a run finished without its ComfyUI files gets them, converted (no retraining)
            for lora_file in (out / LORA_FILE, out / EMA_LORA_FILE):
                if lora_file.is_file() and not comfyui_twin(lora_file).is_file():
                    export_comfyui(lora_file, family)
        return lora_report(out, upstream, computed=0)
    samples = build_samples(config, store)
    check_same_everywhere("the samples", lambda: content_key(samples=[(s.latent_key, s.text_key) for s in samples]),
                          world, device)
    plan = BatchPlan(samples, config.train_batch_size, config.seed)
    out.mkdir(parents=True, exist_ok=True)
    # 2. model: precision, LoRA (resumed), memory features, optimizer (resumed)
    transformer, params = load_transformer(config, family, model, device)
    checkpoint = latest_checkpoint(out)
    start_adapter(transformer, checkpoint, config.init_lora, family)
    ema = make_ema(config, transformer, checkpoint, device)  # use_ema; from the weights just loaded
    enable_offload(transformer, config, family, device)
    crepa = make_crepa(config, family, transformer, store, checkpoint, device)
    params = params + ([] if crepa is None else list(crepa.projector.parameters()))  # trained with the LoRA
    trainable = Trainable(transformer, params, device)
    broadcast_(params, world)  # equal already (same seed or checkpoint); DDP's guarantee, made explicit
    trainable.sync_copies()
    if config.fsdp:  # after the broadcast: each rank keeps its slice of equal weights
        params = parallelize(transformer, world, device)
        trainable = Trainable(transformer, params, device)
    optimizer = make_optimizer(config, params, transformer)
    start, rows = resume_optimizer(checkpoint, optimizer) if checkpoint is not None else (0, [])
    history = [TrainStep(**row) for row in rows]
    # 3. steps
    export = LoraExport(adapter_config(transformer), family, comfyui)  # users' files: in checkpoints, at the end
    history = run_steps(config, family, model, store, plan, transformer, trainable, optimizer, start, history, out,
                        world, crepa, ema, export)
    check_same_everywhere("the trained LoRA weights", partial(tensors_fingerprint, [gathered(p) for p in params]),
                          world, device)
    # 4. rank 0 writes the history, then the adapter: the adapter's presence marks the run done
    exported(optimizer)  # schedule-free: its averaged weights
    lora = lora_state(transformer)  # on every rank: under FSDP it gathers the shards
    if world.main:
        write_json(out / "history.json", [row.json_row() for row in history])
        for name, tensors in projector_state(crepa).items():  # beside the adapter, before it marks the run done
            save_file(tensors, out / name)
        if ema is not None:
            export_lora(out, ema.state(), export, EMA_LORA_FILE)
        export_lora(out, lora, export)
    barrier(world)  # every rank returns once the run is done
    del transformer, trainable, optimizer, params, crepa, ema  # the last references: free_models can free the weights
    free_models()
    return lora_report(out, upstream, computed=config.max_train_steps - start, resumed_at=start)


def run_steps(
    config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store, plan: BatchPlan,
    transformer: torch.nn.Module, trainable: Trainable, optimizer: torch.optim.Optimizer, start: int,
    history: list[TrainStep], out: Path, world: World = World(), crepa: Crepa | None = None,
    ema: AdapterEma | None = None, export: LoraExport | None = None,
) -> list[TrainStep]:
    """Optimizer steps start..max_train_steps: set lr, micro-steps, average over ranks, clip + step, log, checkpoint
    (with `export`, each checkpoint also holds the adapter's files for users).

    Local micro-step j of this rank is global micro-step world.micro_step(j): its batch and its random draws.
    """
    device, accum = trainable.device, config.gradient_accumulation_steps
    autocast = uses_autocast(config, device)
    loss_type = LossType(config.loss_type, config.huber_c, config.huber_schedule)
    rows = RowCache(store)
    teacher = teacher_keys(config, family, store) if crepa is not None else None
    batches = prefetched(lambda j: load_micro_batch(config, family, rows, plan(world.micro_step(j)),
                                                    world.micro_step(j), teacher),
                         range(start * accum, config.max_train_steps * accum))
    sink = open_sink(config.report_to, out, start, run_key_settings(config)) if world.main else None
    renders = ProgressRenders(config, family, model, store, out, transformer, world)  # validation_steps; off by default
    renders.at_startup(start)  # validation_on_startup; resets the peak memory itself
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    transformer.train()
    try:
        for step in range(start, config.max_train_steps):
            began = time.perf_counter()
            lr = lr_at(step, config.learning_rate, config.lr_warmup_steps, config.max_train_steps, config.lr_scheduler)
            set_lr(optimizer, lr)
            losses, seen = [0.0, 0.0], 0  # flow loss, CREPA term (weighted)
            for micro in range(step * accum, (step + 1) * accum):
                batch = next(batches)
                if config.lora_dropout:  # peft's dropout draws from the global RNG
                    torch.manual_seed(step_seed(config.seed, world.micro_step(micro), "lora_dropout"))
                with routing(transformer, family, config, batch.draws.seed):
                    loss, term = step_losses(transformer, family, batch, device, autocast, crepa, loss_type)
                    total = loss if term is None else loss + term
                    if not torch.isfinite(total):
                        raise FloatingPointError(f"step {step + 1}: loss is {total.item()}; no update was made. "
                                                 "Lower learning_rate, or check the latent and text caches")
                    if config.fsdp:  # reduce-scatter once per step, as DDP's all-reduce: the same sums in order
                        transformer.set_requires_gradient_sync(micro == (step + 1) * accum - 1)
                    (total / accum if accum > 1 else total).backward()
                trainable.collect()
                losses = [losses[0] + loss.item() / accum, losses[1] + (0.0 if term is None else term.item() / accum)]
                seen += len(batch.samples)
            average_gradients_(trainable.gradients(), world)
            grad_norm = trainable.step(optimizer, config.max_grad_norm)  # the same on every rank
            if ema is not None:
                ema.after_step(step + 1, get_peft_model_state_dict(transformer))
            loss_sum, crepa_sum, seen = sum_over_ranks([losses[0] / world.size, losses[1] / world.size, seen],
                                                       world, device)
            if world.main:
                extra = {} if crepa is None else {"crepa_loss": crepa_sum}
                history.append(_log_step(step + 1, config.max_train_steps, loss_sum, lr, grad_norm,
                                         time.perf_counter() - began, seen, device, sink, extra))
            if (step + 1) % config.checkpointing_steps == 0 and step + 1 < config.max_train_steps:
                save_step(out, step + 1, transformer, optimizer, history, config, world, crepa, ema, export)
            due = renders.every and (step + 1) % renders.every == 0
            with averaged_weights(optimizer) if due else nullcontext():  # schedule-free renders x
                renders.after_step(step + 1)
    finally:
        batches.close()
        if sink is not None:
            sink.close()
    return history


def save_step(out: Path, step: int, transformer: torch.nn.Module, optimizer: torch.optim.Optimizer,
              history: list[TrainStep], config: LoraflowConfig, world: World, crepa: Crepa | None,
              ema: AdapterEma | None = None, export: LoraExport | None = None) -> None:
    """Every rank takes the state (under FSDP: gathers the shards), rank 0 writes it (with `export`, also the
    adapter's files for users, as the run's end writes them)."""
    lora, moments = lora_state(transformer), optimizer_state(optimizer)
    if world.main:
        extra = projector_state(crepa) | ({} if ema is None else {EMA_CHECKPOINT_FILE: ema.state()})
        save_checkpoint(out, step, lora, moments, [row.json_row() for row in history], config.checkpoints_total_limit,
                        extra, export)
    barrier(world)  # no rank runs ahead of the newest checkpoint


def _log_step(step: int, total: int, loss: float, lr: float, grad_norm: float, seconds: float, seen: int,
              device: torch.device, sink: Any, extra: dict[str, float]) -> TrainStep:
    """One greppable line, one point per number in the `report_to` sink, one history row. `loss` is the flow loss
    alone; `extra` holds a regulariser's term (crepa_loss), logged as its own series."""
    row = TrainStep(step=step, loss=loss, lr=lr, grad_norm=grad_norm, ms=seconds * 1000, samples_per_s=seen / seconds,
                    peak_gib=peak_memory_gib(device) if device.type == "cuda" else None, **extra)
    log.info("step %d/%d | loss %.4f%s | lr %.1e | grad %.3f | %.0f ms | %.2f samples/s | %s GiB", step, total, loss,
             "".join(f" | {k} {v:.4f}" for k, v in extra.items()), lr, grad_norm, row.ms, row.samples_per_s,
             "-" if row.peak_gib is None else f"{row.peak_gib:.1f}")
    if sink is not None:
        sink.log({k: v for k, v in row.json_row().items() if k != "step"}, step)
    return row


def lora_report(out: Path, upstream: dict[str, str], computed: int, resumed_at: int = 0) -> LoraReport:
    """The report of the run in `out`, read from its folder (also by the process that launched the trainers)."""
    rows = json.loads((out / "history.json").read_text())  # written before the adapter: always there
    history = tuple(TrainStep(**row) for row in rows)
    speeds = [row.samples_per_s for row in history if row.samples_per_s is not None]
    comfyui = comfyui_twin(out / LORA_FILE)
    return LoraReport(data_version=out.name, computed=computed, reused=0 if computed else 1, history=history,
                      lora_path=str(out / LORA_FILE), run_dir=str(out), inputs=upstream, resumed_at_step=resumed_at,
                      samples_per_s=float(np.median(speeds)) if speeds else 0.0,
                      peak_gib=max((row.peak_gib or 0.0 for row in history), default=0.0),
                      comfyui_lora_path=str(comfyui) if comfyui.is_file() else None)
