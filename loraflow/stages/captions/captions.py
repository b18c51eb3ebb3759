"""The captions stage (`caption_strategy: auto`, docs/footage.md): each clip without a user caption, captioned from its
own stored frames by a Qwen2.5-VL, cached by content.

The captioner: `caption_model_path` (a Qwen2.5-VL folder or Hub id, its processor beside it), else the checkpoint's
own first text encoder where it is the full model (`Qwen2_5_VLForConditionalGeneration`, vision tower included:
Kandinsky 5 and Kandinsky 6 ship it) with the checkpoint's tokenizer folder as its processor. It is shown
FRAMES_SHOWN frames spread over the clip (as images, in Qwen2.5-VL's chat format), asked `caption_prompt`, and
decodes greedily up to `caption_max_new_tokens`: the same weights, frames and prompt give the same caption.

Store: the `captions` stage's rows are keyed by the clip's key, the captioner's fingerprint, the prompt, the token
limit and CODE_VERSION, so only a new or changed clip, another captioner or another prompt captions again; its
manifest (a part per dataset) lists each captioned clip: `clip`, `caption` (with `caption_prefix` before it),
`captioner`, `prompt`. `contracts/clip_rows.read_clips` gives those captions to the clips that have none. The model
loads only when something is to be captioned, and is freed when the stage ends.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraflow.config import LoraflowConfig, select_datasets
from loraflow.contracts.clip_rows import ClipRow, read_clips
from loraflow.contracts.reports import CaptionsReport
from loraflow.keys import content_key, data_version, directory_fingerprint
from loraflow.pipelines.sources import ModelSource, is_hub_id
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "captions-1"
FRAMES_SHOWN = 4  # frames of a clip the captioner sees, spread over it (its first and last among them)
BATCH_CLIPS = 8  # clips per committed shard: the resume granularity of a killed run
CAPTIONER_CLASS = "Qwen2_5_VLForConditionalGeneration"
SYSTEM = "You are a helpful assistant."  # Qwen2.5-VL's chat template's default system turn
FRAME = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in Qwen2.5-VL's chat format


@dataclass(frozen=True)
class Captioner:
    """Where the captioning model and its processor are, and what identifies them in cache keys."""

    model: str  # a folder or a Hub id
    processor: str
    fingerprint: str


def auto_datasets(config: LoraflowConfig) -> list[str]:
    """The training datasets whose clips the captions stage captions."""
    return [d.id for d in config.training_datasets if d.caption_strategy == "auto"]


def captioner(config: LoraflowConfig, model: ModelSource) -> Captioner:
    """`caption_model_path`, else the checkpoint's text encoder where it is a full Qwen2.5-VL; else a clear error."""
    if config.caption_model_path:
        path = config.caption_model_path
        if is_hub_id(path):
            return Captioner(path, path, content_key(hub=path))
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"caption_model_path {path}: no config.json there; name a Qwen2.5-VL folder "
                                    "(config.json, safetensors and its processor files) or a Hub id")
        return Captioner(path, path, content_key(captioner=directory_fingerprint(Path(path))))
    folder, processor = model.folder("text_encoder"), model.folder("tokenizer")
    config_file = folder / "config.json"
    architectures = json.loads(config_file.read_text()).get("architectures", []) if config_file.is_file() else []
    has_processor = (processor / "preprocessor_config.json").is_file()
    if CAPTIONER_CLASS not in architectures or not has_processor:
        what = (f"its text encoder is {', '.join(architectures) or 'not there'}" if CAPTIONER_CLASS not in
                architectures else f"its tokenizer folder {processor} holds no image processor")
        raise FileNotFoundError(f"caption_strategy auto: the checkpoint cannot caption ({what}, not a full "
                                f"Qwen2.5-VL with its processor): set `caption_model_path` to a Qwen2.5-VL (e.g. "
                                "Qwen/Qwen2.5-VL-7B-Instruct)")
    return Captioner(str(folder), str(processor), content_key(model=model.fingerprint("text_encoder"),
                                                              processor=model.fingerprint("tokenizer")))


def caption_key(clip: ClipRow, who: Captioner, config: LoraflowConfig) -> str:
    return content_key(clip=clip.key, captioner=who.fingerprint, prompt=config.caption_prompt,
                       max_new_tokens=config.caption_max_new_tokens, frames=FRAMES_SHOWN, code=CODE_VERSION)


