"""The lora stage: flow-matching LoRA training from the latent and text caches only (no VAE, no text encoder).

Determinism is what makes resume exact: the batch order of an epoch comes from (seed, epoch) and the noise
and sigmas of a step from (seed, step), so a run resumed at step k draws what it would have drawn.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from loraflow.config import LoraflowConfig
from loraflow.keys import content_key, data_version
from loraflow.kernels.flow_matching import lr_at, noisy_sample, sample_sigmas
from loraflow.ops.devices import free_models, peak_memory_gib, pick_device
from loraflow.ops.report import StageReport
from loraflow.pipelines.base import ModelFamily, load_component
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "train-1"
LORA_FILE = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class Sample:
    latent_key: str
    text_key: str
    group: tuple[str, int]  # (bucket, text tokens): only equal groups share a batch


def upstream_versions(store: Store) -> dict[str, str]:
    """The data versions training reads: the lineage of an adapter."""
    return {stage: data_version(r["key"] for r in store.read_manifest(stage)) for stage in ("latents", "text_embeds")}


def run_dir(config: LoraflowConfig, upstream: dict[str, str]) -> Path:
    """Where one training run lives: keyed by its inputs' data versions and the config, so a change starts fresh."""
    settings = config.model_dump(exclude={"validation_prompt", "validation_resolution", "validation_num_video_frames",
                                          "validation_guidance", "validation_num_inference_steps", "output_dir"})
    key = content_key(inputs=upstream, config=settings, code=CODE_VERSION)
    return Path(config.output_dir) / "runs" / key


def current_lora_path(config: LoraflowConfig, store: Store) -> str:
    path = run_dir(config, upstream_versions(store)) / LORA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA trained for the current caches and config ({path}): materialize `lora` first")
    return str(path)


def build_samples(store: Store) -> list[Sample]:
    clips = {row["key"]: row for row in store.read_manifest("clips")}
    texts = {row["text"]: row["key"] for row in store.read_manifest("text_embeds")}
    tokens = {k: r["n_tokens"] for k, r in store.get("text_embeds", texts.values(), columns=["n_tokens"]).items()}
    samples = []
    for row in store.read_manifest("latents"):
        clip = clips[row["clip_key"]]
        for caption in clip["captions"]:
            text_key = texts[caption]
            samples += [Sample(row["key"], text_key, (row["bucket"], tokens[text_key]))] * clip["repeats"]
    return samples


def epoch_batches(samples: list[Sample], batch_size: int, seed: int, epoch: int) -> list[list[Sample]]:
    """Seeded shuffle, then batches drawn within (bucket, text length) groups; the batch order is shuffled too."""
    rng = random.Random(f"{seed}-{epoch}")
    order = samples[:]
    rng.shuffle(order)
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in order:
        groups.setdefault(sample.group, []).append(sample)
    batches = [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    rng.shuffle(batches)
    return batches


def batch_at(samples: list[Sample], config: LoraflowConfig, micro_step: int) -> list[Sample]:
    per_epoch = len(epoch_batches(samples, config.train_batch_size, config.seed, 0))
    epoch, index = divmod(micro_step, per_epoch)
    return epoch_batches(samples, config.train_batch_size, config.seed, epoch)[index]


def add_lora(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> list[torch.nn.Parameter]:
    torch.manual_seed(config.seed)  # lora_A's init: same seed, same adapter
    transformer.add_adapter(LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha or config.lora_rank, lora_dropout=config.lora_dropout,
        target_modules=family.lora_targets(config.lora_include_ffn), init_lora_weights=True,
    ))
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()  # fp32 LoRA params even when the base model is bf16
        p.requires_grad_(True)
    return params


def step_loss(
    transformer: torch.nn.Module, family: ModelFamily, store: Store, batch: list[Sample], generator: torch.Generator,
    config: LoraflowConfig, device: torch.device, empty_key: str,
) -> torch.Tensor:
    """Flow-matching loss of one micro-batch: x_t = (1-s) x0 + s noise, target noise - x0."""
    latents = store.get("latents", [s.latent_key for s in batch])
    x0 = torch.from_numpy(np.stack([latents[s.latent_key]["latent"] for s in batch])).to(device)  # (B, C, T, h, w)
    drop = torch.rand(1, generator=generator).item() < config.caption_dropout_probability
    text_keys = [empty_key if drop else s.text_key for s in batch]
    text_rows = store.get("text_embeds", set(text_keys))
    text = family.collate_text([text_rows[k] for k in text_keys], device)
    noise = torch.randn(x0.shape, generator=generator).to(device)
    shift = config.flow_schedule_shift or family.flavour.flow_shift
    sigma = sample_sigmas(len(batch), generator, config.flow_sigma_sampling, shift, config.flow_sigmoid_scale).to(device)
    prediction = family.velocity(transformer, noisy_sample(x0, noise, sigma), sigma, text)
    return F.mse_loss(prediction.float(), (noise - x0).float())


def train_lora(config: LoraflowConfig, family: ModelFamily, store: Store) -> StageReport:
    upstream = upstream_versions(store)
    out = run_dir(config, upstream)
    if (out / LORA_FILE).is_file():
        return _report(out, upstream, computed=0)
    samples = build_samples(store)
    empty_key = next(r["key"] for r in store.read_manifest("text_embeds") if r["text"] == "")
    device = pick_device()
    transformer = load_component(config.pretrained_model_name_or_path, "transformer", torch.float32, str(device))
    params = add_lora(transformer, config, family)
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=1e-2)
    start = resume(out, transformer, optimizer)
    history = _read_history(out)
    transformer.train()
    for step in range(start, config.max_train_steps):
        began = time.perf_counter()
        lr = lr_at(step, config.learning_rate, config.lr_warmup_steps, config.max_train_steps, config.lr_scheduler)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(config.gradient_accumulation_steps):
            micro_step = step * config.gradient_accumulation_steps + micro
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + micro_step)
            batch = batch_at(samples, config, micro_step)
            loss = step_loss(transformer, family, store, batch, generator, config, device, empty_key)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: loss is {loss.item()}; lower learning_rate or check the caches")
            (loss / config.gradient_accumulation_steps).backward()
            loss_sum += loss.item() / config.gradient_accumulation_steps
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ms = (time.perf_counter() - began) * 1000
        history.append({"step": step + 1, "loss": loss_sum, "lr": lr, "grad_norm": grad_norm, "ms": ms})
        log.info("step %d/%d | loss %.4f | lr %.1e | %.0f ms | %.1f GiB", step + 1, config.max_train_steps,
                 loss_sum, lr, ms, peak_memory_gib(device))
        if (step + 1) % config.checkpointing_steps == 0 and step + 1 < config.max_train_steps:
            save_checkpoint(out, step + 1, transformer, optimizer, history, config.checkpoints_total_limit)
    export_lora(out, transformer, family)
    _write_json(out / "history.json", history)
    free_models(transformer)
    return _report(out, upstream, computed=config.max_train_steps - start)


