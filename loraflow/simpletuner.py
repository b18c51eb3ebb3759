"""Import a SimpleTuner configuration (config.json + multidatabackend.json) as a loraflow config.

Keys loraflow shares with SimpleTuner (the seed guides' vocabulary) are copied; a few are translated
(`hunyuanvideo` -> `hunyuanvideo-1.5`, musubi-tuner's task names as `model_flavour`, `--flag` spellings, `crop` +
`crop_style`/`crop_aspect`, a bare validation resolution, `area` megapixels, a guide's repository that is not in the
diffusers layout); everything else is reported, key by key, with the reason, and written as comments at the top of
the output so nothing disappears silently. The result is validated like any config.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loraflow.config import DatasetConfig, LoraflowConfig, VideoSettings
from loraflow.config.adapter_kinds import REFUSED as LYCORIS_REFUSED
from loraflow.pipelines import family_spec, family_specs, known_flavour, nearest_multiple
from loraflow.pipelines.flavours import NOT_DIFFUSERS

BACKEND_KEYS = ("data_backend_config", "dataset_backend_config")
CROP_ASPECTS = typing.get_args(DatasetConfig.model_fields["crop_aspect"].annotation)
LR_SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine"}
BASE_PRECISIONS = typing.get_args(LoraflowConfig.model_fields["base_model_precision"].annotation)
ONLY_VALUE = {"model_type": "lora"}
WHY = {  # reasons for keys people ask about; any other unknown key is "no loraflow equivalent"
    "optimizer": "loraflow has adamw, adamw_bf16 (bf16 moments, stochastic rounding), muon (torch.optim.Muon), "
                 "prodigy (prodigyopt) and adamw_schedulefree (schedulefree's AdamWScheduleFree, its defaults)",
    "cache_dir_vae": "latents are keyed by content under the config's cache_dir",
    "frame_rate": "set `video.frame_rate` per dataset",
    "framerate": "set `video.frame_rate` per dataset",
    "num_train_epochs": "set max_train_steps",
    "report_to": "loraflow reports to tensorboard, wandb or none",
    "push_to_hub": "loraflow never uploads",
    "hub_model_id": "loraflow never uploads",
    "ema_cpu_only": "the EMA is updated where ema_device keeps it",
    "ema_foreach_disable": "torch's EMA update (get_ema_multi_avg_fn) is one foreach lerp",
}
# Keys whose reason depends on the value: (key, value) -> why; any other value of the key: (key, None) -> why.
WHY_VALUE = {
    ("text_encoder_2_precision", "no_change"): "nothing to set: loraflow runs the second text encoder (CLIP-L, "
                                               "Glyph-ByT5) unquantised in fp32, which is what no_change asks",
    ("text_encoder_2_precision", None): "the second text encoder (CLIP-L, Glyph-ByT5) is small and always runs "
                                        "unquantised in fp32",
    ("base_model_default_dtype", "bf16"): "nothing to set: it is the dtype of a quantised base model's other "
                                          "weights, which loraflow (fp8-layerwise) keeps in bf16 already",
    ("base_model_default_dtype", None): "loraflow keeps a quantised base model's other weights in bf16 "
                                        "(fp8-layerwise); for an fp32 base set base_model_precision no_change",
    ("optimizer", "sdnq-muon"): "loraflow's muon is torch.optim.Muon on the fp32 LoRA matrices, no quantised state: "
                                "set optimizer: muon",
    ("optimizer", "adamw_schedulefree+aggressive"): "loraflow runs schedulefree's AdamWScheduleFree with its own "
                                                    "defaults: set optimizer: adamw_schedulefree",
    ("optimizer", "adamw_schedulefree+no_kahan"): "loraflow runs schedulefree's AdamWScheduleFree on fp32 LoRA "
                                                  "weights, where Kahan summation has nothing to do: set optimizer: "
                                                  "adamw_schedulefree",
}
# The first text encoder's quantised precisions map to the one loraflow has (torchao int8 weight-only).
TEXT_PRECISIONS = {"int8-quanto": "int8-torchao"}
TEXT_PRECISION_NAMES = typing.get_args(LoraflowConfig.model_fields["text_encoder_1_precision"].annotation)
OPTIMIZERS = typing.get_args(LoraflowConfig.model_fields["optimizer"].annotation)
REPORT_TO = typing.get_args(LoraflowConfig.model_fields["report_to"].annotation)
# validation_adapter_mode: loraflow's validation always renders the base, the trained LoRA and each other adapter
ADAPTER_KEYS = ("validation_adapter_path", "validation_adapter_name", "validation_adapter_strength",
                "validation_adapter_config")
ADAPTER_MODE_WHY = ("loraflow's validation renders the base, the trained LoRA and each validation adapter side by "
                    "side (SimpleTuner's comparison); adapter_only is not offered")
# SimpleTuner's rollout samplers -> loraflow's (Euler only: kernels/scheduled_sampling.py)
ROLLOUT_SAMPLERS = {"euler": "euler", "unipc": "euler"}
# musubi-tuner's block swap (SimpleTuner's name, musubi's own): the last N blocks live on the CPU, each moved to the GPU
# for its forward and backward; loraflow's `blocks_to_swap` (kernels/offload.py: diffusers' group offloading of those)
BLOCK_SWAP = ("musubi_blocks_to_swap", "blocks_to_swap")


@dataclass
class Imported:
    config: dict[str, Any]
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # (key path, value, why)
    notes: list[str] = field(default_factory=list)

    def skip(self, key: str, value: Any, why: str | None = None) -> None:
        name = key.rsplit(".", 1)[-1]
        why = why or WHY_VALUE.get((name, value)) or WHY_VALUE.get((name, None))
        self.unmapped.append((key, value, why or WHY.get(name, "no loraflow equivalent")))


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def import_simpletuner(config: dict[str, Any], backends: list[dict[str, Any]] | None,
                       base_dir: Path | None = None) -> Imported:
    """Translate SimpleTuner settings (keys with or without `--`) and its dataset list into a loraflow dict."""
    settings = {str(k).lstrip("-"): v for k, v in config.items()}
    out = Imported({})
    if backends is None:
        backends = _backends_from(settings, base_dir, out)
    for key in BACKEND_KEYS:
        settings.pop(key, None)
    shared = set(LoraflowConfig.model_fields) - {"datasets", "dataset_backend_config"}
    for key, value in settings.items():
        if key == "model_family":
            out.config[key] = _family(value, out)
        elif key == "model_flavour" and (flavour := _peer_flavour(value, settings)):
            out.config[key] = flavour
            out.notes.append(f"model_flavour {value!r} (musubi-tuner's task name) became {flavour!r}")
        elif key == "pretrained_model_name_or_path" and value in NOT_DIFFUSERS:
            out.config[key] = _diffusers_repo(value, settings, out)
        elif key == "validation_resolution":
            out.config[key] = _resolution(value, settings, out)
        elif key == "lr_scheduler" and value in LR_SCHEDULERS:
            out.config[key] = LR_SCHEDULERS[value]
        elif key == "flow_use_uniform_schedule":
            if _truthy(value):
                out.config["flow_sigma_sampling"] = "uniform"
        elif key in ONLY_VALUE:
            if value != ONLY_VALUE[key]:
                out.skip(key, value, f"only {ONLY_VALUE[key]!r} is supported")
        elif key == "base_model_precision" and value not in BASE_PRECISIONS:
            out.skip(key, value, f"loraflow stores the base in one of {', '.join(BASE_PRECISIONS)} (fp8-layerwise: "
                                 "fp8 weights, bf16 compute; int8: torchao weight-only)")
        elif key == "base_model_precision" and value == "int8-quanto":
            out.config[key] = value
            out.notes.append("base_model_precision 'int8-quanto' runs as int8-torchao (the same per-channel int8 "
                             "weights; optimum-quanto is not a dependency)")
        elif key == "optimizer" and value not in OPTIMIZERS:
            out.skip(key, value)
        elif key in ("flow_schedule_auto_shift", "flow_schedule_shift") and _static_and_auto_shift(settings):
            # SimpleTuner: a static shift > 0 wins over the auto shift; 0 means "none" beside it
            if (key == "flow_schedule_shift") == (float(settings["flow_schedule_shift"] or 0) > 0):
                out.config[key] = value
            else:
                out.skip(key, value, "SimpleTuner applies flow_schedule_shift when it is above 0, else the auto "
                                     "shift: loraflow takes the one it applies (they are exclusive here)")
        elif key == "report_to" and value not in REPORT_TO:
            out.skip(key, value)
        elif key == "scheduled_sampling_sampler" and value in ROLLOUT_SAMPLERS:
            out.config[key] = ROLLOUT_SAMPLERS[value]
            if value != ROLLOUT_SAMPLERS[value]:
                out.notes.append(f"scheduled_sampling_sampler {value!r} became 'euler' (the only rollout solver)")
        elif key == "crepa_enabled" and _truthy(value) and "crepa_encoder_path" not in settings:
            out.config[key] = value
            out.notes.append("crepa_enabled: set crepa_encoder_path to a local folder with the teacher "
                             f"({settings.get('crepa_encoder', 'dinov2_vitg14')}, transformers save_pretrained); "
                             "loraflow never downloads")
        elif key == "text_encoder_1_precision" and value in TEXT_PRECISIONS:
            out.config[key] = TEXT_PRECISIONS[value]
            out.notes.append(f"text_encoder_1_precision {value!r} became {TEXT_PRECISIONS[value]!r} (int8 weights)")
        elif key == "text_encoder_1_precision" and value not in TEXT_PRECISION_NAMES:
            out.skip(key, value, "the first text encoder runs in fp32, bf16 or int8-torchao (int8 weight-only); "
                                 "other quantisations are not supported")
        elif key in BLOCK_SWAP:
            _block_swap(key, value, out, settings)
        elif key == "lycoris_config":
            out.config[key] = _lycoris(value, base_dir, out)
        elif key == "validation_adapter_mode":
            out.skip(key, value, ADAPTER_MODE_WHY if value != "none" else "none: the adapter keys were dropped")
        elif key in ADAPTER_KEYS and settings.get("validation_adapter_mode") == "none":
            out.skip(key, value, "validation_adapter_mode none: not rendered")
        elif key in ("resolution", "resolution_type"):
            continue  # dataset defaults, applied below
        elif key in shared:
            out.config[key] = value
        else:
            out.skip(key, value)
    masks = {b.get("id") for b in backends if b.get("conditioning_type") == "mask"}  # loss masks (contracts/masks.py)
    out.config["datasets"] = [d for i, b in enumerate(backends)
                              if (d := _dataset(i, b, settings, out, masks)) is not None]
    if "resolution" in settings and not any("resolution" not in b for b in backends if _is_media(b)):
        out.skip("resolution", settings["resolution"], "every dataset sets its own resolution")
    return out


def _block_swap(key: str, value: Any, out: Imported, settings: dict[str, Any]) -> None:
    """musubi-tuner's block swap (`BLOCK_SWAP`) as loraflow's `blocks_to_swap`; 0 is off. With SimpleTuner's
    `enable_group_offload` as well, every block is streamed already: that one stays."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        out.skip(key, value, "the number of transformer blocks to swap, 0 or more")
    elif value and _truthy(settings.get("enable_group_offload")):
        out.skip(key, value, "enable_group_offload streams every block already (set it false to swap only these)")
    elif value:
        out.config["blocks_to_swap"] = value
        if key != "blocks_to_swap":
            out.notes.append(f"{key} {value} became blocks_to_swap {value}: the last {value} transformer blocks wait "
                             "on the CPU, each moved to the GPU for its forward and backward, the rest stay on it")


