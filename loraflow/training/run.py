"""A training run: its identity (the inputs it reads, the folder it lives in, its finished LoRA, its report) and
`RunContext`, what every part of one run is handed. The validation stage and the asset checks find the LoRA here
without importing the training loop.

A run lives in output_dir/runs/<key>, keyed by the input caches' data versions and every config key that changes
numbers (`run_key_settings`) and the training code version:
    checkpoints/step-NNNNNNN/   lora + optimizer .safetensors, state.json (written as .tmp, then renamed)
    history.json, tensorboard/  per step: loss, lr, grad norm, ms, samples/s, peak GiB (CUDA), crepa_loss (CREPA),
                                audio_loss (train_audio), TFLOP/s and MFU (training/flops.py);
    attention.json              the attention kernel the run ran (attention_backend)
                                the event files per `report_to` (training/options/tracking.py)
    crepa_projector.safetensors CREPA's projector (also in each checkpoint; training/options/crepa_training.py)
    pytorch_lora_weights_ema.safetensors   use_ema: the adapter's EMA (also in each checkpoint; training/options/ema.py)
    pytorch_lora_weights.safetensors   the adapter, diffusers format, written last: the run is done
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loraflow.config import LoraflowConfig
from loraflow.config.run_key import run_key_settings
from loraflow.contracts.audio_rows import read_audio_rows
from loraflow.contracts.clip_rows import read_clips
from loraflow.contracts.latent_rows import read_latent_rows
from loraflow.contracts.reports import LoraReport, TrainStep
from loraflow.contracts.teacher_features import teacher_version
from loraflow.contracts.text_set import text_lookup
from loraflow.keys import content_key, data_version
from loraflow.pipelines.base import ModelFamily
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store
from loraflow.training.batches import training_texts
from loraflow.training.checkpoints import LORA_FILE, comfyui_twin, musubi_twin
from loraflow.training.options.adapters import init_lora_version

if TYPE_CHECKING:
    import torch

    from loraflow.training.launch.distributed import World

CODE_VERSION = "train-2"


@dataclass(frozen=True)
class RunContext:
    """One run as every part of it sees it: what to train (config, family, model source, store), where it lives
    (`out`, the run folder of `upstream`: `run_dir`) and where this process trains (its rank in `world`, `device`)."""
    config: LoraflowConfig
    family: ModelFamily
    model: ModelSource
    store: Store
    upstream: dict[str, str]
    out: Path
    world: World
    device: torch.device


def upstream_versions(store: Store, config: LoraflowConfig, family: ModelFamily) -> dict[str, str]:
    """The data versions training reads: the lineage of an adapter.

    Only the texts training reads (captions and the empty prompt): a new validation prompt re-renders, never retrains.
    With CREPA on, the teacher features too (of `family` as the caller resolved it; other teacher weights in the same
    folder: a new run); with `train_audio`, every clip's audio row (a latent, or why none); with `init_lora`, the
    tensors training starts from.
    """
    read = set(training_texts(read_clips(store)))
    text_keys = [key for item, key in text_lookup(store).items() if item in read]
    versions = {"latents": data_version(r.key for r in read_latent_rows(store)),
                "text_embeds": data_version(text_keys)}
    if config.crepa_enabled:
        versions["teacher_features"] = teacher_version(config, family, store)
    if config.train_audio:
        # the status too: a clip whose decoding timed out (not stored, tried again) trains otherwise once it decodes
        versions["audio_latents"] = data_version(f"{r.key}:{r.status}" for r in read_audio_rows(store).values())
    if config.init_lora is not None:  # the tensors training starts from
        versions["init_lora"] = init_lora_version(config.init_lora)
    return versions


def run_dir(config: LoraflowConfig, upstream: dict[str, str]) -> Path:
    """Where one training run lives: keyed by its inputs' data versions and the config, so a change starts fresh."""
    key = content_key(inputs=upstream, config=run_key_settings(config), code=CODE_VERSION)
    return Path(config.output_dir) / "runs" / key


def current_run_dir(config: LoraflowConfig, family: ModelFamily, store: Store) -> Path:
    """The folder of the run the current caches and config make (trained or not)."""
    return run_dir(config, upstream_versions(store, config, family))


def current_lora_path(config: LoraflowConfig, family: ModelFamily, store: Store) -> str:
    """The finished adapter of the run the current caches and config make; FileNotFoundError when not trained."""
    path = current_run_dir(config, family, store) / LORA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA trained for the current caches and config ({path}): materialize `lora` first")
    return str(path)


def lora_report(out: Path, upstream: dict[str, str], computed: int, resumed_at: int = 0) -> LoraReport:
    """The report of the run in `out`, read from its folder (also by the process that launched the trainers)."""
    rows = json.loads((out / "history.json").read_text())  # written before the adapter: always there
    history = tuple(TrainStep(**row) for row in rows)
    speeds = [row.samples_per_s for row in history if row.samples_per_s is not None]
    rates, mfus = ([getattr(row, k) for row in history if getattr(row, k) is not None] for k in ("tflops", "mfu"))
    attention = out / ATTENTION_FILE
    comfyui, musubi = comfyui_twin(out / LORA_FILE), musubi_twin(out / LORA_FILE)
    return LoraReport(data_version=out.name, computed=computed, reused=0 if computed else 1, history=history,
                      lora_path=str(out / LORA_FILE), run_dir=str(out), inputs=upstream, resumed_at_step=resumed_at,
                      samples_per_s=float(np.median(speeds)) if speeds else 0.0,
                      peak_gib=max((row.peak_gib or 0.0 for row in history), default=0.0),
                      comfyui_lora_path=str(comfyui) if comfyui.is_file() else None,
                      musubi_lora_path=str(musubi) if musubi.is_file() else None,
                      attention_backend=json.loads(attention.read_text())["backend"] if attention.is_file() else None,
                      tflops=float(np.median(rates)) if rates else None, mfu=float(np.median(mfus)) if mfus else None)


ATTENTION_FILE = "attention.json"  # the attention kernel the run's last process ran: {"backend", "setting", "device"}
