"""The validation stage: every validation prompt rendered with and without the LoRA, and eval loss.

The pipeline loads once per run (`family.load_renderer`); each prompt renders at LoRA scale 0 (the base
model, exactly) and 1 with the same seed, from cached embeddings only. Outputs under
output_dir/validation/<key>/:
    <nn>-<shortname>/base.mp4, lora.mp4   h264 yuv420p at the flavour's fps (base.png, lora.png for images); with
                                          `train_audio` (Kandinsky 6) a mono AAC stream of the sound rendered with
                                          the video, at the audio VAE's rate, over the video's span
    <nn>-<shortname>/adapter-<i>-<name>.mp4   each other adapter's render (`validation_adapter_path` or
                                          `validation_adapter_config`, config/validation_adapters.py)
    <nn>-<shortname>/contact_sheet.png    base frames over LoRA frames (then each other adapter's), labelled; with
                                          sound each render's spectrogram below
    <nn>-<shortname>/preview.webp         videos: base and LoRA side by side, animated
    condition.png                         i2v, i2i: the image every render starts from (first frame, source)
    <nn>-<shortname>/result.json          written last: the prompt is done (a killed run resumes after it)
    eval_loss.png, results.json           results.json is written last: the whole run is done
The key covers the adapter's content (`safetensors_sha256`: not the file's bytes, whose header order varies), the
render settings, the prompts, the eval inputs, the other adapters' content and strength (when given) and (i2v) the
clip whose first frame conditions every render: the first held-out eval clip (by key), else the first training clip,
center-cropped and resized to the validation size (`conditioning_image`); with sound, the audio VAE's and the
vocoder's content.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from loraflow.atomic import write_json
from loraflow.config import LoraflowConfig
from loraflow.config.validation_adapters import (
    ValidationAdapter,
    activate,
    adapter_keys,
    adapter_problems,
    load_adapters,
)
from loraflow.contracts.holdout import evaluates
from loraflow.contracts.renders import conditioning_image, negative_prompt, prompt_image, render_media, render_settings
from loraflow.contracts.reports import EvalLoss, PromptRenders, ValidationReport
from loraflow.contracts.text_set import cached_texts
from loraflow.estimates.render import validation_plan
from loraflow.kernels.devices import free_models, pick_device
from loraflow.keys import content_key, safetensors_sha256
from loraflow.media.previews import contact_sheet, eval_loss_plot, save_animation
from loraflow.media.writers import save_png, slug, write_media
from loraflow.pipelines.base import ModelFamily, RenderSettings, TextRow, component_fingerprint
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store
from loraflow.validation.evaluation import EVAL_SIGMAS, eval_items, eval_losses, loss_summary

log = logging.getLogger(__name__)
CODE_VERSION = "validation-3"  # 3: labelled, wrapped contact sheets and preview.webp
SOUND_COMPONENTS = ("audio_vae", "vocoder")  # what turns the audio latents into the waveform (Kandinsky 6)
RESULTS = "results.json"


def validate(config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store,
             lora_path: str) -> ValidationReport:
    """Render every validation prompt (base and LoRA) and measure eval loss; reuse a finished run."""
    store = store.named(config.manifest_names)  # the config's own lists, whoever opened the store
    # 1. plan: settings, prompts, eval clips, and the run's key
    settings = render_settings(config, family, model, store)
    # precision, offload and tiling for the card (estimates/render.py): what changes numbers is part of the key
    plan = validation_plan(config, family, model, settings.num_frames, settings.height, settings.width)
    prompts, negative = config.validation_prompts, negative_prompt(config, family)
    items = eval_items(config, family, store) if evaluates(config) else []
    if not prompts and not items:
        raise ValueError("validation has nothing to do: set `validation_prompt` or `user_prompt_library` (renders), "
                         "or `eval_holdout_fraction` / `eval_dataset_id` (eval loss)")
    condition, seen = prompt_image(config, family, store, settings) if prompts else (None, "")
    texts = cached_texts(store, [(t, seen) for t in [*prompts.values(), negative]] if prompts else [])
    adapters = config.validation_adapters
    if problems := adapter_problems(config.validation_adapters_key, adapters, model.folder("transformer")):
        raise ValueError("; ".join(problems))  # before any render: a NaN adapter rendered black, and passed
    sound = config.train_audio  # a flavour with an audio VAE (the config checks): render the sound it trained
    out = Path(config.output_dir) / "validation" / content_key(
        lora=safetensors_sha256(lora_path), model={c: component_fingerprint(model, c) for c in ("transformer", "vae")},
        family=family.name, flavour=family.flavour.name, fps=family.flavour.fps, settings=asdict(settings),
        prompts=prompts, negative=negative, eval=[asdict(i) for i in items], sigmas=EVAL_SIGMAS, code=CODE_VERSION,
        **({"condition": condition} if condition else {}), **adapter_keys(adapters),  # t2v keys stay as they were
        **({"last_frame": True} if family.flavour.last_frame_given else {}),  # so do i2v_mode first keys
        **({"sound": {c: component_fingerprint(model, c) for c in SOUND_COMPONENTS}} if sound else {}),  # and silent
        **plan.numbers())  # and fp32 untiled renders
    if (out / RESULTS).is_file():
        return _report(out, computed=0)
    # 2. render what a killed run left undone, then eval loss, with one pipeline load
    folders = {name: out / f"{i:02d}-{slug(name)}" for i, name in enumerate(prompts)}
    todo = [name for name in prompts if not (folders[name] / "result.json").is_file()]
    out.mkdir(parents=True, exist_ok=True)
    image = conditioning_image(store, condition, settings, family.flavour.last_frame_given) if condition else None
    if image is not None:  # first_last: the first and the last frame side by side
        save_png(Image.fromarray(np.concatenate(list(image), axis=1) if image.ndim == 4 else image),
                 out / "condition.png")
    device = pick_device()
    log.info("validation renders with %s", plan.describe())
    pipe = family.load_renderer(model, lora_path, device, plan=plan)
    load_adapters(pipe.transformer, adapters)
    pipe.transformer.eval()  # peft adds the adapter's layers in train mode: lora_dropout would drop at random
    for name in todo:
        render_prompt(family, pipe, folders[name], name, prompts[name], texts[prompts[name], seen],
                      texts[negative, seen], settings, image, adapters, sound)
    losses = [asdict(r) for r in eval_losses(pipe.transformer, family, store, items, settings.seed, device)]
    del pipe  # drop the last reference first, so free_models' collection frees the weights
    free_models()
    # 3. summary, written last: each prompt's result.json as written (a resumed run's too)
    if losses:
        save_png(eval_loss_plot(losses), out / "eval_loss.png")
    rows = [json.loads((folders[name] / "result.json").read_text()) for name in prompts]
    write_json(out / RESULTS, {"settings": asdict(settings), "fps": family.flavour.fps, "prompts": rows,
                                "eval_loss": losses, "eval_clips": len(items)})
    return _report(out, computed=len(todo) + bool(items))


def render_prompt(
    family: ModelFamily, pipe: Any, folder: Path, name: str, prompt: str, text: TextRow, negative: TextRow,
    settings: RenderSettings, image: np.ndarray | None = None, adapters: tuple[ValidationAdapter, ...] = (),
    sound: bool = False,
) -> None:
    """Base (LoRA scale 0), LoRA and each other adapter's renders of one prompt, same seed (and i2v: same first
    frame), with `sound` each with the sound rendered with it; media, contact sheet, animation, then result.json."""
    folder.mkdir(parents=True, exist_ok=True)
    fps = family.flavour.fps
    renders = {label: render_media(family, pipe, text, negative, settings, image, lora_scale=scale, sound=sound)
               for label, scale in (("base", 0.0), ("LoRA", 1.0))}
    paths = {label: write_media(r.frames, folder / label.lower(), fps, r.sound) for label, r in renders.items()}
    others = {}
    for i, adapter in enumerate(adapters):
        activate(pipe.transformer, i, adapter)
        rendered = renders[adapter.name] = render_media(family, pipe, text, negative, settings, image,
                                                        lora_scale=None, sound=sound)
        others[adapter.name] = str(write_media(rendered.frames, folder / f"adapter-{i}-{slug(adapter.name)}", fps,
                                               rendered.sound))
    videos = {label: r.frames for label, r in renders.items()}
    flat = flat_renders(videos)
    if flat:
        log.warning("validation prompt %r: the %s render(s) are all one value (%s): NaN or inf in the model, the "
                    "LoRA or an adapter renders so; look at them before trusting this run", name, ", ".join(flat),
                    ", ".join(str(videos[label].flat[0]) for label in flat))
    sounds = {label: r.sound for label, r in renders.items()} if sound else None
    save_png(contact_sheet(videos, title=f"{name}: {prompt}", sounds=sounds), folder / "contact_sheet.png")
    base, tuned = videos["base"], videos["LoRA"]
    animation = folder / "preview.webp" if len(base) > 1 else None  # an image family's render does not move
    if animation:
        save_animation(videos, fps, animation)
    result = PromptRenders(
        name=name, prompt=prompt, base=str(paths["base"]), lora=str(paths["LoRA"]),
        contact_sheet=str(folder / "contact_sheet.png"), animation=str(animation) if animation else None,
        mean_abs_pixel_change=float(np.abs(base.astype(np.int16) - tuned).mean()), adapters=others or None,
        flat=flat or None)
    write_json(folder / "result.json", result.json_row())


def flat_renders(videos: dict[str, np.ndarray]) -> list[str]:
    """The labels of the renders whose every pixel of every frame is one value (an all-black video: a NaN adapter
    rendered so, and the step succeeded)."""
    return [label for label, frames in videos.items() if frames.size and frames.min() == frames.max()]


def _report(out: Path, computed: int) -> ValidationReport:
    results = json.loads((out / RESULTS).read_text())
    # results.json is the record: the report reads it back, so a reused run reports what the run that made it did
    prompts = tuple(PromptRenders(**p) for p in results["prompts"])
    losses = tuple(EvalLoss(**r) for r in results["eval_loss"])
    condition = out / "condition.png"
    return ValidationReport(
        data_version=out.name, computed=computed, reused=len(prompts) + bool(results["eval_clips"]) - computed,
        settings=RenderSettings(**results["settings"]), fps=results["fps"], prompts=prompts, eval_loss=losses,
        eval_clips=results["eval_clips"],
        mean_abs_pixel_change=float(np.mean([p.mean_abs_pixel_change for p in prompts])) if prompts else None,
        **(loss_summary(losses) if losses else {}),  # eval_loss_base, eval_loss_lora, eval_loss_change
        eval_plot=str(out / "eval_loss.png") if losses else None,
        condition_image=str(condition) if condition.is_file() else None,
    )