def _static_and_auto_shift(settings: dict[str, Any]) -> bool:
    return _truthy(settings.get("flow_schedule_auto_shift")) and settings.get("flow_schedule_shift") is not None


def _backends_from(settings: dict[str, Any], base_dir: Path | None, out: Imported) -> list[dict[str, Any]]:
    """The dataset list named by data_backend_config: SimpleTuner resolves it from its root, which is usually
    the parent of config/ (where config.json lives); also tried: config.json's folder and the cwd."""
    for key in BACKEND_KEYS:
        if key in settings:
            path = Path(str(settings[key]))
            for candidate in _candidates(path, base_dir):
                if candidate.is_file():
                    out.notes.append(f"datasets read from {candidate}")
                    return read_json(candidate)
            raise FileNotFoundError(f"{key} names {path}, which does not exist: pass the dataset file as the "
                                    "second argument")
    raise ValueError("no dataset list: pass multidatabackend.json as the second argument")


def _candidates(path: Path, base_dir: Path | None) -> list[Path]:
    """Where SimpleTuner's relative paths may point: its root (usually config/'s parent), config.json's folder, cwd."""
    here = base_dir or Path()
    return [path] if path.is_absolute() else [here.parent / path, here / path, path]


def _lycoris(value: Any, base_dir: Path | None, out: Imported) -> dict[str, Any]:
    """The LyCORIS JSON inlined (its relative path resolved as the dataset list's); fields peft cannot take are
    reported, each with its reason, and an `apply_preset` naming FeedForward becomes lora_include_ffn."""
    if isinstance(value, dict):
        lycoris = dict(value)
    else:
        path = Path(str(value))
        found = [c for c in _candidates(path, base_dir) if c.is_file()]
        if not found:
            raise FileNotFoundError(f"lycoris_config names {path}, which does not exist; run the import from "
                                    "SimpleTuner's folder, or give the file's absolute path in config.json")
        lycoris = read_json(found[0])
        out.notes.append(f"lycoris_config read from {found[0]} and written inline")
    preset = lycoris.get("apply_preset")
    if isinstance(preset, dict) and "FeedForward" in (preset.get("target_module") or []):
        out.config["lora_include_ffn"] = True
        out.notes.append("lycoris_config apply_preset targets FeedForward: lora_include_ffn: true")
    for key in [k for k in lycoris if k in LYCORIS_REFUSED]:
        out.skip(f"lycoris_config.{key}", lycoris.pop(key), LYCORIS_REFUSED[key])
    return lycoris


