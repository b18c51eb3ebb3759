"""The validation stage: every validation prompt rendered with and without the LoRA, and eval loss.

The pipeline loads once per run (`family.load_renderer`); each prompt renders at LoRA scale 0 (the base
model, exactly) and 1 with the same seed, from cached embeddings only. Outputs under
output_dir/validation/<key>/:
    <nn>-<shortname>/base.mp4, lora.mp4   h264 yuv420p at the flavour's fps (base.png, lora.png for images)
    <nn>-<shortname>/contact_sheet.png    base frames over LoRA frames, labelled, under the prompt
    <nn>-<shortname>/preview.webp         videos: base and LoRA side by side, animated
    condition.png                         i2v, i2i: the image every render starts from (first frame, source)
    <nn>-<shortname>/result.json          written last: the prompt is done (a killed run resumes after it)
    eval_loss.png, results.json           results.json is written last: the whole run is done
The key covers the adapter's content (`safetensors_sha256`: not the file's bytes, whose header order varies), the
render settings, the prompts, the eval inputs and (i2v) the clip whose first frame conditions every render: the first
held-out eval clip (by key), else the first training clip, center-cropped and resized to the validation size
(`conditioning_image`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from loraflow.config import LoraflowConfig
from loraflow.keys import content_key, safetensors_sha256
from loraflow.ops.devices import free_models, pick_device
from loraflow.ops.evaluation import EVAL_SIGMAS, eval_items, eval_losses, loss_summary
from loraflow.ops.exchange import (
    TextItem, conditioning_image, evaluates, negative_prompt, prompt_image, render_settings, text_lookup,
)
from loraflow.ops.previews import contact_sheet, eval_loss_plot, save_animation
from loraflow.ops.report import EvalLoss, PromptRenders, ValidationReport
from loraflow.pipelines.base import ModelFamily, RenderSettings, TextRow, component_fingerprint
from loraflow.pipelines.sources import model_source
from loraflow.store import Store

CODE_VERSION = "validation-3"  # 3: labelled, wrapped contact sheets and preview.webp
RESULTS = "results.json"


def validate(config: LoraflowConfig, family: ModelFamily, store: Store, lora_path: str) -> ValidationReport:
    """Render every validation prompt (base and LoRA) and measure eval loss; reuse a finished run."""
    # 1. plan: settings, prompts, eval clips, and the run's key
    settings = render_settings(config, family, store)
    prompts, negative = config.validation_prompts, negative_prompt(config, family)
    items = eval_items(config, family, store) if evaluates(config) else []
    if not prompts and not items:
        raise ValueError("validation has nothing to do: set `validation_prompt` or `user_prompt_library` (renders), "
                         "or `eval_holdout_fraction` / `eval_dataset_id` (eval loss)")
    condition, seen = prompt_image(config, family, store, settings) if prompts else (None, "")
    texts = cached_texts(store, [(t, seen) for t in [*prompts.values(), negative]] if prompts else [])
    model = model_source(config)
    out = Path(config.output_dir) / "validation" / content_key(
        lora=safetensors_sha256(lora_path), model={c: component_fingerprint(model, c) for c in ("transformer", "vae")},
        family=family.name, flavour=family.flavour.name, fps=family.flavour.fps, settings=asdict(settings),
        prompts=prompts, negative=negative, eval=[asdict(i) for i in items], sigmas=EVAL_SIGMAS, code=CODE_VERSION,
        **({"condition": condition} if condition else {}),  # t2v keys stay as they were
        **({"last_frame": True} if family.flavour.last_frame_given else {}))  # so do i2v_mode first keys
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
    pipe = family.load_renderer(model, lora_path, device)
    pipe.transformer.eval()  # peft adds the adapter's layers in train mode: lora_dropout would drop at random
    for name in todo:
        render_prompt(family, pipe, folders[name], name, prompts[name], texts[prompts[name], seen],
                      texts[negative, seen], settings, image)
    losses = eval_losses(pipe.transformer, family, store, items, settings.seed, device)
    del pipe  # drop the last reference first, so free_models' collection frees the weights
    free_models()
    # 3. summary, written last
    if losses:
        save_png(eval_loss_plot(losses), out / "eval_loss.png")
    rows = [json.loads((folders[name] / "result.json").read_text()) for name in prompts]
    _write_json(out / RESULTS, {"settings": asdict(settings), "fps": family.flavour.fps, "prompts": rows,
                                "eval_loss": losses, "eval_clips": len(items)})
    return _report(out, computed=len(todo) + bool(items))


def cached_texts(store: Store, items: list[TextItem]) -> dict[TextItem, TextRow]:
    """(text, image) -> embedding row; every item must have been encoded by the text_embeds stage."""
    keys = text_lookup(store)
    missing = [text for text, image in items if (text, image) not in keys]
    if missing:
        raise KeyError(f"{len(missing)} validation text(s) have no cached embedding, e.g. {missing[0]!r}: "
                       "materialize `text_embeds` again (it encodes every validation prompt and the negative prompt"
                       ", with the image validation renders from for i2i)")
    rows = store.get("text_embeds", {keys[i] for i in items})
    return {i: rows[keys[i]] for i in items}


def render_prompt(
    family: ModelFamily, pipe: Any, folder: Path, name: str, prompt: str, text: TextRow, negative: TextRow,
    settings: RenderSettings, image: np.ndarray | None = None,
) -> None:
    """Base (LoRA scale 0) and LoRA renders of one prompt, same seed (and i2v: same first frame); media, contact
    sheet, animation, then result.json."""
    folder.mkdir(parents=True, exist_ok=True)
    base = render_video(family, pipe, text, negative, settings, image, lora_scale=0.0)
    tuned = render_video(family, pipe, text, negative, settings, image, lora_scale=1.0)
    fps = family.flavour.fps
    paths = {"base": write_media(base, folder / "base", fps), "lora": write_media(tuned, folder / "lora", fps)}
    videos = {"base": base, "LoRA": tuned}
    save_png(contact_sheet(videos, title=f"{name}: {prompt}"), folder / "contact_sheet.png")
    animation = folder / "preview.webp" if len(base) > 1 else None  # an image family's render does not move
    if animation:
        save_animation(videos, fps, animation)
    _write_json(folder / "result.json", {
        "name": name, "prompt": prompt, **{k: str(p) for k, p in paths.items()},
        "contact_sheet": str(folder / "contact_sheet.png"), "animation": str(animation) if animation else None,
        "mean_abs_pixel_change": float(np.abs(base.astype(np.int16) - tuned).mean()),
    })


def render_video(
    family: ModelFamily, pipe: Any, text: TextRow, negative: TextRow, settings: RenderSettings,
    image: np.ndarray | None = None, lora_scale: float | None = 1.0,
) -> np.ndarray:
    """One render, uint8 (F, H, W, 3), checked against the settings (validation and the renders during training)."""
    given = {"image": image} if image is not None else {}  # only i2v families take an image
    if image is not None and image.ndim == 4:  # i2v_mode first_last: (first, last) from `conditioning_image`
        given = {"image": image[0], "last_image": image[1]}
    video = family.render(pipe, text, negative, settings, lora_scale=lora_scale, **given)
    if video.shape != (settings.num_frames, settings.height, settings.width, 3):
        raise RuntimeError(f"{family.name} rendered {video.shape}; validation asked for "
                           f"{(settings.num_frames, settings.height, settings.width, 3)}: a bug in the family's render")
    return video


def _report(out: Path, computed: int) -> ValidationReport:
    results = json.loads((out / RESULTS).read_text())
    prompts, losses = results["prompts"], results["eval_loss"]
    condition = out / "condition.png"
    return ValidationReport(
        data_version=out.name, computed=computed, reused=len(prompts) + bool(results["eval_clips"]) - computed,
        settings=RenderSettings(**results["settings"]), fps=results["fps"],
        prompts=tuple(PromptRenders(**p) for p in prompts), eval_loss=tuple(EvalLoss(**r) for r in losses),
        eval_clips=results["eval_clips"],
        mean_abs_pixel_change=float(np.mean([p["mean_abs_pixel_change"] for p in prompts])) if prompts else None,
        **(loss_summary(losses) if losses else {}),  # eval_loss_base, eval_loss_lora, eval_loss_change
        eval_plot=str(out / "eval_loss.png") if losses else None,
        condition_image=str(condition) if condition.is_file() else None,
    )


def slug(name: str) -> str:
    """A shortname as a folder name (the index prefix keeps two names with one slug apart)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:60] or "prompt"


# -- media: mp4 for videos, PNG for images -------------------------------------------------------------------
def write_media(frames: np.ndarray, stem: Path, fps: float) -> Path:
    """uint8 (F, H, W, 3) -> `stem`.png when F == 1 (image families, lossless), else `stem`.mp4."""
    if len(frames) == 1:
        path = stem.with_suffix(".png")
        save_png(Image.fromarray(frames[0]), path)
    else:
        path = stem.with_suffix(".mp4")
        write_mp4(frames, path, fps)
    return path


def read_media(path: str | Path) -> np.ndarray:
    """uint8 (F, H, W, 3) of what write_media wrote (an mp4's frames as decoded, lossy)."""
    if Path(path).suffix == ".png":
        return np.asarray(Image.open(path).convert("RGB"))[None]
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """uint8 (F, H, W, 3) -> h264 yuv420p mp4 (odd sizes padded by edge copy, as yuv420p requires)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))  # 23.976 stays exact
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    tmp.rename(path)


def save_png(image: Image.Image, path: Path) -> None:
    tmp = path.with_suffix(".tmp.png")
    image.save(tmp, format="PNG")
    tmp.rename(path)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.rename(path)
