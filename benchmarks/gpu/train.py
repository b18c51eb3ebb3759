"""Seconds per LoRA training step, peak memory and counted FLOPs of real-size transformers (random weights).

Each transformer is its released config (loraflow/pipelines/released, cited there) at the size issue 40 names:
- `k5-lite`: Kandinsky 5 Video Lite t2v (2.01B), 512x768, 61 frames -> 24,576 visual tokens, rank 16;
- `hv15-480p`: HunyuanVideo 1.5 t2v 480p (8.33B), 480x848, 61 frames -> 25,440 visual tokens, rank 16;
- `hv15-720p`: HunyuanVideo 1.5 t2v 720p, 512x512, 81 frames -> 21,504 visual tokens, rank 32;
- `k5-pro`: Kandinsky 5 Video Pro t2v in its SD mode (19B), 256x256, 17 frames -> 1,280 visual tokens, rank 32.
bf16 weights unless the variant says fp8 (`base_model_precision`), bf16 autocast, fp32 LoRA on the family's
targets, AdamW, batch 1, through the pieces `train_lora` itself runs (load_transformer, enable_offload, Trainable,
routing, flow_terms). run.py runs each variant in a fresh process; the checkpoint is written once into its work
folder. A run that does not fit records `oom`. Group offload with streams must train the same LoRA as
checkpointing alone: its measurement compares the two LoRAs (when both ran), which checks that offloading keeps the
updates. `flops_per_step`: torch's FlopCounterMode over one more step (matmuls, convolutions and attention,
recomputation under checkpointing included), the numerator of run.py's MFU.

`--smoke` (run.py): the same code path on the CPU with the tiny checkpoints; streams and the real sizes are left
out.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

from loraflow.pipelines.sources import model_source

K5, HV15 = "kandinsky5-video", "hunyuanvideo-1.5"
VAE = {K5: (16, 8), HV15: (32, 16)}  # latent channels, spatial factor
MODELS: dict[str, dict[str, Any]] = {
    "k5-lite": {"family": K5, "flavour": "t2v-lite-sft-5s", "size": (512, 768), "frames": 61, "rank": 16,
                "text_tokens": 128},
    "hv15-480p": {"family": HV15, "flavour": "t2v-480p", "size": (480, 848), "frames": 61, "rank": 16,
                  "text_tokens": 128},
    "hv15-720p": {"family": HV15, "flavour": "t2v-720p", "size": (512, 512), "frames": 81, "rank": 32,
                  "text_tokens": 128},
    "k5-pro": {"family": K5, "flavour": "t2v-pro-sft-5s-sd", "size": (256, 256), "frames": 17, "rank": 32,
               "text_tokens": 128},
}
SMOKE_SIZE = {"size": (64, 96), "frames": 17, "text_tokens": 8}
TREAD = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "checkpointing": {"gradient_checkpointing": True},
    "checkpointing+offload": {"gradient_checkpointing": True, "enable_group_offload": True,
                              "group_offload_use_stream": True},
    "checkpointing+tread0.5": {"gradient_checkpointing": True, "tread_config": TREAD},
    "checkpointing+fp8": {"gradient_checkpointing": True, "base_model_precision": "fp8-layerwise"},
}
SAME_NUMBERS = {"checkpointing+offload": "checkpointing"}  # exact features: their LoRAs must agree


def measure(work: Path, smoke: bool, model: str, variant: str, steps: int = 6, warmup: int = 2) -> dict[str, Any]:
    """One variant: the median of `steps` timed steps after `warmup` (smoke: 1, no warm-up), peaks, counted FLOPs."""
    import torch

    folder = checkpoint_folder(work, model, smoke)
    if smoke:
        from loraflow.demo.tiny import build_tiny

        build_tiny(MODELS[model]["family"], folder)  # idempotent: the first variant builds it
        steps, warmup = 1, 0
    elif not (folder / "model_index.json").is_file():  # written last: a complete checkpoint
        write_checkpoint(model, folder)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the peak of training, not of writing the checkpoint
    lora = work / f"{model}-{variant}.safetensors"
    result = run_variant(model, str(folder), variant, steps, warmup, smoke, str(lora))
    if variant in SAME_NUMBERS:
        result["lora_max_abs_diff_vs_" + SAME_NUMBERS[variant]] = compare_loras(
            [lora, work / f"{model}-{SAME_NUMBERS[variant]}.safetensors"])
    return result


def checkpoint_folder(work: Path, model: str, smoke: bool) -> Path:
    """Where `model`'s checkpoint is written (smoke: the family's tiny one, shared by its models)."""
    return work / (MODELS[model]["family"] if smoke else model)


def transformer_config(model: str) -> dict[str, Any]:
    """The released transformer config of `model`'s flavour (loraflow/pipelines/released)."""
    from loraflow.pipelines.released import released_config

    return released_config(MODELS[model]["flavour"], "transformer")