def simpletuner_families() -> dict[str, str]:
    """SimpleTuner's model_family name -> loraflow's, as each family's SPEC lists its SimpleTuner names."""
    return {alias: spec.name for spec in family_specs() for alias in spec.simpletuner_names}


def _family(value: str, out: Imported) -> str:
    families = simpletuner_families()
    if value not in families:
        out.notes.append(f"model_family {value!r} is not one loraflow imports (known: {', '.join(families)})")
        return value
    return families[value]


def _peer_flavour(value: Any, settings: dict[str, Any]) -> str | None:
    """loraflow's name for a flavour another trainer names `value` (`Flavour.peer_names`), else None."""
    family = simpletuner_families().get(settings.get("model_family", ""))
    return family_spec(family).peer_flavour(str(value)) if family else None


def _diffusers_repo(value: str, settings: dict[str, Any], out: Imported) -> str:
    """A guide's repository that is not in the diffusers layout becomes the flavour's diffusers-format one."""
    flavour = known_flavour(simpletuner_families().get(settings.get("model_family", "")),
                            settings.get("model_flavour"))
    repo = flavour.repo if flavour else None
    if repo is None:
        return value  # the config's validation names what to use
    out.notes.append(f"pretrained_model_name_or_path {value!r} is {NOT_DIFFUSERS[value]}: imported as {repo!r}, the "
                     "flavour's diffusers-format repository")
    return repo


