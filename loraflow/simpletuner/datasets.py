"""SimpleTuner's dataset list (multidatabackend.json) as loraflow's `datasets`, entry by entry.

Every key of every entry is carried, translated or listed as not carried (`Imported.skip`), whatever its value's type;
keys an entry leaves unset whose SimpleTuner default differs from loraflow's get SimpleTuner's (`defaults.py`).
"""

from __future__ import annotations

import math
import typing
from typing import Any

from loraflow.config import DatasetConfig, VideoSettings
from loraflow.simpletuner.defaults import CAPTION_COLUMN, CROP_ASPECT, CROP_STYLE
from loraflow.simpletuner.imported import Imported, is_text, truthy

CROP_ASPECTS = typing.get_args(DatasetConfig.model_fields["crop_aspect"].annotation)
# SimpleTuner reads a Hugging Face dataset's keys from the entry, else from its `huggingface:` block
# (helpers/data_backend/config/image.py:167-178; the caption column from the block only,
# helpers/metadata/backends/huggingface.py:83)
GLOBAL_KEYS = ("resolution", "minimum_image_size")  # config.json keys that are each dataset's default
HUB_KEYS = ("dataset_name", "split", "revision", "image_column", "video_column", "caption_column")
WHY = {
    "conditioning": "loraflow trains no ControlNet: SimpleTuner's generated conditioning images (canny, depth, ...) "
                    "are not made; for i2i give a dataset_type conditioning folder of source images",
    "metadata_backend": "loraflow reads a Hugging Face dataset's rows itself (type huggingface)",
    "maximum_image_size": "loraflow resizes each source straight to its bucket (resolution)",
    "target_downsample_size": "loraflow resizes each source straight to its bucket (resolution)",
    "cache_dir_vae": "latents are keyed by content under the config's cache_dir",
}


def datasets(backends: list[Any], settings: dict[str, Any], out: Imported) -> list[dict[str, Any]]:
    entries = [(i, b) for i, b in enumerate(backends) if _entry(i, b, out)]
    masks = {b.get("id") for _, b in entries if b.get("conditioning_type") == "mask" and is_text(b.get("id"))}
    return [d for i, b in entries if (d := _dataset(i, b, settings, out, masks)) is not None]


def is_media(entry: dict[str, Any]) -> bool:
    return entry.get("dataset_type", "image") in ("video", "image")


def _entry(index: int, entry: Any, out: Imported) -> bool:
    if not isinstance(entry, dict):
        out.skip(f"datasets[{index}]", entry, "not a dataset (a JSON object of its keys): dropped")
        return False
    return True


def _dataset(index: int, entry: dict[str, Any], settings: dict[str, Any], out: Imported,
             masks: set[str]) -> dict[str, Any] | None:
    where = f"datasets[{index}]"
    kind = entry.get("dataset_type")
    if not is_media(entry) and kind not in ("text_embeds", "conditioning"):
        out.skip(f"{where} (id {entry.get('id')})", kind, "dataset_type not supported: dropped")
        return None
    known = set(DatasetConfig.model_fields) - {"crop_style", "crop_aspect", "crop_aspect_buckets", "video",
                                               "conditioning_data", "resolution_type", *HUB_KEYS}
    dataset: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "conditioning_data":
            _conditioning_data(where, value, settings, dataset, out, masks)
        elif key == "conditioning_type" and value != "mask":
            out.skip(f"{where}.{key}", value, "loraflow's conditioning datasets hold i2i source images (unset) or "
                                              "loss masks (mask)")
        elif key in known:
            dataset[key] = value
        elif key == "video":
            dataset["video"] = _video(where, value, out)
        elif key in ("crop", "crop_style", "crop_aspect", "crop_aspect_buckets", "resolution_type", "huggingface",
                     *HUB_KEYS):
            continue  # translated together below
        else:
            out.skip(f"{where}.{key}", value, WHY.get(key))
    if "dataset_type" not in entry:
        dataset["dataset_type"] = "image"  # SimpleTuner's default
    if entry.get("type") == "huggingface" or "huggingface" in entry or any(k in entry for k in HUB_KEYS):
        _hub(where, entry, dataset, out)
    if is_media(entry):
        _crop(where, entry, dataset, out)
        _dataset_resolution(where, entry, settings, dataset, out)
    return dataset


def _hub(where: str, entry: dict[str, Any], dataset: dict[str, Any], out: Imported) -> None:
    """A Hugging Face dataset's keys, from the entry or its `huggingface:` block (the entry's win, as SimpleTuner's)."""
    block = entry.get("huggingface", {})
    if not isinstance(block, dict):
        out.skip(f"{where}.huggingface", block, "not a block of keys (a JSON object): not read")
        block = {}
    for key, value in block.items():
        if key not in HUB_KEYS:
            out.skip(f"{where}.huggingface.{key}", value, "loraflow reads a Hub dataset's rows as they are: no "
                                                          "streaming, filter, composite images or process count")
        elif key in entry:
            out.skip(f"{where}.huggingface.{key}", value, f"the dataset's own `{key}` wins, as in SimpleTuner")
    for key in HUB_KEYS:
        value = entry.get(key, block.get(key))
        if value is not None:
            dataset[key] = value
    hub = entry.get("type") == "huggingface"
    if hub and entry.get("caption_strategy", "huggingface") == "huggingface" and "caption_column" not in dataset:
        out.default(CAPTION_COLUMN, dataset)


