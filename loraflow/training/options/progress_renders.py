"""Renders during training: every `validation_steps` optimizer steps, each validation prompt with the LoRA as
trained so far, so a user sees the adapter evolve before the run ends; with `validation_on_startup`, also before the
first step (step 0: the base model, since a new LoRA is a no-op), so a user sees the base before spending hours.

Into the run folder (rank 0 only):
    validation/step-NNNNNNN/<nn>-<shortname>.mp4   h264 at the flavour's fps (.png for image families)
    validation/step-NNNNNNN/contact_sheet.png      every prompt's frames, labelled with its shortname
    validation/step-NNNNNNN/result.json            written last (with the render's peak GiB on CUDA): the step is
                                                   rendered, and a resumed run skips it
    validation/progress.png                        the first prompt's frames per rendered step, oldest on top

Training is not disturbed: the renderer runs the training transformer itself (no second copy on the device) in
eval mode under no_grad, with the global RNG states saved and restored, then hands it back in train mode. The
LoRA's numbers never change, and every training draw comes from its own (seed, micro-step) generator anyway, so
a run gives the same adapter bits with or without these renders. A resumed run retrains the lost steps to the
same bits, so a step rendered before the kill is not rendered again.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from loraflow.atomic import write_json
from loraflow.contracts.renders import conditioning_image, negative_prompt, prompt_image, render_settings, render_video
from loraflow.contracts.text_set import cached_texts
from loraflow.kernels.devices import peak_memory_gib
from loraflow.media.previews import contact_sheet
from loraflow.media.writers import read_media, save_png, slug, write_media
from loraflow.pipelines.render_memory import RenderPlan
from loraflow.training.launch.distributed import barrier
from loraflow.training.options.adapters import ADAPTER_PARAMETERS

if TYPE_CHECKING:
    from loraflow.training.run import RunContext

log = logging.getLogger(__name__)
RESULT = "result.json"
PROGRESS_SHEET = "progress.png"
MAX_PROGRESS_ROWS = 12  # the sheet is embedded in the lora asset's metadata: keep it small
PROGRESS_FRAMES = 4  # frames per step in the progress sheet: few, so twelve steps stay a short sheet
AS_TRAINED = None  # `lora_scale` for the renders: the training adapter as it is (see set_lora_scale)


class ProgressRenders:
    """Built before the first step (every rank: a missing embedding fails before any training); `at_startup`
    renders step 0 (validation_on_startup), `after_step` a multiple of validation_steps, on rank 0 while every rank
    waits for it."""

    def __init__(self, run: RunContext, transformer: torch.nn.Module) -> None:
        config, family, model, store = run.config, run.family, run.model, run.store
        self.every, self.on_startup = config.validation_steps or 0, config.validation_on_startup
        self.family, self.model, self.transformer, self.world = family, model, transformer, run.world
        self.folder = run.out / "validation"
        self.pipe: Any = None  # loaded at the first render
        # the VAE in the transformer's dtype (as the pipelines expect), tiled if the config says so; the transformer
        # stays as training holds it
        self.plan = RenderPlan(precision=config.base_model_precision, kept=config.fp32_modules_storage,
                               vae_tiling=config.vae_enable_tiling)
        if not self.every and not self.on_startup:
            return
        self.settings = render_settings(config, family, model, store)
        self.prompts, negative = config.validation_prompts, negative_prompt(config, family)
        clip, seen = prompt_image(config, family, store, self.settings)
        texts = cached_texts(store, [(t, seen) for t in [*self.prompts.values(), negative]])
        self.texts, self.negative = {n: texts[p, seen] for n, p in self.prompts.items()}, texts[negative, seen]
        self.image = conditioning_image(store, clip, self.settings, family.flavour.last_frame_given) if clip else None

    def at_startup(self, start: int) -> None:
        """Step 0 before a fresh run's first step; never on resume (the LoRA there is no longer the base)."""
        if self.on_startup and start == 0:
            self.render_once(0)

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.render_once(step)

    def render_once(self, step: int) -> None:
        if self.world.main and not (step_folder(self.folder, step) / RESULT).is_file():
            self.render(step)
        barrier(self.world)  # the other ranks wait here rather than in the next all-reduce

    def render(self, step: int) -> None:
        """Every prompt at this step: media, contact sheet, result.json, then the progress sheet again."""
        folder = step_folder(self.folder, step)
        folder.mkdir(parents=True, exist_ok=True)
        device = _device_of(self.transformer)
        _reset_peak(device)
        with rendering(self.transformer):
            pipe = self.renderer()
            videos = {name: render_video(self.family, pipe, text, self.negative, self.settings, self.image,
                                         lora_scale=AS_TRAINED) for name, text in self.texts.items()}
            pipe.vae.to("cpu")  # only the transformer stays on the device between renders
        peak = peak_memory_gib(device)
        _reset_peak(device)  # the history's peak_gib stays training's own
        fps = self.family.flavour.fps
        paths = {name: write_media(video, folder / f"{i:02d}-{slug(name)}", fps)
                 for i, (name, video) in enumerate(videos.items())}
        save_png(contact_sheet(videos, title=f"step {step}"), folder / "contact_sheet.png")
        write_json(folder / RESULT, {"step": step, "prompts": self.prompts, "peak_gib": peak,
                                     "media": {n: str(p) for n, p in paths.items()}})
        save_png(progress_sheet(self.folder), self.folder / PROGRESS_SHEET)
        log.info("step %d: rendered %d validation prompt(s) into %s", step, len(videos), folder)

    def renderer(self) -> Any:
        """The family's pipeline around the training transformer (with its adapter, never a second copy), the
        other components on the CPU until a render moves the VAE to the device. Built once per training process.
        """
        device = _device_of(self.transformer)
        if self.pipe is None:
            self.pipe = self.family.load_renderer(self.model, None, torch.device("cpu"), transformer=self.transformer,
                                                  plan=self.plan)
            self.pipe.set_progress_bar_config(disable=True)
        self.pipe.vae.to(device)
        return self.pipe


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step:07d}"


@contextmanager
def rendering(transformer: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no LoRA dropout), no autograd, and every global RNG as it was on entry, train mode on exit."""
    device = _device_of(transformer)
    states = random.getstate(), np.random.get_state()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    transformer.eval()
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            yield
    finally:
        transformer.train()
        random.setstate(states[0])
        np.random.set_state(states[1])


def progress_sheet(folder: Path) -> Image.Image:
    """The first prompt's render at each rendered step (at most MAX_PROGRESS_ROWS, spread from first to last),
    oldest on top, each labelled with its step."""
    results = sorted((json.loads(p.read_text()) for p in folder.glob(f"step-*/{RESULT}")), key=lambda r: r["step"])
    picks = np.linspace(0, len(results) - 1, min(len(results), MAX_PROGRESS_ROWS)).round().astype(int)
    results = [results[i] for i in sorted(set(picks))]
    name = next(iter(results[0]["prompts"]))
    videos = {f"step {r['step']}": read_media(r["media"][name]) for r in results}
    return contact_sheet(videos, title=f"{name}, per step", columns=PROGRESS_FRAMES)


def progress_sheet_path(run_dir: str | Path) -> Path | None:
    """The progress sheet of a run, if it rendered during training (for the lora asset's metadata)."""
    path = Path(run_dir) / "validation" / PROGRESS_SHEET
    return path if path.is_file() else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _device_of(transformer: torch.nn.Module) -> torch.device:
    """Where the LoRA parameters live (the compute device, also under group offloading)."""
    return next(p.device for n, p in transformer.named_parameters() if any(k in n for k in ADAPTER_PARAMETERS))
