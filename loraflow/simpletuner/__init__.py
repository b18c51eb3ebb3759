"""Import a SimpleTuner configuration (config.json + multidatabackend.json) as a loraflow config.

Keys loraflow shares with SimpleTuner (the seed guides' vocabulary) are copied; a few are translated
(`hunyuanvideo` -> `hunyuanvideo-1.5`, `kandinsky5_video` -> `kandinsky5-video`, musubi-tuner's task names as
`model_flavour`, `--flag` spellings, `checkpoint_step_interval`, `crop` + `crop_style`/`crop_aspect`, a bare validation
resolution, `area` megapixels, a guide's repository that is not in the diffusers layout, a Hugging Face dataset's
`huggingface:` block, a LyCORIS preset's feed-forward); everything else is reported, key by key, with the reason, and
written as comments at the top of the output so nothing disappears silently. Keys the SimpleTuner config leaves unset
get SimpleTuner's default where loraflow's differs (`defaults.py`, each with SimpleTuner's source line as its
comment), and relative files are found where SimpleTuner finds them (`paths.py`). Any value of any key imports; input
that is not SimpleTuner's shape is an `ImportProblem` naming the file or key and what to do. The result is validated
like any config.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from loraflow.config import LoraflowConfig
from loraflow.config.adapter_kinds import REFUSED as LYCORIS_REFUSED
from loraflow.pipelines import family_spec, family_specs, known_flavour, nearest_multiple
from loraflow.pipelines.flavours import NOT_DIFFUSERS
from loraflow.simpletuner import defaults
from loraflow.simpletuner.datasets import GLOBAL_KEYS, datasets, is_media
from loraflow.simpletuner.imported import Imported, is_text, to_yaml, truthy
from loraflow.simpletuner.paths import (
    ImportProblem,
    file_settings,
    find,
    folder_note,
    json_kind,
    read_json,
    simpletuner_root,
)

BACKEND_KEYS = ("data_backend_config", "dataset_backend_config")
LR_SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine"}
BASE_PRECISIONS = typing.get_args(LoraflowConfig.model_fields["base_model_precision"].annotation)
ONLY_VALUE = {"model_type": "lora"}
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
GENERIC_FFN = "FeedForward"  # SimpleTuner's generic LyCORIS preset name (models/common.py DEFAULT_LYCORIS_TARGET)

__all__ = ["BACKEND_KEYS", "ONLY_VALUE", "ImportProblem", "Imported", "import_simpletuner", "read_json",
           "simpletuner_families", "to_yaml"]


def import_simpletuner(config: Any, backends: Any, base_dir: Path | None = None) -> Imported:
    """Translate SimpleTuner settings (keys with or without `--`) and its dataset list into a loraflow dict."""
    if not isinstance(config, dict):
        raise ImportProblem(f"config.json (the first argument) holds a JSON {json_kind(config)}, not SimpleTuner's "
                            "settings: give the file whose top level is one object ({\"model_family\": ..., ...})")
    settings = {str(k).lstrip("-"): v for k, v in config.items()}
    out = Imported({})
    root = simpletuner_root(base_dir)
    if backends is None:
        backends = _backends_from(settings, base_dir, out)
    if not isinstance(backends, list):
        raise ImportProblem(f"the dataset list (multidatabackend.json) holds a JSON {json_kind(backends)}: "
                            "SimpleTuner's is a list of datasets ([{\"id\": ...}, ...]); wrap one dataset in [ ]")
    for key in BACKEND_KEYS:
        settings.pop(key, None)
    family = _family_of(settings)
    for key, value in settings.items():
        _setting(key, value, settings, family, base_dir, out)
    out.config["datasets"] = datasets(backends, settings, out)
    media = [b for b in backends if isinstance(b, dict) and is_media(b)]
    for key in (k for k in GLOBAL_KEYS if k in settings and not any(k not in b for b in media)):
        out.skip(key, settings[key], f"every dataset sets its own {key}")
    _defaults(settings, family, base_dir, out)
    file_settings(out, base_dir, root)
    if note := folder_note(out.config, root):
        out.notes.append(note)
    return out


def _setting(key: str, value: Any, settings: dict[str, Any], family: str | None, base_dir: Path | None,
             out: Imported) -> None:
    """One SimpleTuner key: carried, translated or listed as not carried."""
    shared = set(LoraflowConfig.model_fields) - {"datasets", "dataset_backend_config"}
    text = value if is_text(value) else None  # lookups in tables take text only (a dict value is unhashable)
    if key == "model_family":
        out.config[key] = _family(value, out)
    elif key == "model_flavour" and (flavour := _peer_flavour(text, family)):
        out.config[key] = flavour
        out.notes.append(f"model_flavour {value!r} (musubi-tuner's task name) became {flavour!r}")
    elif key == "pretrained_model_name_or_path" and text in NOT_DIFFUSERS:
        out.config[key] = _diffusers_repo(text, settings, family, out)
    elif key == "validation_resolution":
        out.config[key] = _resolution(value, family, out)
    elif key == "lr_scheduler" and text in LR_SCHEDULERS:
        out.config[key] = LR_SCHEDULERS[text]
    elif key == "flow_use_uniform_schedule":
        if truthy(value):
            out.config["flow_sigma_sampling"] = "uniform"
    elif key in ONLY_VALUE:
        if value != ONLY_VALUE[key]:
            out.skip(key, value, f"only {ONLY_VALUE[key]!r} is supported")
    elif key in defaults.RENAMED:
        _renamed(key, value, settings, out)
    elif key == "peft_lora_target_modules" and settings.get("lora_type", "standard") != "standard":
        out.skip(key, value, "SimpleTuner reads it for lora_type standard only (helpers/models/common.py:953)")
    elif key == "max_grad_norm" and value in (0, "0"):
        out.skip(key, value, "0: SimpleTuner does not clip (trainer.py:7141); loraflow always clips: set a large "
                             "max_grad_norm (e.g. 1e9) for the same")
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
        if (key == "flow_schedule_shift") == _static_shift_wins(settings):
            out.config[key] = value
        else:
            out.skip(key, value, "SimpleTuner applies flow_schedule_shift when it is above 0, else the auto "
                                 "shift: loraflow takes the one it applies (they are exclusive here)")
    elif key == "report_to" and value not in REPORT_TO:
        out.skip(key, value)
    elif key == "scheduled_sampling_sampler" and text in ROLLOUT_SAMPLERS:
        out.config[key] = ROLLOUT_SAMPLERS[text]
        if text != ROLLOUT_SAMPLERS[text]:
            out.notes.append(f"scheduled_sampling_sampler {text!r} became 'euler' (the only rollout solver)")
    elif key == "crepa_enabled" and truthy(value) and "crepa_encoder_path" not in settings:
        out.config[key] = value
        out.notes.append("crepa_enabled: set crepa_encoder_path to a local folder with the teacher "
                         f"({settings.get('crepa_encoder', 'dinov2_vitg14')}, transformers save_pretrained); "
                         "loraflow never downloads")
    elif key == "text_encoder_1_precision" and text in TEXT_PRECISIONS:
        out.config[key] = TEXT_PRECISIONS[text]
        out.notes.append(f"text_encoder_1_precision {text!r} became {TEXT_PRECISIONS[text]!r} (int8 weights)")
    elif key == "text_encoder_1_precision" and value not in TEXT_PRECISION_NAMES:
        out.skip(key, value, "the first text encoder runs in fp32, bf16 or int8-torchao (int8 weight-only); "
                             "other quantisations are not supported")
    elif key in BLOCK_SWAP:
        _block_swap(key, value, out, settings)
    elif key == "lycoris_config":
        _lycoris(value, family, base_dir, out)
    elif key == "validation_adapter_mode":
        out.skip(key, value, ADAPTER_MODE_WHY if value != "none" else "none: the adapter keys were dropped")
    elif key in ADAPTER_KEYS and settings.get("validation_adapter_mode") == "none":
        out.skip(key, value, "validation_adapter_mode none: not rendered")
    elif key in (*GLOBAL_KEYS, "resolution_type"):
        return  # dataset defaults, applied by datasets()
    elif key in shared:
        out.config[key] = value
    else:
        out.skip(key, value)


def _renamed(key: str, value: Any, settings: dict[str, Any], out: Imported) -> None:
    """SimpleTuner's name for a loraflow key (`checkpoint_step_interval` -> checkpointing_steps); SimpleTuner's
    trainer takes the legacy name (loraflow's) only where its own is unset or 0 (trainer.py:950)."""
    target = defaults.RENAMED[key]
    if value in (None, "", 0, "0"):
        out.skip(key, value, f"unset: SimpleTuner uses {target} then (trainer.py:950)")
        return
    out.config[target] = value
    out.notes.append(f"{key} {value!r} became {target} {value!r}")
    if target in settings:
        out.skip(target, settings[target], f"SimpleTuner checkpoints every {key} ({value!r}), its own name")


def _defaults(settings: dict[str, Any], family: str | None, base_dir: Path | None, out: Imported) -> None:
    """SimpleTuner's default for each key its config leaves unset, where loraflow's default differs."""
    given = set(settings) | {defaults.RENAMED.get(k, k) for k in settings}
    auto_shift = truthy(settings.get("flow_schedule_auto_shift"))
    for default in defaults.TRAINING:
        if default.key in given or default.key in out.config or default.key not in LoraflowConfig.model_fields:
            continue
        if default.key == "flow_schedule_shift" and auto_shift:
            continue  # the auto shift is SimpleTuner's shift then
        if LoraflowConfig.model_fields[default.key].default != default.value:
            out.default(default)
    lora_type = settings.get("lora_type", "standard")
    if family in defaults.LORA_TARGETS and lora_type == "standard" and "peft_lora_target_modules" not in settings:
        if not truthy(settings.get("lora_include_ffn")):
            out.default(defaults.LORA_TARGETS[family])
    if family in defaults.LORA_TARGETS_LEFT and lora_type == "standard":
        out.notes.append(f"LoRA targets: {defaults.LORA_TARGETS_LEFT[family]}")
    if lora_type == "lycoris" and "lycoris_config" not in settings:
        if find(defaults.LYCORIS_FILE.value, base_dir) is None:
            raise ImportProblem(f"lora_type lycoris without lycoris_config: SimpleTuner then reads "
                                f"{defaults.LYCORIS_FILE.value} ({defaults.LYCORIS_FILE.comment()}), which is not "
                                "there: set lycoris_config to the LyCORIS JSON file")
        _lycoris(defaults.LYCORIS_FILE.value, family, base_dir, out)
        out.notes.append(f"lycoris_config unset: {defaults.LYCORIS_FILE.value}, {defaults.LYCORIS_FILE.comment()}, "
                         "is read")
    if settings.get("optimizer", "adamw_bf16") == "prodigy":
        out.notes.append("optimizer prodigy: SimpleTuner does not clip gradients with it (trainer.py:7140); loraflow "
                         "clips at max_grad_norm: set a large one (e.g. 1e9) for the same")
    out.left += [f"{key}: {why}" for key, why in defaults.LEFT.items() if key not in given]


def _block_swap(key: str, value: Any, out: Imported, settings: dict[str, Any]) -> None:
    """musubi-tuner's block swap (`BLOCK_SWAP`) as loraflow's `blocks_to_swap`; 0 is off. With SimpleTuner's
    `enable_group_offload` as well, every block is streamed already: that one stays."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        out.skip(key, value, "the number of transformer blocks to swap, 0 or more")
    elif value and truthy(settings.get("enable_group_offload")):
        out.skip(key, value, "enable_group_offload streams every block already (set it false to swap only these)")
    elif value:
        out.config["blocks_to_swap"] = value
        if key != "blocks_to_swap":
            out.notes.append(f"{key} {value} became blocks_to_swap {value}: the last {value} transformer blocks wait "
                             "on the CPU, each moved to the GPU for its forward and backward, the rest stay on it")


def _static_and_auto_shift(settings: dict[str, Any]) -> bool:
    return truthy(settings.get("flow_schedule_auto_shift")) and settings.get("flow_schedule_shift") is not None


def _static_shift_wins(settings: dict[str, Any]) -> bool:
    try:
        return float(settings["flow_schedule_shift"] or 0) > 0
    except (TypeError, ValueError):
        return True  # not a number: carried, and the config's validation names it


def _backends_from(settings: dict[str, Any], base_dir: Path | None, out: Imported) -> Any:
    """The dataset list named by data_backend_config, found where SimpleTuner finds it (`paths.find`)."""
    for key in BACKEND_KEYS:
        if key in settings:
            if not is_text(settings[key]) or not settings[key]:
                raise ImportProblem(f"{key} is {settings[key]!r}, not the path of the dataset list: pass "
                                    "multidatabackend.json as the second argument")
            found = find(settings[key], base_dir)
            if found is None:
                raise ImportProblem(f"{key} names {settings[key]}, which does not exist: pass the dataset file as "
                                    "the second argument")
            out.notes.append(f"datasets read from {found}")
            return read_json(found)
    raise ImportProblem("no dataset list: pass multidatabackend.json as the second argument")


def _lycoris(value: Any, family: str | None, base_dir: Path | None, out: Imported) -> None:
    """The LyCORIS JSON inlined (its path found as SimpleTuner finds it); fields peft cannot take are reported, each
    with its reason, and an `apply_preset` naming the family's feed-forward class becomes lora_include_ffn."""
    if isinstance(value, dict):
        lycoris = dict(value)
    elif is_text(value) and value:
        found = find(value, base_dir)
        if found is None:
            raise ImportProblem(f"lycoris_config names {value}, which does not exist; run the import from "
                                "SimpleTuner's folder, or give the file's absolute path in config.json")
        lycoris = read_json(found)
        if not isinstance(lycoris, dict):
            raise ImportProblem(f"lycoris_config {found} holds a JSON {json_kind(lycoris)}: LyCORIS's config is "
                                "one object ({\"algo\": \"lokr\", ...})")
        out.notes.append(f"lycoris_config read from {found} and written inline")
    else:
        out.skip("lycoris_config", value, "the LyCORIS JSON (an object) or the path of its file")
        return
    preset = lycoris.get("apply_preset")
    targets = preset.get("target_module") if isinstance(preset, dict) else None
    ffn = (*family_spec(family).ffn_classes, GENERIC_FFN) if family else (GENERIC_FFN,)
    named = [t for t in targets if is_text(t) and t in ffn] if isinstance(targets, list) else []
    if named:
        out.config["lora_include_ffn"] = True
        out.notes.append(f"lycoris_config apply_preset targets {named[0]}: lora_include_ffn: true")
    for key in [k for k in lycoris if k in LYCORIS_REFUSED]:
        out.skip(f"lycoris_config.{key}", lycoris.pop(key), LYCORIS_REFUSED[key])
    out.config["lycoris_config"] = lycoris


def simpletuner_families() -> dict[str, str]:
    """SimpleTuner's model_family name (lower case) -> loraflow's, as each family's SPEC lists its SimpleTuner
    names."""
    return {alias.lower(): spec.name for spec in family_specs() for alias in spec.simpletuner_names}


def _family_of(settings: dict[str, Any]) -> str | None:
    """loraflow's family for the config's model_family (any case, as SimpleTuner's registry.py `get`), or None."""
    value = settings.get("model_family")
    return simpletuner_families().get(value.lower()) if is_text(value) else None


def _family(value: Any, out: Imported) -> Any:
    families = simpletuner_families()
    if not is_text(value) or value.lower() not in families:
        out.notes.append(f"model_family {value!r} is not one loraflow imports (known: {', '.join(families)})")
        return value
    return families[value.lower()]


def _peer_flavour(value: str | None, family: str | None) -> str | None:
    """loraflow's name for a flavour another trainer names `value` (`Flavour.peer_names`), else None."""
    return family_spec(family).peer_flavour(value) if family and value is not None else None


def _diffusers_repo(value: str, settings: dict[str, Any], family: str | None, out: Imported) -> str:
    """A guide's repository that is not in the diffusers layout becomes the flavour's diffusers-format one."""
    flavour_name = settings.get("model_flavour")
    flavour = known_flavour(family, flavour_name if is_text(flavour_name) else None)
    repo = flavour.repo if flavour else None
    if repo is None:
        return value  # the config's validation names what to use
    out.notes.append(f"pretrained_model_name_or_path {value!r} is {NOT_DIFFUSERS[value]}: imported as {repo!r}, the "
                     "flavour's diffusers-format repository")
    return repo


def _resolution(value: Any, family: str | None, out: Imported) -> str:
    """SimpleTuner allows `1024` (square) and comma lists; loraflow validates one WIDTHxHEIGHT, in multiples of the
    family's spatial multiple (the guides' 854x480 would be refused at load: it becomes 848x480, said in a note)."""
    text = str(value).strip()
    first, *rest = [part.strip() for part in text.split(",")]
    if rest:
        out.skip("validation_resolution", ",".join(rest), "loraflow renders one validation resolution: kept the first")
    size = f"{first}x{first}" if re.fullmatch(r"[0-9]{1,6}", first) else first
    sides = size.lower().split("x")
    if family is None or len(sides) != 2 or not all(re.fullmatch(r"[0-9]{1,6}", s) for s in sides):
        return size  # the config's validation names the problem
    multiple = family_spec(family).spatial_multiple
    snapped = "x".join(str(nearest_multiple(int(s), multiple)) for s in sides)
    if snapped != size:
        out.notes.append(f"validation_resolution {size} became {snapped}: {family} renders multiples of {multiple}")
    return snapped