def _resolution(value: Any, settings: dict[str, Any], out: Imported) -> str:
    """SimpleTuner allows `1024` (square) and comma lists; loraflow validates one WIDTHxHEIGHT, in multiples of the
    family's spatial multiple (the guides' 854x480 would be refused at load: it becomes 848x480, said in a note)."""
    text = str(value).strip()
    first, *rest = [part.strip() for part in text.split(",")]
    if rest:
        out.skip("validation_resolution", ",".join(rest), "loraflow renders one validation resolution: kept the first")
    size = f"{first}x{first}" if first.isdigit() else first
    family = simpletuner_families().get(settings.get("model_family", ""))
    sides = size.lower().split("x")
    if family is None or len(sides) != 2 or not all(s.isdigit() for s in sides):
        return size  # the config's validation names the problem
    multiple = family_spec(family).spatial_multiple
    snapped = "x".join(str(nearest_multiple(int(s), multiple)) for s in sides)
    if snapped != size:
        out.notes.append(f"validation_resolution {size} became {snapped}: {family} renders multiples of {multiple}")
    return snapped


def _is_media(entry: dict[str, Any]) -> bool:
    return entry.get("dataset_type", "image") in ("video", "image")


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def _dataset(index: int, entry: dict[str, Any], settings: dict[str, Any], out: Imported,
             masks: set[str]) -> dict[str, Any] | None:
    where = f"datasets[{index}]"
    if not _is_media(entry) and entry.get("dataset_type") not in ("text_embeds", "conditioning"):
        out.skip(f"{where} (id {entry.get('id')})", entry.get("dataset_type"), "dataset_type not supported: dropped")
        return None
    known = set(DatasetConfig.model_fields) - {"crop_style", "crop_aspect", "crop_aspect_buckets", "video",
                                               "conditioning_data", "resolution_type"}
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
        elif key in ("crop", "crop_style", "crop_aspect", "crop_aspect_buckets", "resolution_type"):
            continue  # translated together below
        else:
            out.skip(f"{where}.{key}", value)
    if "dataset_type" not in entry:
        dataset["dataset_type"] = "image"  # SimpleTuner's default
    if _is_media(entry):
        _crop(where, entry, dataset, out)
        _dataset_resolution(where, entry, settings, dataset, out)
    return dataset