def build_captions(config: LoraflowConfig, model: ModelSource, store: Store,
                   datasets: list[str] | None = None) -> CaptionsReport:
    """Caption the clips of the `auto` datasets (`datasets` ids; None: all) that have no user caption and no cached
    caption under today's key, and write each dataset's manifest part of its captions."""
    store = store.named(config.manifest_names)  # its manifests named by what they are made from, whoever opened it
    chosen = [d.id for d in select_datasets(config, datasets) if d.caption_strategy == "auto"]
    clips = [c for c in read_clips(store, parts=chosen, captioned=False) if not c.captions]
    if not clips:
        for dataset in chosen:
            store.write_manifest("captions", [], part=dataset)
        return CaptionsReport(data_version=data_version([]), computed=0, reused=0, captioner="", prompt="")
    who = captioner(config, model)
    keys = {clip.key: caption_key(clip, who, config) for clip in clips}
    have = store.keys("captions")
    todo = [clip for clip in clips if keys[clip.key] not in have]
    if todo:
        _caption(todo, keys, who, config, store)
    stored = store.get("captions", set(keys.values()))
    for dataset in chosen:
        store.write_manifest("captions", [
            {"clip": c.key, "caption": config.caption_prefix + stored[keys[c.key]]["caption"],
             "captioner": who.fingerprint, "prompt": config.caption_prompt} for c in clips if c.dataset == dataset],
            part=dataset)
    return CaptionsReport(data_version=data_version(content_key(key=k, prefix=config.caption_prefix)
                                                    for k in keys.values()),
                          computed=len(todo), reused=len(clips) - len(todo), captioner=who.model,
                          prompt=config.caption_prompt)


def _caption(todo: list[ClipRow], keys: dict[str, str], who: Captioner, config: LoraflowConfig, store: Store) -> None:
    """Load the captioner, caption `todo`, BATCH_CLIPS per committed shard, and free it."""
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from loraflow.kernels.devices import free_models, pick_device

    device = pick_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    processor = AutoProcessor.from_pretrained(who.processor)
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(who.model, dtype=dtype, use_safetensors=True)
    vlm = vlm.to(device).eval().requires_grad_(False)
    try:
        for start in range(0, len(todo), BATCH_CLIPS):
            batch = todo[start:start + BATCH_CLIPS]
            frames = store.get("clips", [c.key for c in batch], columns=["frames"])
            rows = [{"key": keys[c.key], "clip": c.key, "caption": caption_clip(vlm, processor, frames[c.key]["frames"],
                                                                                config, device),
                     "captioner": who.fingerprint, "prompt": config.caption_prompt} for c in batch]
            store.put("captions", rows)
    finally:
        free_models(vlm)


def caption_clip(vlm: Any, processor: Any, frames: np.ndarray, config: LoraflowConfig, device: Any) -> str:
    """One clip's caption: FRAMES_SHOWN of its uint8 (F, H, W, 3) frames, the prompt, greedy decoding."""
    import torch
    from PIL import Image

    picks = np.unique(np.linspace(0, len(frames) - 1, min(FRAMES_SHOWN, len(frames))).round().astype(int))
    images = [Image.fromarray(np.asarray(frames[i])) for i in picks]
    text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{FRAME * len(images)}"
            f"{config.caption_prompt}<|im_end|>\n<|im_start|>assistant\n")
    inputs = processor(text=[text], images=images, return_tensors="pt").to(device)
    with torch.inference_mode():
        out = vlm.generate(**inputs, do_sample=False, max_new_tokens=config.caption_max_new_tokens)
    tokenizer = getattr(processor, "tokenizer", processor)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def export_captions(config: LoraflowConfig, store: Store, folder: Path,
                    datasets: list[str] | None = None) -> tuple[list[Path], list[Path]]:
    """Write each generated caption (of the `auto` datasets' clips without a user caption) as the user caption file
    it would be under `folder`, laid out as the dataset folder: NAME.txt, with scene cuts NAME.nnnn.txt per scene
    (captions.read_scene_captions), the first clip's caption where a file or scene has several. Moved or written into
    the dataset folder, an (edited) file is a user caption from the next clips run on. A file already there is kept.
    Returns (written, kept)."""
    from loraflow.atomic import write_atomic

    chosen = [d.id for d in select_datasets(config, datasets) if d.caption_strategy == "auto"]
    waiting = {c.key for c in read_clips(store, parts=chosen, captioned=False) if not c.captions}
    targets: dict[Path, str] = {}
    for clip in read_clips(store, parts=chosen):
        if clip.key in waiting and clip.captions:
            source = Path(clip.source)
            name = f"{source.stem}.{clip.scene.number:04d}.txt" if clip.scene else f"{source.stem}.txt"
            targets.setdefault(folder / source.parent / name, clip.captions[0])
    written, kept = [], []
    for path, caption in sorted(targets.items()):
        if path.exists():
            kept.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp, text=caption: tmp.write_text(text + "\n", encoding="utf-8"))
        written.append(path)
    return written, kept