def _conditioning_data(where: str, value: Any, settings: dict[str, Any], dataset: dict[str, Any],
                       out: Imported, masks: set[str]) -> None:
    """Kept for i2i (its source images) and for a loss-mask dataset (any flavour); SimpleTuner also pairs ControlNet
    and i2v datasets, which loraflow does not."""
    ids = value if isinstance(value, list) else [value]
    i2i = "i2i" in str(settings.get("model_flavour", ""))
    if len(ids) == 1 and is_text(ids[0]) and ids[0] in masks and not i2i:
        dataset["conditioning_data"] = ids[0]
    elif not i2i:
        out.skip(f"{where}.conditioning_data", value, "loraflow pairs source images for i2i flavours only, and "
                                                      "one loss-mask dataset (conditioning_type mask) with any")
    elif len(ids) != 1 or not is_text(ids[0]):
        out.skip(f"{where}.conditioning_data", value, "loraflow pairs each image with one source-image dataset "
                                                      "(its id)")
    else:
        dataset["conditioning_data"] = ids[0]


def _video(where: str, video: Any, out: Imported) -> dict[str, Any]:
    if not isinstance(video, dict):
        out.skip(f"{where}.video", video, "not a block of video keys (a JSON object): not read")
        return {}
    kept = {}
    for key, value in video.items():
        if key in VideoSettings.model_fields:
            kept[key] = value
        else:
            out.skip(f"{where}.video.{key}", value)
    return kept


def _crop(where: str, entry: dict[str, Any], dataset: dict[str, Any], out: Imported) -> None:
    """SimpleTuner crops only with `crop: true`, to crop_style (default random) and crop_aspect (default square)
    preserve/square/closest (of crop_aspect_buckets), which all map. crop false (the default) = aspect buckets, which
    is loraflow's `center` (only the rounding remainder is cut), and SimpleTuner then ignores the crop keys."""
    cropping = ("crop_style", "crop_aspect", "crop_aspect_buckets")
    if not truthy(entry.get("crop", False)):
        for key in (k for k in cropping if k in entry):
            out.skip(f"{where}.{key}", entry[key], "ignored: crop is off")
        return
    style, aspect = entry.get("crop_style", CROP_STYLE.value), entry.get("crop_aspect", CROP_ASPECT.value)
    if style in ("center", "centre", "random"):
        dataset["crop_style"] = "random" if style == "random" else "center"
    else:
        out.skip(f"{where}.crop_style", style, "loraflow crops center or random")
    if is_text(aspect) and aspect in CROP_ASPECTS:
        dataset["crop_aspect"] = aspect
    else:
        out.skip(f"{where}.crop_aspect", aspect, f"loraflow crops to one of {', '.join(CROP_ASPECTS)}")
    for default in (CROP_STYLE, CROP_ASPECT):
        if default.key not in entry and default.key in dataset:
            out.commented(dataset, default)
    if "crop_aspect_buckets" in entry and aspect == "closest":
        dataset["crop_aspect_buckets"] = entry["crop_aspect_buckets"]
    elif "crop_aspect_buckets" in entry:
        out.skip(f"{where}.crop_aspect_buckets", entry["crop_aspect_buckets"], "loraflow reads them with crop_aspect "
                                                                               "closest only")


def _dataset_resolution(where: str, entry: dict[str, Any], settings: dict[str, Any], dataset: dict[str, Any],
                        out: Imported) -> None:
    """Datasets inherit the global resolution in SimpleTuner. pixel and pixel_area mean what they mean in loraflow;
    area is in megapixels there, and in loraflow the side in pixels of a square of that area."""
    kind = entry.get("resolution_type", settings.get("resolution_type", "pixel"))
    for key in GLOBAL_KEYS:  # SimpleTuner's dataset defaults (config/image.py: `backend_dict.get(key, args.key)`)
        if key not in dataset and key in settings:
            dataset[key] = settings[key]
    if kind in ("pixel", "pixel_area"):
        if kind != "pixel":
            dataset["resolution_type"] = kind
        return
    if kind != "area":
        out.skip(f"{where}.resolution_type", kind, "loraflow's resolution_type is pixel, area or pixel_area: "
                                                   "resolution not copied")
        dataset.pop("resolution", None)
        if "minimum_image_size" in dataset:
            out.skip(f"{where}.minimum_image_size", dataset.pop("minimum_image_size"),
                     f"in the unit of resolution_type {kind!r}: not copied")
        return
    dataset["resolution_type"] = "area"
    for key in ("resolution", "minimum_image_size"):
        if dataset.get(key):  # megapixels, as SimpleTuner's pixel_area conversion counts them (1 MP = 1000**2)
            megapixels = _number(dataset[key])
            if megapixels is None:
                out.skip(f"{where}.{key}", dataset.pop(key), "megapixels (resolution_type area): a number above 0")
                continue
            side = round(math.sqrt(megapixels * 1_000_000))
            out.notes.append(f"{where}.{key} {dataset[key]} megapixels (resolution_type area) became {side}, the "
                             "side in pixels of a square of that area")
            dataset[key] = side


def _number(value: Any) -> float | None:
    """A positive finite number (or its text), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and 0 < number < 1e12 else None