def _conditioning_data(where: str, value: Any, settings: dict[str, Any], dataset: dict[str, Any],
                       out: Imported, masks: set[str]) -> None:
    """Kept for i2i (its source images) and for a loss-mask dataset (any flavour); SimpleTuner also pairs ControlNet
    and i2v datasets, which loraflow does not."""
    ids = value if isinstance(value, list) else [value]
    if len(ids) == 1 and ids[0] in masks and "i2i" not in str(settings.get("model_flavour", "")):
        dataset["conditioning_data"] = ids[0]
    elif "i2i" not in str(settings.get("model_flavour", "")):
        out.skip(f"{where}.conditioning_data", value, "loraflow pairs source images for i2i flavours only, and "
                                                      "one loss-mask dataset (conditioning_type mask) with any")
    elif len(ids) != 1:
        out.skip(f"{where}.conditioning_data", value, "loraflow pairs each image with one source-image dataset")
    else:
        dataset["conditioning_data"] = ids[0]


def _video(where: str, video: dict[str, Any], out: Imported) -> dict[str, Any]:
    kept = {}
    for key, value in video.items():
        if key in VideoSettings.model_fields:
            kept[key] = value
        else:
            out.skip(f"{where}.video.{key}", value)
    return kept


def _crop(where: str, entry: dict[str, Any], dataset: dict[str, Any], out: Imported) -> None:
    """SimpleTuner crops only with `crop: true`, to crop_style center/random and crop_aspect preserve/square/closest
    (of crop_aspect_buckets), which all map. crop false (the default) = aspect buckets, which is loraflow's `center`
    (only the rounding remainder is cut), and SimpleTuner then ignores the crop keys."""
    cropping = ("crop_style", "crop_aspect", "crop_aspect_buckets")
    if not _truthy(entry.get("crop", False)):
        for key in (k for k in cropping if k in entry):
            out.skip(f"{where}.{key}", entry[key], "ignored: crop is off")
        return
    style, aspect = entry.get("crop_style", "center"), entry.get("crop_aspect", "preserve")
    if style in ("center", "centre", "random"):
        dataset["crop_style"] = "random" if style == "random" else "center"
    else:
        out.skip(f"{where}.crop_style", style, "loraflow crops center or random")
    if aspect in CROP_ASPECTS:
        dataset["crop_aspect"] = aspect
    else:
        out.skip(f"{where}.crop_aspect", aspect, f"loraflow crops to one of {', '.join(CROP_ASPECTS)}")
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
    if "resolution" not in dataset and "resolution" in settings:
        dataset["resolution"] = settings["resolution"]
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
            side = round(math.sqrt(float(dataset[key]) * 1_000_000))
            out.notes.append(f"{where}.{key} {dataset[key]} megapixels (resolution_type area) became {side}, the "
                             "side in pixels of a square of that area")
            dataset[key] = side


def to_yaml(imported: Imported, sources: list[str]) -> str:
    """The config as YAML, headed by where it came from and every key that was not carried over."""
    lines = [f"# imported by `loraflow import-simpletuner` from {', '.join(sources)}"]
    if imported.unmapped:
        lines.append(f"# {len(imported.unmapped)} SimpleTuner key(s) not carried over:")
        lines += [f"#   {key} = {json.dumps(value, default=str)}: {why}" for key, value, why in imported.unmapped]
    lines += [f"# note: {note}" for note in imported.notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(imported.config, sort_keys=False)
