"""What every render uses (validation and the renders during training): its settings, the negative prompt, the image
it starts from (its clip: `conditioning_clip`; its pixels: `condition_frame`, `conditioning_image`), the image id i2i
prompts are encoded with (`prompt_image`), and one render checked against the settings (`render_media`; its
frames alone: `render_video`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from loraflow.config import LoraflowConfig
from loraflow.contracts import shifts
from loraflow.contracts.clip_rows import read_clips
from loraflow.contracts.holdout import split_clips
from loraflow.keys import content_key
from loraflow.pipelines import plan_family
from loraflow.pipelines.base import ModelFamily, Rendered, RenderSettings, TextRow
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store

# Part of the i2i prompt image key, so of every i2i validation text key: the validation stage's CODE_VERSION when
# the key moved here. It stays, so that moving the function re-encodes nothing.
PROMPT_IMAGE_VERSION = "validation-2"
FIXED_POINT_TRIES = 8  # size buckets tried for one that renders at its own size (one step suffices in practice)


def render_settings(config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                    store: Store | None = None) -> RenderSettings:
    """The config's validation_* keys, each falling back to the flavour's default; checked against the family.
    `store`: where the clip validation renders from is, for a size left out (`validation_size`)."""
    height, width = validation_size(config, family, model, store)
    flavour = family.flavour
    problem = plan_family(config).validation_size_problem(model, height, width)
    if problem:
        raise ValueError(problem)
    frames = config.validation_num_video_frames or flavour.num_frames
    if flavour.num_frames == 1 and frames != 1:
        raise ValueError(f"`validation_num_video_frames` {frames}: {family.name} renders images; remove the key")
    return RenderSettings(
        height=height, width=width, num_frames=frames,
        num_inference_steps=config.validation_num_inference_steps or flavour.steps,
        guidance=config.validation_guidance if config.validation_guidance is not None else flavour.guidance,
        seed=config.validation_seed if config.validation_seed is not None else config.seed,
        flow_shift=render_shift(config, family, model),
    )


def validation_size(config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                    store: Store | None) -> tuple[int, int]:
    """(height, width): `validation_resolution`, else the flavour's release size (`Flavour.size`); left out where
    the pipeline sizes the render from its image (`FamilySpec.render_size`), the size it renders the image
    validation starts from at: a default that always renders."""
    if config.validation_size is not None:
        return config.validation_size
    spec = plan_family(config).spec
    if spec.render_size is None:
        return family.flavour.size
    if store is None:
        raise ValueError(f"{family.name} {family.flavour.name} sizes validation from its image: give the store")
    height, width = condition_frame(store, conditioning_clip(config, family, store)).shape[:2]
    size = spec.render_size(family.flavour, model, height, width)
    # The pipeline sizes the render from the image it is given, and validation gives it the frame already fitted to
    # `size`: a bucket the rule does not map to itself would be replaced. HunyuanVideo 1.5's does not always (it
    # compares bucket ratios rounded to 5 digits with the exact one: a 112x64 frame (HxW) gives 80x48, and an 80x48
    # image, 1.66667 - 1.666666... > 0, 64x48), so the default is the bucket that keeps its own size.
    for _ in range(FIXED_POINT_TRIES):
        again = size and spec.render_size(family.flavour, model, *size)
        if not again or again == size:
            return size or family.flavour.size
        size = again
    raise RuntimeError(f"{family.name} {family.flavour.name}: no size bucket renders at its own size from a "
                       f"{width}x{height} image within {FIXED_POINT_TRIES} steps; set validation_resolution")


def render_shift(config: LoraflowConfig, family: ModelFamily, model: ModelSource) -> float:
    """`validation_flow_shift`, else the shift of the checkpoint's own scheduler config (what its pipeline renders
    with: a checkpoint knows its shift better than a table), else the flavour's (`contracts.shifts`)."""
    shift = shifts.render_shift(config, family.flavour, model).value
    assert shift is not None
    return shift


def negative_prompt(config: LoraflowConfig, family: ModelFamily) -> str:
    return config.validation_negative_prompt if config.validation_negative_prompt is not None \
        else family.default_negative_prompt


def prompt_image(config: LoraflowConfig, family: ModelFamily, store: Store,
                 settings: RenderSettings) -> tuple[str | None, str]:
    """The clip renders start from (i2v, i2i; None for others) and the image id validation prompts are encoded
    with: i2i's prompt embedding sees the render's source image (`conditioning_image`); "" for other flavours."""
    clip = conditioning_clip(config, family, store)
    if clip is None or not family.flavour.prompt_sees_image:
        return clip, ""
    return clip, content_key(clip=clip, size=(settings.height, settings.width), code=PROMPT_IMAGE_VERSION)


