"""The lora stage: flow-matching LoRA training from the latent and text caches only (no VAE, no text encoder).

`train_lora` plans the run (its folder and identity: training/run.py), sets up the model (training/model_setup.py),
runs the optimizer steps (`run_steps`: lr, micro-steps, finite check, step, log, checkpoint) and writes the adapter.
A micro-step's loss is training/step.py's.

With `train_audio` (Kandinsky 6) a micro-batch with sound trains both streams in one call, at one sigma per sample
(step.py `flow_terms`): the loss is the video's flow-matching term plus the audio's, each its own mean.

Resume is exact (training/batches.py: samples, batches, draws): an epoch's batch order comes from (seed, epoch) and
every random draw of a micro-step (caption dropout, noise, sigmas, TREAD's tokens, LoRA dropout, scheduled
sampling's rollouts) from (seed, micro-step). The forward runs under bf16 autocast on CUDA (`uses_autocast`); AdamW's
moments are fp32 unless `optimizer: adamw_bf16`.

Under a launcher (num_processes > 1) each rank trains its share of every step and only rank 0 writes
(training/launch/distributed.py; loraflow/train_main.py is the launched entry point).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save_file

from loraflow.atomic import write_json
from loraflow.config import LoraflowConfig
from loraflow.config.run_key import run_key_settings
from loraflow.contracts.clip_rows import changed_sources, changed_sources_warning
from loraflow.contracts.reports import LoraReport, TrainStep
from loraflow.contracts.shifts import training_shift
from loraflow.contracts.teacher_features import teacher_keys
from loraflow.kernels.attention_backend import attention_backend_of
from loraflow.kernels.devices import free_models, peak_memory_gib
from loraflow.kernels.flow_matching import lr_at
from loraflow.kernels.losses import LossType
from loraflow.keys import content_key, tensors_fingerprint
from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.sources import ModelSource
from loraflow.stages.teacher.teacher_features import cache_teacher_features
from loraflow.store import Store
from loraflow.training.batches import BatchPlan, MicroBatch, build_samples, load_micro_batch, step_seed
from loraflow.training.checkpoints import (
    LORA_FILE,
    LoraExport,
    adapter_config,
    export_lora,
    export_twins,
    latest_checkpoint,
    lora_state,
    optimizer_state,
    resume_optimizer,
    save_checkpoint,
    writes_comfyui,
    writes_musubi,
)
from loraflow.training.flops import MicroStepFlops, StepRate, card_peak_tflops, step_flops
from loraflow.training.launch.distributed import (
    average_gradients_,
    barrier,
    check_same_everywhere,
    gathered,
    join,
    sum_over_ranks,
)
from loraflow.training.model_setup import TrainingModel, setup_model
from loraflow.training.options.crepa_training import projector_state
from loraflow.training.options.ema import EMA_CHECKPOINT_FILE, EMA_LORA_FILE
from loraflow.training.options.optimizers import averaged_weights, exported, make_optimizer, set_lr
from loraflow.training.options.progress_renders import ProgressRenders
from loraflow.training.options.tracking import open_sink
from loraflow.training.row_cache import RowCache, prefetched
from loraflow.training.run import ATTENTION_FILE, RunContext, lora_report, run_dir, upstream_versions
from loraflow.training.step import flow_terms, routing, uses_autocast

log = logging.getLogger(__name__)


# 1. the run ----------------------------------------------------------------------------------------------------
def at_training_shift(config: LoraflowConfig, family: ModelFamily, model: ModelSource) -> ModelFamily:
    """The family with its flavour's `training_shift` the run's default (`contracts.shifts.training_shift`: the
    checkpoint's scheduler config where the flavour's recipe says so), which `step_draws` reads."""
    shift = training_shift(config, family.flavour, model).value
    if shift is None or shift == family.flavour.training_shift:
        return family
    return replace(family, flavour=replace(family.flavour, training_shift=shift))


def train_lora(config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store) -> LoraReport:
    """Train (or resume, or reuse) the run of these caches and config; under a launcher, as one of its ranks."""
    family = at_training_shift(config, family, model)
    store = store.named(config.manifest_names)  # the config's own lists, whoever opened the store
    # 1. plan: inputs, run folder, samples, the same on every rank; a finished run is reused as it is
    world, device = join(config.num_processes, config.fsdp)
    changed = changed_sources(store, config.dataset_folders) if world.main else []
    if changed:  # the caches are what they are: trained on as they are, with a warning naming the files
        log.warning(changed_sources_warning(changed))
    if config.crepa_enabled and world.main:  # the teacher_features stage: computes what the store lacks
        cache_teacher_features(config, family, store)
    barrier(world)
    upstream = upstream_versions(store, config, family)
    run = RunContext(config, family, model, store, upstream, run_dir(config, upstream), world, device)
    out = run.out
    finished = (out / LORA_FILE).is_file()
    check_same_everywhere("the run folder", lambda: content_key(run=out.name, finished=finished), world, device)
    # `lora_format: comfyui` / `musubi` that cannot be: an error before any training
    twins = writes_comfyui(config, family), writes_musubi(config, family)
    if finished:
        if world.main:  # a run finished without its ComfyUI / musubi files gets them, converted (no retraining)
            reuse = LoraExport({}, family, *twins)
            for lora_file in (out / LORA_FILE, out / EMA_LORA_FILE):
                if lora_file.is_file():
                    export_twins(lora_file, reuse)
        return lora_report(out, upstream, computed=0)
    samples = build_samples(config, store)
    check_same_everywhere("the samples", lambda: content_key(samples=[(s.latent_key, s.text_key) for s in samples]),
                          world, device)
    plan = BatchPlan(samples, config.train_batch_size, config.seed)
    out.mkdir(parents=True, exist_ok=True)
    # 2. model: precision, LoRA (resumed), memory features (training/model_setup.py), optimizer (resumed)
    checkpoint = latest_checkpoint(out)
    trained = setup_model(run, checkpoint)
    if world.main:
        write_json(out / ATTENTION_FILE, {"backend": attention_backend_of(trained.transformer),
                                          "setting": config.attention_backend, "device": device.type})
    params = trained.trainable.params
    optimizer = make_optimizer(config, params, trained.transformer)
    start, rows = resume_optimizer(checkpoint, optimizer) if checkpoint is not None else (0, [])
    history = [TrainStep(**row) for row in rows]
    # 3. steps
    export = LoraExport(adapter_config(trained.transformer), family, *twins)  # users' files: checkpoints, the end
    history = run_steps(run, plan, trained, optimizer, start, history, export)
    check_same_everywhere("the trained LoRA weights", partial(tensors_fingerprint, [gathered(p) for p in params]),
                          world, device)
    # 4. rank 0 writes the history, then the adapter: the adapter's presence marks the run done
    exported(optimizer)  # schedule-free: its averaged weights
    lora = lora_state(trained.transformer)  # on every rank: under FSDP it gathers the shards
    if world.main:
        write_json(out / "history.json", [row.json_row() for row in history])
        for name, tensors in projector_state(trained.crepa).items():  # beside the adapter, before it marks the run done
            save_file(tensors, out / name)
        if trained.ema is not None:
            export_lora(out, trained.ema.state(), export, EMA_LORA_FILE)
        export_lora(out, lora, export)
    barrier(world)  # every rank returns once the run is done
    del trained, optimizer, params  # the last references: free_models can free the weights
    free_models()
    return lora_report(out, upstream, computed=config.max_train_steps - start, resumed_at=start)


# 2. the steps --------------------------------------------------------------------------------------------------
def run_steps(run: RunContext, plan: BatchPlan, trained: TrainingModel, optimizer: torch.optim.Optimizer, start: int,
              history: list[TrainStep], export: LoraExport | None = None) -> list[TrainStep]:
    """Optimizer steps start..max_train_steps: set lr, micro-steps (each checked finite), average over ranks, clip +
    step, log, checkpoint (with `export`, each checkpoint also holds the adapter's files for users), render."""
    config, world, device = run.config, run.world, run.device
    batches = micro_batches(run, plan, start, trained.crepa is not None)
    sink = open_sink(config.report_to, run.out, start, run_key_settings(config)) if world.main else None
    renders = ProgressRenders(run, trained.transformer)
    renders.at_startup(start)  # validation_on_startup; resets the peak memory itself
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = card_peak_tflops(torch.cuda.get_device_name(device), config.gpu_peak_tflops) \
        if device.type == "cuda" else None
    flops: dict[tuple, MicroStepFlops] = {}  # micro-batch shapes -> their counted FLOPs
    trained.transformer.train()
    try:
        for step in range(start, config.max_train_steps):
            began = time.perf_counter()
            lr = lr_at(step, config.learning_rate, config.lr_warmup_steps, config.max_train_steps, config.lr_scheduler)
            set_lr(optimizer, lr)
            losses, seen, counted = micro_steps(run, trained, batches, step, flops)  # flow, CREPA, audio terms
            if config.train_audio:  # a step without sound left the audio stream's gradients None on this rank
                trained.trainable.fill_missing()
            average_gradients_(trained.trainable.gradients(), world)
            grad_norm = trained.trainable.step(optimizer, config.max_grad_norm, config.grad_clip_method)  # same on all
            if trained.ema is not None:
                trained.ema.after_step(step + 1, get_peft_model_state_dict(trained.transformer))
            loss_sum, crepa_sum, audio_sum, seen = sum_over_ranks([*(x / world.size for x in losses), seen],
                                                                  world, device)
            if world.main:
                extra = {} if trained.crepa is None else {"crepa_loss": crepa_sum}
                extra |= {"audio_loss": audio_sum} if config.train_audio else {}
                seconds = time.perf_counter() - began
                rate = StepRate.of(counted, seconds, peak)  # this rank's FLOPs: each rank trains its share
                history.append(_log_step(step + 1, config.max_train_steps, loss_sum, lr, grad_norm, seconds, seen,
                                         device, sink, extra, rate, peak))
            if (step + 1) % config.checkpointing_steps == 0 and step + 1 < config.max_train_steps:
                save_step(run, step + 1, trained, optimizer, history, export)
            due = renders.every and (step + 1) % renders.every == 0
            with averaged_weights(optimizer) if due else nullcontext():  # schedule-free renders x
                renders.after_step(step + 1)
    finally:
        batches.close()
        if sink is not None:
            sink.close()
    return history


def micro_batches(run: RunContext, plan: BatchPlan, start: int, crepa: bool) -> Iterator[MicroBatch]:
    """The batches of this rank's micro-steps from optimizer step `start` on, loaded ahead. Local micro-step j of
    this rank is global micro-step world.micro_step(j): its batch and its random draws."""
    config, family, world = run.config, run.family, run.world
    accum, rows = config.gradient_accumulation_steps, RowCache(run.store)
    teacher = teacher_keys(config, family, run.store) if crepa else None
    return prefetched(lambda j: load_micro_batch(config, family, rows, plan(world.micro_step(j)), world.micro_step(j),
                                                 teacher),
                      range(start * accum, config.max_train_steps * accum))


def micro_steps(run: RunContext, trained: TrainingModel, batches: Iterator[MicroBatch], step: int,
                flops: dict[tuple, MicroStepFlops]) -> tuple[list[float], int, list[MicroStepFlops]]:
    """Forward and backward of optimizer step `step`'s micro-steps, gradients accumulated in `trained.trainable`;
    a loss that is not finite stops the run before any update. Returns the mean flow loss, CREPA term and audio term
    (`train_audio`: within the flow loss; 0 for a micro-batch without sound), the samples seen, and each micro-step's
    FLOPs (counted at the first micro-step of each shape, remembered in `flops`)."""
    config, family, device, transformer = run.config, run.family, run.device, trained.transformer
    accum, autocast = config.gradient_accumulation_steps, uses_autocast(config, device)
    loss_type = LossType(config.loss_type, config.huber_c, config.huber_schedule)
    losses, seen, counted = [0.0, 0.0, 0.0], 0, []
    for micro in range(step * accum, (step + 1) * accum):
        batch = next(batches)
        if config.lora_dropout:  # peft's dropout draws from the global RNG
            torch.manual_seed(step_seed(config.seed, run.world.micro_step(micro), "lora_dropout"))
        shape = batch_shape(batch)
        counter = step_flops() if shape not in flops else None  # a new shape: its FLOPs counted once
        with routing(transformer, family, config, batch.draws.seed), counter or nullcontext():
            terms = flow_terms(transformer, family, batch, device, autocast, trained.crepa, loss_type)
            loss, term = terms.flow, terms.crepa
            total = loss if term is None else loss + term
            if not torch.isfinite(total):
                raise FloatingPointError(f"step {step + 1}: loss is {total.item()}; no update was made. "
                                         "Lower learning_rate, or check the latent and text caches")
            if config.fsdp:  # reduce-scatter once per step, as DDP's all-reduce: the same sums in order
                transformer.set_requires_gradient_sync(micro == (step + 1) * accum - 1)
            if counter is not None:
                counter.in_backward = True
            (total / accum if accum > 1 else total).backward()
        if counter is not None:
            flops[shape] = counter.counted()
        counted.append(flops[shape])
        trained.trainable.collect()
        losses = [value + (0.0 if part is None else part.item() / accum)
                  for value, part in zip(losses, (loss, term, terms.audio))]
        seen += len(batch.samples)
    return losses, seen, counted


def batch_shape(batch: MicroBatch) -> tuple:
    """What a micro-step's FLOPs depend on: the shapes of its latents, texts, teacher features and sound."""
    parts = [batch.x0, *batch.text.values(), batch.teacher, *(() if batch.audio is None else (batch.audio.x0,))]
    return tuple(tuple(t.shape) for t in parts if isinstance(t, torch.Tensor))


def _log_step(step: int, total: int, loss: float, lr: float, grad_norm: float, seconds: float, seen: int,
              device: torch.device, sink: Any, extra: dict[str, float], rate: StepRate,
              peak: float | None) -> TrainStep:
    """One greppable line, one point per number in the `report_to` sink, one history row. `loss` is the flow loss
    alone; `extra` holds a regulariser's term (crepa_loss) and the audio term within the flow loss (audio_loss), each
    logged as its own series; `rate` the step's FLOP rate and MFU against `peak` (training/flops.py)."""
    row = TrainStep(step=step, loss=loss, lr=lr, grad_norm=grad_norm, ms=seconds * 1000, samples_per_s=seen / seconds,
                    peak_gib=peak_memory_gib(device) if device.type == "cuda" else None, **extra,
                    tflops=rate.tflops, mfu=rate.mfu, recompute_tflop=rate.recompute_tflop or None)
    log.info("step %d/%d | loss %.4f%s | lr %.1e | grad %.3f | %.0f ms | %.2f samples/s | %s GiB%s", step, total,
             loss, "".join(f" | {k} {v:.4f}" for k, v in extra.items()), lr, grad_norm, row.ms, row.samples_per_s,
             "-" if row.peak_gib is None else f"{row.peak_gib:.1f}", rate.line(peak))
    if sink is not None:
        sink.log({k: v for k, v in row.json_row().items() if k != "step"}, step)
    return row


def save_step(run: RunContext, step: int, trained: TrainingModel, optimizer: torch.optim.Optimizer,
              history: list[TrainStep], export: LoraExport | None = None) -> None:
    """Every rank takes the state (under FSDP: gathers the shards), rank 0 writes it (with `export`, also the
    adapter's files for users, as the run's end writes them)."""
    lora, moments = lora_state(trained.transformer), optimizer_state(optimizer)
    if run.world.main:
        ema = {} if trained.ema is None else {EMA_CHECKPOINT_FILE: trained.ema.state()}
        extra = projector_state(trained.crepa) | ema
        save_checkpoint(run.out, step, lora, moments, [row.json_row() for row in history],
                        run.config.checkpoints_total_limit, extra, export)
    barrier(run.world)  # no rank runs ahead of the newest checkpoint