def _report(out: Path, upstream: dict[str, str], computed: int) -> StageReport:
    history = _read_history(out)
    return StageReport(
        data_version=out.name, computed=computed, reused=0 if computed else 1,
        tables={"history": history}, facts={"lora_path": str(out / LORA_FILE), "run_dir": str(out), "inputs": upstream},
    )


# -- checkpoints: safetensors + JSON, written to a temporary folder and renamed ---------------------------
def save_checkpoint(out: Path, step: int, transformer: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    history: list[dict], total_limit: int | None) -> Path:
    final = out / "checkpoints" / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(get_peft_model_state_dict(transformer), tmp / "lora.safetensors")
    tensors, scalars = _flatten_optimizer(optimizer)
    save_file(tensors, tmp / "optimizer.safetensors")
    _write_json(tmp / "state.json", {"step": step, "optimizer": scalars, "history": history})
    tmp.rename(final)
    for old in sorted((out / "checkpoints").glob("step-???????"))[: -total_limit if total_limit else None]:
        shutil.rmtree(old)
    return final


def resume(out: Path, transformer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest complete checkpoint; return the step to continue from (0 when none)."""
    done = sorted((out / "checkpoints").glob("step-???????"))
    if not done:
        return 0
    latest = done[-1]
    set_peft_model_state_dict(transformer, load_file(latest / "lora.safetensors"))
    state = json.loads((latest / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(load_file(latest / "optimizer.safetensors"), state["optimizer"]))
    log.info("resuming from %s", latest)
    return state["step"]


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors = {f"{pid}.{name}": value.contiguous() for pid, entry in state["state"].items()
               for name, value in entry.items()}
    return tensors, {"param_groups": state["param_groups"]}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        pid, field = name.split(".", 1)
        state.setdefault(int(pid), {})[field] = value
    return {"state": state, "param_groups": scalars["param_groups"]}


def export_lora(out: Path, transformer: torch.nn.Module, family: ModelFamily) -> None:
    """diffusers format through the family's own writer, renamed into place."""
    tmp = out / "export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    family.save_lora(get_peft_model_state_dict(transformer), tmp)
    (tmp / LORA_FILE).rename(out / LORA_FILE)
    shutil.rmtree(tmp)


def _read_history(out: Path) -> list[dict]:
    if (out / "history.json").is_file():
        return json.loads((out / "history.json").read_text())
    done = sorted((out / "checkpoints").glob("step-???????"))
    return json.loads((done[-1] / "state.json").read_text())["history"] if done else []


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.rename(path)