def conditioning_clip(config: LoraflowConfig, family: ModelFamily, store: Store) -> str | None:
    """i2v/i2i: the clip whose first frame (i2i: source image) every render starts from (an eval clip first: one
    never trained on)."""
    if not family.flavour.takes_image:  # K5 i2v, HunyuanVideo 1.5 i2v (cond channels), K5 i2i alike
        return None
    clips = read_clips(store)
    if config.render_dataset_id is not None:  # validation_using_datasets: its first file, by name
        chosen = [c for c in clips if c.dataset == config.render_dataset_id]
        if not chosen:
            raise ValueError(f"validation_using_datasets: dataset '{config.render_dataset_id}' has no clip to "
                             "render from; see the `clips` asset's quarantine table for why its files were dropped")
        return min(chosen, key=lambda c: (c.source, c.indices[0])).key
    train, held = split_clips(clips, config)
    if not train + held:
        raise ValueError("i2v validation renders from a clip's first frame, but the clips stage stored no clip: "
                         "materialize `clips`")
    return min(held) if held else min(train)


def conditioning_image(store: Store, clip_key: str, settings: RenderSettings, last: bool = False) -> np.ndarray:
    """The clip's first frame (i2i: its source image), center-cropped to the render's aspect and resized to its
    size: uint8 (H, W, 3); with `last` (i2v_mode first_last) its first and its last frame so, (2, H, W, 3)."""
    if last:
        return np.stack([conditioning_image(store, clip_key, settings), _fitted(
            store.get("clips", [clip_key])[clip_key]["frames"][-1], settings)])
    return _fitted(condition_frame(store, clip_key), settings)


def _fitted(image: np.ndarray, settings: RenderSettings) -> np.ndarray:
    """uint8 (H, W, 3) center-cropped to the render's aspect and resized to its size."""
    frame = Image.fromarray(np.asarray(image))
    scale = max(settings.width / frame.width, settings.height / frame.height)
    size = (max(settings.width, round(frame.width * scale)), max(settings.height, round(frame.height * scale)))
    left, top = (size[0] - settings.width) // 2, (size[1] - settings.height) // 2
    resized = frame.resize(size, Image.LANCZOS).crop((left, top, left + settings.width, top + settings.height))
    return np.asarray(resized, dtype=np.uint8)


def condition_frame(store: Store, clip_key: str) -> np.ndarray:
    """uint8 (H, W, 3): the image a clip's render starts from: i2i its source image, i2v frame 0 of the stored
    (cropped) clip."""
    stored = store.get("clips", [clip_key])[clip_key]
    return (stored["condition_frames"] if stored.get("condition_frames") is not None else stored["frames"])[0]


def render_media(
    family: ModelFamily, pipe: Any, text: TextRow, negative: TextRow, settings: RenderSettings,
    image: np.ndarray | None = None, lora_scale: float | None = 1.0, sound: bool = False,
) -> Rendered:
    """One render checked against the settings: its frames, and with `sound` (a flavour with an audio VAE, under
    `train_audio`) the sound rendered with them (validation)."""
    given = {"image": image} if image is not None else {}  # only i2v families take an image
    if image is not None and image.ndim == 4:  # i2v_mode first_last: (first, last) from `conditioning_image`
        given = {"image": image[0], "last_image": image[1]}
    if sound:  # only a family with sound takes the keyword
        given["sound"] = True
    out = family.render(pipe, text, negative, settings, lora_scale=lora_scale, **given)
    rendered = out if isinstance(out, Rendered) else Rendered(out)
    if rendered.frames.shape != (settings.num_frames, settings.height, settings.width, 3):
        raise RuntimeError(f"{family.name} rendered {rendered.frames.shape}; validation asked for "
                           f"{(settings.num_frames, settings.height, settings.width, 3)}: a bug in the family's render")
    if sound and rendered.sound is None:
        raise RuntimeError(f"{family.name} was asked for sound and rendered none: a bug in the family's render")
    return rendered


def render_video(
    family: ModelFamily, pipe: Any, text: TextRow, negative: TextRow, settings: RenderSettings,
    image: np.ndarray | None = None, lora_scale: float | None = 1.0,
) -> np.ndarray:
    """One render's frames, uint8 (F, H, W, 3), checked against the settings (the renders during training)."""
    return render_media(family, pipe, text, negative, settings, image, lora_scale).frames
