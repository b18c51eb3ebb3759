"""Other adapters the validation stage renders beside the trained LoRA, for A/B (SimpleTuner's
`validation_adapter_path` / `validation_adapter_name` / `validation_adapter_strength`, or a list of them in
`validation_adapter_config`).

Each adapter is a local LoRA file in the diffusers/peft format (what loraflow writes; a folder means its
pytorch_lora_weights.safetensors) loaded once into the validation pipeline's transformer under its own peft adapter
name; a render activates that adapter alone at its strength, so the trained LoRA and the base renders stay exactly as
they are. Nothing is downloaded: a Hugging Face id is refused with what to do. Validation's key holds each adapter's
name, strength and content hash (`safetensors_sha256`); without adapters the key is the one it was before.
Config validation (this module's top half) runs without torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loraflow.config.config_files import read_json_file
from loraflow.config.run_key import StrictModel, setting
from loraflow.safetensors_header import read_adapter_header

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # SimpleTuner's default file in a folder, and loraflow's
RESERVED_NAMES = ("base", "lora")  # the validation stage's own renders


class ValidationAdapter(StrictModel):
    """One entry of `validation_adapter_config` (SimpleTuner's keys): a LoRA file rendered under its own name."""

    path: str = setting(run_key="never", description="a local LoRA .safetensors (diffusers/peft format), or a folder "
                        f"holding {DEFAULT_WEIGHT_NAME}")
    label: str | None = setting(None, run_key="never", description="the name its renders carry; default: "
                                "adapter_name, else the file's stem")
    adapter_name: str | None = setting(None, run_key="never", description="SimpleTuner's identifier; the name when "
                                       "label is unset")
    strength: float = setting(1.0, run_key="never", gt=0, description="the adapter's scale in the render")

    @property
    def name(self) -> str:
        return self.label or self.adapter_name or Path(self.path).stem


def read_adapter_config(value: Any) -> Any:
    """SimpleTuner's forms: a JSON file, a list of entries or an object with a `runs` list -> the list."""
    if isinstance(value, (str, Path)):
        value = read_json_file(Path(value), "validation_adapter_config", "give a JSON file or an inline list of "
                               "{label, path, strength}")
    if isinstance(value, dict) and set(value) == {"runs"}:
        value = value["runs"]
    for entry in value if isinstance(value, list) else []:
        if isinstance(entry, dict) and ("adapters" in entry or "paths" in entry):
            raise ValueError("`validation_adapter_config`: loraflow renders one adapter per entry; give each of "
                             "`adapters`/`paths` its own entry")
    return value


def adapter_file(key: str, path: str) -> Path:
    """The LoRA file `path` names (a folder: its pytorch_lora_weights.safetensors); a clear error if there is none."""
    given = Path(path)
    file = given / DEFAULT_WEIGHT_NAME if given.is_dir() else given
    if not file.is_file():
        hub = "" if given.exists() or given.is_absolute() or path.count("/") != 1 else \
            " (Hugging Face ids are not downloaded: fetch it with `hf download` and give the local file)"
        raise ValueError(f"`{key}` {path!r} is not a local LoRA file or a folder holding {DEFAULT_WEIGHT_NAME}{hub}")
    return file


def check_adapters(key: str, adapters: tuple[ValidationAdapter, ...]) -> None:
    """Files exist and are LoRA safetensors (`read_adapter_header`), names are distinct and free (base, LoRA: the
    stage's own renders), checked at load; `key` is the config key that gave them."""
    names = [a.name.lower() for a in adapters]
    for adapter in adapters:
        read_adapter_header(adapter_file(key, adapter.path), key)  # safetensors of float tensors, header only
        if adapter.name.lower() in RESERVED_NAMES:
            raise ValueError(f"validation adapter name {adapter.name!r} is taken by validation's own renders "
                             f"({', '.join(RESERVED_NAMES)}): give it another `label`")
        if names.count(adapter.name.lower()) > 1:
            raise ValueError(f"two validation adapters are named {adapter.name!r}: give each its own `label`")


# The parts of a LoRA file's tensor names past the module they adapt (peft's, diffusers' older and LyCORIS names).
_ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_down", "lora_up", "lora", "lora_magnitude_vector", "alpha",
                            "dora_scale", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
                            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"})


def adapted_modules(names: Iterable[str]) -> set[str]:
    """The transformer modules a LoRA file's tensors adapt (`transformer.` prefixes dropped)."""
    modules = set()
    for name in names:
        parts = name.removeprefix("transformer.").split(".")
        cut = next((i for i, part in enumerate(parts) if part in _ADAPTER_PARTS), len(parts))
        modules.add(".".join(parts[:cut]))
    return modules


def adapter_problems(key: str, adapters: tuple[ValidationAdapter, ...], transformer: Path | None) -> list[str]:
    """Why an adapter cannot render ([] when each can), read before any render and in `loraflow check`: its values
    hold NaN or inf (it rendered an all-black video, and the step succeeded), or it adapts modules the model's
    transformer lacks (another family's adapter, or another size's: it failed late, in peft). `transformer`: the
    model's transformer folder, whose safetensors headers name its modules (None: not on disk, not compared)."""
    from loraflow.safetensors_header import non_finite_problem, read_header, tensor_entries

    weights = {} if transformer is None else {
        name for file in sorted(transformer.glob("*.safetensors")) for name in tensor_entries(read_header(file))}
    modules = {name.rsplit(".", 1)[0] for name in weights}
    problems = []
    for adapter in adapters:
        path = adapter_file(key, adapter.path)
        header = read_adapter_header(path, key)
        if problem := non_finite_problem(path, key, header, "export the adapter again, or leave it out"):
            problems.append(problem)
        missing = sorted(adapted_modules(tensor_entries(header)) - modules) if modules else []
        if missing:
            problems.append(f"`{key}` {path} adapts {len(missing)} module(s) the model's transformer "
                            f"({transformer}) has not (e.g. {', '.join(missing[:2])}): it is an adapter of another "
                            "model family or size, or in another format than diffusers/peft (ComfyUI's); give one "
                            "trained on this model, as loraflow exports it, or leave it out")
    return problems


# -- the validation stage's side (torch inside) -----------------------------------------------------------------
def adapter_keys(adapters: tuple[ValidationAdapter, ...]) -> dict[str, Any]:
    """What validation's key holds of the adapters: nothing without them (keys stay as they were)."""
    from loraflow.keys import safetensors_sha256

    if not adapters:
        return {}
    return {"adapters": [{"name": a.name, "strength": a.strength,
                          "sha256": safetensors_sha256(adapter_file("adapter", a.path))} for a in adapters]}


def peft_name(index: int) -> str:
    return f"validation_adapter_{index}"


def load_adapters(transformer: Any, adapters: tuple[ValidationAdapter, ...]) -> None:
    """Each adapter into the pipeline's transformer under its own peft name (`load_lora_file`)."""
    from loraflow.pipelines.base import load_lora_file

    for i, adapter in enumerate(adapters):
        load_lora_file(transformer, adapter_file("adapter", adapter.path), adapter_name=peft_name(i))


def activate(transformer: Any, index: int, adapter: ValidationAdapter) -> None:
    """This adapter alone at its strength; the next render's `set_lora_scale` activates the trained LoRA alone."""
    transformer.set_adapters([peft_name(index)], [adapter.strength])
