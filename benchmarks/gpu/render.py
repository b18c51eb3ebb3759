"""One validation render of HunyuanVideo 1.5 at 1280x720x121, phase by phase: peak memory and seconds beside the
estimate `loraflow check` makes of it (`estimates.render_phases`).

A render holds the transformer while it denoises and the VAE while it decodes (`pipelines/render_memory.py`):
- denoise: the transformer of the training measurement's checkpoint (`train.py`, the released t2v-720p config,
  random weights) loaded as `training.model_setup.load_transformer` stores it, fp8 layerwise with its fp32 LoRA (what
  validation renders with since issue 43), then one no-grad `family.velocity` call at the render's latent
  (loraflow's key-mask attention, bf16 autocast): one denoising step of the 50 (each step is this call, twice with
  classifier-free guidance, one after the other);
- decode: the released VAE config (random weights) in the transformer's compute dtype, bf16, decoding that latent
  whole, then with diffusers' tiling (what the plan for a 24 GB card adds).
Each phase's result is printed when it ends (run.py keeps what a cut-off run finished). `--smoke`: the tiny
HunyuanVideo 1.5 at 64x96, 9 frames, on the CPU.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, Iterator

from train import MODELS, checkpoint_folder, transformer_config, variant_config

SMOKE = {"size": (64, 96), "frames": 9}
PRECISION = "checkpointing+fp8"  # the train.py variant whose storage the render loads (fp8 layerwise)


def latent_shape(family: Any, vae: dict[str, Any], frames: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
    from loraflow.stages.clips.buckets import vae_geometry

    return vae_geometry(vae, family).shape(frames, *size)


def vae_config(folder: Path, smoke: bool) -> dict[str, Any]:
    import json

    from loraflow.pipelines.released import released_config

    return json.loads((folder / "vae" / "config.json").read_text()) if smoke else released_config("t2v-720p", "vae")


def measure(work: Path, smoke: bool, model: str, size: tuple[int, int], frames: int) -> Iterator[dict[str, Any]]:
    import torch

    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.training.model_setup import load_transformer

    if smoke:
        size, frames = SMOKE["size"], SMOKE["frames"]
    folder = checkpoint_folder(work, model, smoke)
    if not (folder / "model_index.json").is_file():
        yield {"skipped": f"no checkpoint in {folder}: the training measurement of {model} writes it"}
        return
    device = torch.device("cpu" if smoke else "cuda")
    cuda = device.type == "cuda"
    config = variant_config(model, str(folder), PRECISION, smoke)
    family = get_family(config)
    latent = latent_shape(family, vae_config(folder, smoke), frames, size)
    result: dict[str, Any] = {"height": size[0], "width": size[1], "frames": frames, "latent": list(latent),
                              "precision": config.base_model_precision}

    transformer, _ = load_transformer(config, family, model_source(config), device)
    transformer.eval()
    text = family.collate_text([family.example_text_row(transformer.config, family.max_text_tokens)], device)
    x = torch.randn((1, *latent), generator=torch.Generator().manual_seed(0)).to(device)
    with phase(result, "denoise", cuda):
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            family.velocity(transformer, x, torch.tensor([0.5], device=device), text)
    del transformer, text
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    yield result

    from diffusers import AutoencoderKLHunyuanVideo15

    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo15.from_config(vae_config(folder, smoke)).to(dtype).eval()
    vae.encoder = None  # a render only decodes
    latents = x.to(dtype)
    for name, tiled in (("decode", False), ("decode_tiled", True)):
        if tiled:
            vae.enable_tiling()
        with phase(result, name, cuda):
            with torch.no_grad():
                vae.decode(latents)
        yield result


class phase:
    """Times a phase and records the accelerator's memory: allocated before it (what it holds: weights, inputs) and
    the peak during it, as `<name>_before_gib`, `<name>_peak_gib`, `<name>_activations_gib` (peak - before); a
    phase that runs out of memory records `<name>: oom`."""

    def __init__(self, result: dict[str, Any], name: str, cuda: bool) -> None:
        self.result, self.name, self.cuda = result, name, cuda

    def __enter__(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        self.began = time.perf_counter()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        import torch

        if kind is not None:
            if issubclass(kind, torch.OutOfMemoryError):
                self.result[self.name] = "oom"
                return True
            return False
        if self.cuda:
            torch.cuda.synchronize()
            gib = 2**30
            peak = torch.cuda.max_memory_allocated()
            self.result.update({f"{self.name}_before_gib": round(self.before / gib, 3),
                                f"{self.name}_peak_gib": round(peak / gib, 3),
                                f"{self.name}_activations_gib": round((peak - self.before) / gib, 3)})
        self.result[f"{self.name}_s"] = round(time.perf_counter() - self.began, 2)
        return False


def estimate(work: Path, smoke: bool, model: str, size: tuple[int, int], frames: int) -> dict[str, Any]:
    """`estimates.render_phases` for the same transformer, VAE and latent: each phase's parts as the measurement
    holds them (denoise: the transformer resident with its LoRA, no VAE; decode: the VAE alone, whole and tiled)."""
    import json

    from loraflow import estimates
    from loraflow.pipelines import get_family
    from loraflow.pipelines.render_memory import RenderPlan

    if smoke:
        size, frames = SMOKE["size"], SMOKE["frames"]
    folder = checkpoint_folder(work, model, smoke)
    config = variant_config(model, str(folder), PRECISION, smoke)
    family = get_family(config)
    transformer = json.loads((folder / "transformer" / "config.json").read_text()) if smoke else \
        transformer_config(model)
    configs = {"transformer": family.flavour.configured(transformer), "vae": vae_config(folder, smoke)}
    phases = estimates.render_phases(config, family, configs, latent_shape(family, configs["vae"], frames, size))
    if isinstance(phases, estimates.StageEstimate):
        return {"note": phases.note}
    plan = RenderPlan(precision=config.base_model_precision, kept=config.fp32_modules_storage)
    gib = 2**30
    return {"denoise_before_gib": round((phases.resident(plan) + phases.lora) / gib, 3),
            "denoise_activations_gib": round((phases.denoise + phases.nabla) / gib, 3),
            "decode_before_gib": round(phases.vae / gib, 3),
            "decode_activations_gib": round(phases.decode / gib, 3),
            "decode_tiled_activations_gib": (
                None if phases.decode_tiled is None else round(phases.decode_tiled / gib, 3)
            ),
            "tflop_per_denoise_call": round(phases.tflop, 1), "model": MODELS[model]["flavour"]}
