"""SimpleTuner's defaults where they differ from loraflow's, each with the line of SimpleTuner that sets it.

A key a SimpleTuner config leaves unset trains with SimpleTuner's default; the importer writes that default into the
YAML (with this source line as a comment) wherever loraflow's own default differs, so the imported run trains as
the SimpleTuner run would. Read from bghira/SimpleTuner at `COMMIT`: its argument parser is built from the field
registry (simpletuner/helpers/configuration/cmd_args.py `_populate_parser_from_field_registry`, each field's
`default_value` the argparse default); a field registered twice keeps the later one (registry.py `_add_field`:
`self._fields[field.name] = field`, sections/__init__.py registers model, training, lora, data, validation, advanced,
loss, optimizer, ... in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMMIT = "bc8e6ab7738c"  # bghira/SimpleTuner, 2026-08-22
REGISTRY = "simpletuner/simpletuner_sdk/server/services/field_registry/sections/"
FACTORY = "simpletuner/helpers/data_backend/factory.py"


@dataclass(frozen=True)
class Default:
    key: str  # loraflow's key
    value: Any
    source: str  # SimpleTuner's file:line (and its own key name where it differs)

    def comment(self) -> str:
        return f"SimpleTuner's default ({self.source} at {COMMIT})"


# The run: loraflow key -> SimpleTuner's default when its config leaves the key (SimpleTuner's name) unset.
TRAINING = (
    Default("learning_rate", 4e-7, REGISTRY + "training.py:89"),
    Default("train_batch_size", 4, REGISTRY + "training.py:67"),
    Default("lora_dropout", 0.1, REGISTRY + "lora.py:137"),
    # data.py:544 registers it with None first; advanced.py's registration replaces it
    Default("caption_dropout_probability", 0.1, REGISTRY + "advanced.py:1189"),
    Default("max_grad_norm", 2.0, REGISTRY + "optimizer.py:234"),
    Default("grad_clip_method", "value", REGISTRY + "optimizer.py:272"),
    Default("checkpointing_steps", 500, REGISTRY + "logging_fields.py:79 checkpoint_step_interval"),
    Default("checkpoints_total_limit", 5, REGISTRY + "training.py:204"),
    Default("gradient_checkpointing", True, REGISTRY + "training.py:224"),
    Default("optimizer", "adamw_bf16", REGISTRY + "training.py:114"),
    # every family, Kandinsky 5 and HunyuanVideo 1.5 included: the argparse default is never None, so
    # hunyuanvideo/model.py:236's `if flow_schedule_shift is None` fallback does not apply to a config run
    Default("flow_schedule_shift", 3.0, REGISTRY + "advanced.py:515"),
    Default("report_to", "none", REGISTRY + "logging_fields.py:24"),
    Default("output_dir", "simpletuner-results", REGISTRY + "model.py:148"),
    Default("validation_guidance", 7.5, REGISTRY + "validation.py:416"),
    Default("validation_num_inference_steps", 30, REGISTRY + "validation.py:437"),
    Default("validation_negative_prompt", "blurry, cropped, ugly", REGISTRY + "validation.py:555"),
)
# SimpleTuner's names for loraflow's keys (the config may use either; SimpleTuner reads both, trainer.py:950)
RENAMED = {"checkpoint_step_interval": "checkpointing_steps"}
# Differing defaults the importer leaves at loraflow's, and why (written as notes).
LEFT = {
    "seed": f"SimpleTuner draws a random seed when `seed` is unset ({REGISTRY}model.py:230 None); loraflow's runs "
            "are reproducible: seed 42, set `seed` to choose another",
    "max_train_steps": f"SimpleTuner trains num_train_epochs (default 1, {REGISTRY}training.py:26) when "
                       "max_train_steps is unset; loraflow counts steps: set max_train_steps",
    "mixed_precision": f"SimpleTuner's bf16 ({REGISTRY}advanced.py:689) is loraflow's auto on CUDA",
    "validation_resolution": "SimpleTuner rewrites its default 256 per resolution_type (cmd_args.py:1020-1045); "
                             "loraflow renders at the first training bucket: set validation_resolution",
    "lora_format": f"SimpleTuner writes the diffusers file ({REGISTRY}lora.py:388); loraflow writes it too, with the "
                   "ComfyUI and musubi-tuner files beside it",
    "scheduled_sampling_sampler": f"SimpleTuner rolls out with unipc ({REGISTRY}advanced.py:270); loraflow's rollout "
                                  "solver is Euler",
}
# `lora_type: lycoris` without `lycoris_config`: SimpleTuner reads this file
LYCORIS_FILE = Default("lycoris_config", "config/lycoris_config.json", REGISTRY + "lora.py:412")

# Each family's LoRA targets (peft target_modules suffixes), SimpleTuner's `DEFAULT_LORA_TARGET` for lora_type
# standard (helpers/models/common.py:1001 get_lora_target_layers), where they differ from loraflow's: Kandinsky 5's are
# the attentions' query, key and value; loraflow adds their out_layer.
LORA_TARGETS = {
    "kandinsky5-video": Default("peft_lora_target_modules", ["to_key", "to_query", "to_value"],
                                "simpletuner/helpers/models/kandinsky5_video/model.py:57 DEFAULT_LORA_TARGET"),
    "kandinsky5-image": Default("peft_lora_target_modules", ["to_key", "to_query", "to_value"],
                                "simpletuner/helpers/models/kandinsky5_image/model.py:52 DEFAULT_LORA_TARGET"),
}
LORA_TARGETS_LEFT = {
    "hunyuanvideo-1.5": "SimpleTuner's targets (hunyuanvideo/model.py:102: to_q, to_k, to_v, to_out.0, add_q_proj, "
                        "add_k_proj, add_v_proj, to_add_out) are loraflow's in the main blocks; as bare suffixes they "
                        "also reach the text token refiner's attention, which loraflow does not adapt",
}

# A dataset with `crop: true` and no crop_style / crop_aspect (factory.py: SimpleTuner's defaults for them)
CROP_STYLE = Default("crop_style", "random", FACTORY + ":560")
CROP_ASPECT = Default("crop_aspect", "square", FACTORY + ":553")
# A type huggingface dataset's caption column when its `huggingface:` block names none
CAPTION_COLUMN = Default("caption_column", "caption", "simpletuner/helpers/metadata/backends/huggingface.py:83")