def write_checkpoint(model: str, folder: Path) -> None:
    """A diffusers folder holding only the transformer: random N(0, 0.02) matrices, unit norms, zero biases; bf16.
    One released-size checkpoint at a time: the others in the work folder are removed first (Pro's is 38 GB, the
    machine's disk 64 GiB)."""
    import shutil

    import diffusers
    import torch

    for other in MODELS:
        if other != model:
            shutil.rmtree(folder.parent / other, ignore_errors=True)

    config = transformer_config(model)
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        model_ = cls.from_config(config)
    model_ = model_.to_empty(device="cuda").to(torch.bfloat16)
    generator = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():  # to_empty leaves garbage: set every parameter (random modulations: no identity blocks)
        for name, p in model_.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    model_.save_pretrained(folder / "transformer")
    del model_
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "bench", "transformer": [
        "diffusers", config["_class_name"]]}))


def run_variant(model: str, model_path: str, variant: str, steps: int, warmup: int, smoke: bool,
                lora_out: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from loraflow.pipelines import get_family
    from loraflow.training.checkpoints import lora_state
    from loraflow.training.model_setup import Trainable, enable_offload, load_transformer
    from loraflow.training.options.optimizers import WEIGHT_DECAY
    from loraflow.training.step import uses_autocast

    config = variant_config(model, model_path, variant, smoke)
    device = torch.device("cpu" if smoke else "cuda")
    family_obj = get_family(config)
    try:
        transformer, params = load_transformer(config, family_obj, model_source(config), device)
        enable_offload(transformer, config, family_obj, device)
        trainable = Trainable(transformer, params, device)
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=WEIGHT_DECAY)
        batch = random_batch(model, transformer.config, smoke)
        autocast = uses_autocast(config, device)
        times, losses = [], []
        for k in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            loss = one_step(transformer, family_obj, config, batch, device, autocast, trainable, optimizer, seed=k)
            losses.append(loss.item())  # syncs
            times.append(time.perf_counter() - began)
        peaks = peak_memory(device)  # before the counted step: FlopCounterMode's bookkeeping is no training memory
        flops = counted_flops(lambda: one_step(transformer, family_obj, config, batch, device, autocast, trainable,
                                               optimizer))
    except torch.cuda.OutOfMemoryError as err:
        return {"oom": True, "error": str(err).splitlines()[0]}
    except ValueError as err:  # a setting the family cannot do (e.g. TREAD without a token layout)
        return {"skipped": str(err)}
    save_file(lora_state(transformer), lora_out)
    timed = sorted(times[warmup:])
    return {"seconds_per_step": round(timed[len(timed) // 2], 4), "steps_timed": len(timed), **peaks,
            "flops_per_step": flops, "visual_tokens": visual_tokens(batch, MODELS[model]["family"]),
            "losses": [round(v, 5) for v in losses]}


def variant_config(model: str, model_path: str, variant: str, smoke: bool) -> Any:
    """The loraflow config a variant trains with."""
    from loraflow.config import parse_config

    keys = dict(VARIANTS[variant])
    if smoke:  # tiny models have 2 blocks; the CPU has no streams
        keys.pop("group_offload_use_stream", None)
        keys = {**keys, "tread_config": {"routes": [{**TREAD["routes"][0], "start_layer_idx": 0,
                                                     "end_layer_idx": -1}]}} if "tread_config" in keys else keys
    spec = MODELS[model]
    return parse_config({
        "model_family": spec["family"], "model_flavour": spec["flavour"], "pretrained_model_name_or_path": model_path,
        "datasets": [{"id": "bench", "instance_data_dir": "unused"}], "lora_rank": spec["rank"],
        "base_model_precision": "bf16", **keys})


def estimate(work: Path, smoke: bool, model: str, variant: str) -> dict[str, Any]:
    """loraflow/estimates' training step for the same config, transformer config, latent and caption length
    as `measure`, on fake tensors (CPU only, no weights read): run.py --estimate writes them before a GPU run."""
    from loraflow import estimates
    from loraflow.pipelines import get_family

    folder = checkpoint_folder(work, model, smoke)
    spec = {**MODELS[model], **(SMOKE_SIZE if smoke else {})}
    if smoke:  # the tiny checkpoint's config; run.py builds it before the child starts
        configured = json.loads((folder / "transformer" / "config.json").read_text())
    else:  # the config write_checkpoint saves
        configured = transformer_config(model)
    config = variant_config(model, str(folder), variant, smoke)
    family = get_family(config)
    step = estimates.training_step(config, family, family.flavour.configured(configured), latent_shape(spec),
                                   text_tokens=spec["text_tokens"])
    if not step.parts:
        return {"peak_allocated_gib": None, "flops_per_step": None, "note": step.note}
    return {"peak_allocated_gib": round(step.peak_gib, 6), "flops_per_step": int(step.tflop * 1e12),
            "parts_gib": {k: round(v / 2**30, 6) for k, v in step.parts.items()}}


def latent_shape(spec: dict[str, Any]) -> tuple[int, int, int, int]:
    """(C, T, h, w) of the benchmark's latent: `spec` is MODELS[model], with SMOKE_SIZE over it in smoke mode."""
    channels, factor = VAE[spec["family"]]
    (height, width), frames = spec["size"], spec["frames"]
    return channels, (frames - 1) // 4 + 1, height // factor, width // factor


def one_step(transformer: Any, family: Any, config: Any, batch: Any, device: Any, autocast: bool, trainable: Any,
             optimizer: Any, seed: int = 0) -> Any:
    """What train_lora's loop does for one micro-step of batch 1: routed forward, backward, collect, clip + step."""
    from loraflow.training.step import flow_terms, routing

    with routing(transformer, family, config, seed=seed):
        loss = flow_terms(transformer, family, batch, device, autocast).flow
        loss.backward()
    trainable.collect()
    trainable.step(optimizer, 1.0)
    return loss


def counted_flops(step: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def peak_memory(device: Any) -> dict[str, float | None]:
    import torch

    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def random_batch(model: str, dims: Any, smoke: bool) -> Any:
    """Latents and text of the benchmark size, with the family's text row layout (what text_embeds stores)."""
    import numpy as np
    import torch

    from loraflow.config import parse_config
    from loraflow.pipelines import get_family
    from loraflow.training.batches import MicroBatch, StepDraws

    spec = {**MODELS[model], **(SMOKE_SIZE if smoke else {})}
    family, tokens = spec["family"], spec["text_tokens"]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, *latent_shape(spec), generator=g)
    rng = np.random.default_rng(0)
    if family == "kandinsky5-video":
        row = {"text_embeds": rng.standard_normal((tokens, dims.in_text_dim), np.float32),
               "pooled_embeds": rng.standard_normal(dims.in_text_dim2, np.float32)}
    else:
        row = {"text_embeds": rng.standard_normal((tokens, dims.text_embed_dim), np.float32),
               "byt5_embeds": np.zeros((1, dims.text_embed_2_dim), np.float32), "byt5_mask": np.zeros(1, np.float32)}
    config = parse_config({"model_family": family, "pretrained_model_name_or_path": "unused",
                           "datasets": [{"id": "bench", "instance_data_dir": "unused"}]})
    text = get_family(config).collate_text([row], torch.device("cpu"))
    draws = StepDraws(False, torch.randn(x0.shape, generator=g), torch.tensor([0.7]), 0)
    return MicroBatch([], x0, text, draws)


def visual_tokens(batch: Any, family: str) -> int:
    _, _, t, h, w = batch.x0.shape
    return t * h * w // (4 if family == "kandinsky5-video" else 1)  # K5 patches 2x2, HV1.5 1x1


def compare_loras(paths: list[Path]) -> float | None:
    from safetensors.torch import load_file

    if not all(p.is_file() for p in paths):
        return None
    a, b = (load_file(p) for p in paths)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
