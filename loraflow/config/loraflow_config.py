"""The one config model: the seed guides' names, validated once at load, every problem named at once.

A config is YAML or JSON. Dataset entries (`config/dataset.py`) have the shape of SimpleTuner's
`multidatabackend.json`; they go inline under `datasets:` or in a separate file named by `dataset_backend_config`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError, ValidationInfo, field_validator, model_validator

from loraflow.config.adapter_kinds import LycorisConfig, read_lycoris_config
from loraflow.config.dataset import (
    DatasetConfig, StrictModel, VideoSettings, check_4k_plus_1, is_mask_dataset, setting,
)
from loraflow.config.errors import describe
from loraflow.config.guide_features import GuideFeatures
from loraflow.config.training_options import TrainingOptions
from loraflow.config.validation_adapters import ValidationAdapter, check_adapters, read_adapter_config
from loraflow.pipelines import (
    describe_families, family_flavour, family_names, family_spec, flavour_names, known_flavour,
)
from loraflow.pipelines.flavours import NOT_DIFFUSERS, Flavour

DEFAULT_PROMPT_NAME = "validation"  # the shortname of `validation_prompt` among the validation prompts
FIRST_LAST_MIN_FRAMES = 9  # 3 latent frames: `i2v_mode: first_last` gives 2 clean, so one carries the loss


class ConfigError(ValueError):
    """A config that cannot run. `problems` lists every issue, each naming the key path."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


class TreadRoute(StrictModel):
    """One TREAD route: a random `selection_ratio` of the visual tokens skips blocks start..end (inclusive)."""

    selection_ratio: float = setting(
        run_key="always", ge=0, lt=1, description="fraction of visual tokens that skip the span, [0, 1)")
    start_layer_idx: int = setting(
        run_key="always", description="first block of the span; negative counts from the end (-1: last)")
    end_layer_idx: int = setting(
        run_key="always", description="last block of the span (inclusive); negative counts from the end")


class TreadConfig(StrictModel):
    """TREAD token routing during training (the seeds' `tread_config`); validation never routes."""

    routes: tuple[TreadRoute, ...] = setting(run_key="always", description="disjoint block spans, each with its ratio")

    @field_validator("routes")
    @classmethod
    def _some(cls, v: tuple[TreadRoute, ...]) -> tuple[TreadRoute, ...]:
        if not v:
            raise ValueError("give at least one route, or remove `tread_config`")
        return v


class LoraflowConfig(GuideFeatures, TrainingOptions):
    """A whole run: model, data, training and validation. Units are in each field's description."""

    model_family: str = setting(run_key="always", description=describe_families())
    model_flavour: str | None = setting(
        None, run_key="always", description="one of the family's flavours; default: the family's")
    pretrained_model_name_or_path: str = setting(
        run_key="always",
        description="a local diffusers-layout folder, or a Hugging Face repo id (org/name) resolved into the Hugging "
        "Face cache (downloaded when online; under HF_HUB_OFFLINE=1 read from the cache); default: the flavour's "
        "diffusers-format repository")
    # Model sources added after runs existed: `when_set` leaves every run that does not set them its key.
    revision: str | None = setting(
        None, run_key="when_set", description="branch, tag or commit of the Hugging Face repo; default: main")
    vae_path: str | None = setting(
        None, run_key="when_set", description="a VAE folder (config.json + safetensors, laid out as a checkpoint's "
        "vae/) used instead of the checkpoint's")
    text_encoder_path: str | None = setting(
        None, run_key="when_set", description="a folder of the first text encoder, laid out as a checkpoint's "
        "text_encoder/, used instead of the checkpoint's (the tokenizer stays the checkpoint's); hunyuanvideo-1.5: "
        "default $HUNYUANVIDEO_TEXT_ENCODER_PATH")
    vision_encoder_path: str | None = setting(
        None, run_key="when_set", description="flavours with a vision encoder (HunyuanVideo 1.5 i2v): a folder laid "
        "out as a checkpoint's image_encoder/; hunyuanvideo-1.5: default $HUNYUANVIDEO_VISION_ENCODER_PATH")
    output_dir: str = setting("output", run_key="never")
    cache_dir: str = setting(
        "cache", run_key="never", description="store root: a local path or an fsspec URL (s3://...)")
    dataset_backend_config: str | None = setting(None, run_key="never", description="JSON file with the dataset list")
    datasets: tuple[DatasetConfig, ...] = setting((), run_key="always")

    lora_rank: int = setting(16, run_key="always", gt=0)
    lora_alpha: float | None = setting(None, run_key="always", description="default: lora_rank (scale 1.0)")
    learning_rate: float = setting(1e-4, run_key="always", gt=0)
    train_batch_size: int = setting(1, run_key="always", ge=1)
    max_train_steps: int = setting(100, run_key="always", ge=1)
    gradient_accumulation_steps: int = setting(1, run_key="always", ge=1)
    lr_scheduler: Literal["constant", "cosine"] = setting("constant", run_key="always")
    lr_warmup_steps: int = setting(0, run_key="always", ge=0)
    max_grad_norm: float = setting(1.0, run_key="always", gt=0)
    lora_dropout: float = setting(0.0, run_key="always", ge=0, lt=1)
    lora_include_ffn: bool = setting(False, run_key="always", description="also adapt the feed-forward layers")
    # an export format, not part of the run: a finished run converts its file (`export_comfyui`)
    lora_format: Literal["diffusers", "comfyui"] = setting(
        "diffusers", run_key="never", description="diffusers: the diffusers/peft file only (what validation loads); "
        "comfyui: also a ComfyUI file (diffusion_model.* names, lora_up/lora_down, alpha) beside it")
    # Tencent-Hunyuan/HunyuanVideo-1.5 train.py's `i2v_prob` (its default 0.3); unset keeps runs from before it
    i2v_prob: float | None = setting(
        None, run_key="when_set", ge=0, le=1, description="HunyuanVideo 1.5 i2v flavours: train each micro-batch "
        "as i2v with this probability, else as t2v (no image; the i2v cache serves both); unset: always i2v")
    # musubi-tuner's `--i2v_mode`; first keeps every key and result of runs from before it
    i2v_mode: Literal["first", "first_last"] = setting(
        "first", run_key="when_set", description="Kandinsky 5 i2v flavours: first_last also gives the clip's last "
        "frame clean (training: the last latent frame is input, not loss; validation renders to the clip's last "
        "frame); first: the first frame only")
    caption_dropout_probability: float = setting(
        0.0, run_key="always", ge=0, le=1, description="train on the empty prompt this often")
    masked_loss_probability: float = setting(
        1.0, run_key="when_set", ge=0, le=1, description="with a `conditioning_type: mask` dataset: the chance a "
        "micro-step weights its loss by the masks (drawn per micro-step from the seed)")
    flow_sigma_sampling: Literal["sigmoid", "logit_normal", "uniform"] = setting("sigmoid", run_key="always")
    flow_sigmoid_scale: float = setting(1.0, run_key="always", gt=0)
    checkpointing_steps: int = setting(
        50, run_key="never", ge=1, description="save a resumable checkpoint every N optimizer steps")
    checkpoints_total_limit: int | None = setting(2, run_key="never", ge=1, description="keep the newest N checkpoints")
    seed: int = setting(42, run_key="always")
    # N processes see N times the samples per step; one keeps the keys of runs from before it existed
    num_processes: int = setting(
        1, run_key="when_set", ge=1, description="data-parallel training processes (one per GPU), each taking "
        "train_batch_size samples per micro-step; > 1, or any CUDA run, trains under `accelerate launch`")
    fsdp: bool = setting(
        False, run_key="when_set", description="FSDP2: shard the frozen transformer, the LoRA and AdamW's state over "
        "the num_processes ranks (`fully_shard` per block, then the root); needs num_processes > 1")

    # validation_*: what validation renders, never part of the run (a new prompt re-renders, never retrains)
    validation_prompt: str | None = setting(None, run_key="never")
    validation_resolution: str | None = setting(
        None, run_key="never", description="WIDTHxHEIGHT in pixels; default 768x512, and where the pipeline sizes "
        "the render from its image (HunyuanVideo 1.5 i2v) the size it renders the image validation starts from at")
    validation_num_video_frames: int | None = setting(None, run_key="never", description="4k+1; default: the flavour's")
    validation_guidance: float | None = setting(None, run_key="never", description="default: the flavour's")
    validation_flow_shift: float | None = setting(
        None, run_key="never", gt=0, description="the sigma shift of validation renders; default: the checkpoint's "
        "scheduler config (scheduler/scheduler_config.json `shift`), else the flavour's")
    validation_num_inference_steps: int | None = setting(
        None, run_key="never", ge=1, description="default: the flavour's (its release's for the distilled flavours, "
        "else 30)")
    user_prompt_library: dict[str, str] | None = setting(
        None, run_key="never", description="more validation prompts {shortname: prompt}: inline, or a JSON file "
        "(relative to the config)")
    validation_seed: int | None = setting(
        None, run_key="never", description="noise seed of every validation render; default: seed")
    validation_negative_prompt: str | None = setting(
        None, run_key="never", description="default: the family's negative prompt")
    validation_steps: int | None = setting(
        None, run_key="never", ge=0, description="also render the validation prompts with the LoRA so far every N "
        "optimizer steps during training, into the run folder (validation/step-NNNNNNN/); 0 or unset: off. Not part "
        "of the run: training computes the same LoRA with or without it")
    validation_on_startup: bool = setting(
        False, run_key="never", description="also render the validation prompts before the first training step (the "
        "base model: the new LoRA starts as a no-op), into the run folder as validation/step-0000000/; not part of "
        "the run")
    # another adapter (or several, each named) rendered beside the trained one by the validation stage, for A/B
    validation_adapter_path: str | None = setting(
        None, run_key="never", description="a local LoRA .safetensors (diffusers/peft format) or a folder holding "
        "pytorch_lora_weights.safetensors; its content hash is part of validation's key")
    validation_adapter_name: str | None = setting(
        None, run_key="never", description="the name its renders carry; default: the file's stem")
    validation_adapter_strength: float = setting(
        1.0, run_key="never", gt=0, description="its scale in the renders")
    validation_adapter_config: tuple[ValidationAdapter, ...] | None = setting(
        None, run_key="never", description="several adapters, each rendered on its own: a list of {label, path, "
        "strength}, SimpleTuner's {runs: [...]}, or a JSON file of either (relative to the config)")
    eval_holdout_fraction: float = setting(
        0.0, run_key="always", ge=0, lt=1, description="fraction of source videos held out of training to measure "
        "eval loss on")
    eval_dataset_id: str | None = setting(
        None, run_key="always", description="a dataset whose clips are only evaluated, never trained on")
    validation_using_datasets: bool = setting(
        False, run_key="never", description="i2v: render validation from the first file (by name) of "
        "`eval_dataset_id`, its first frame; that dataset may then hold images (the seeds' way to validate i2v from "
        "an image dataset)")

    offload_during_startup: bool = setting(
        False, run_key="never", description="never keep the VAE and text encoders on the GPU together")
    # no_change is listed so errors name it; `_no_change` stores it as fp32
    text_encoder_1_precision: Literal["fp32", "bf16", "int8-torchao", "no_change"] = setting(
        "fp32", run_key="always", description="weights and compute of the first text encoder: bf16 halves its memory "
        "on a GPU (allowed on CPU, but slow there); int8-torchao stores its linear weights in int8 (torchao "
        "weight-only) and computes in bf16; no_change (the seeds' default) is fp32; part of every text key")
    vae_enable_patch_conv: bool = setting(
        False, run_key="never", description="exact slab-wise VAE convs: same numbers, lower peak")
    vae_enable_tiling: bool = setting(
        False, run_key="always", description="spatial tiles with seam blending: approximate, lowest peak")
    vae_enable_slicing: bool = setting(False, run_key="always", description="encode a batch one sample at a time")
    latent_sampling: Literal["mode", "distribution"] = setting(
        "mode", run_key="always", description="mode: cache the VAE posterior's mode (deterministic); distribution: "
        "cache its mean and log-variance so training draws a fresh sample each epoch; part of every latent key")
    flow_schedule_shift: float | None = setting(
        None, run_key="always", description="sigma shift for training; default: the flavour's")
    recache_cron: str | None = setting(
        None, run_key="never", description="cron (5 fields, UTC) for the `recache` schedule (a cache_dataset run per "
        "dataset); unset: schedule off")

    # Training memory and speed (seed names). None of the group_offload_* / gradient_checkpointing keys changes
    # the numbers: changing them resumes the same training run.
    gradient_checkpointing: bool = setting(
        False, run_key="never", description="recompute block activations in backward (less memory)")
    gradient_checkpointing_interval: int = setting(
        1, run_key="never", ge=1, description="with gradient_checkpointing: checkpoint every N-th block of each block "
        "list (0, N, 2N, ...), the others keep their activations (faster, more memory; SimpleTuner's name)")
    gradient_checkpointing_cpu_offload: bool = setting(
        False, run_key="never", description="with gradient_checkpointing: keep the inputs each checkpointed block "
        "saves for its recompute on the CPU (musubi-tuner's name; the same numbers, less GPU memory, more transfers)")
    dynamo_use_regional_compilation: bool = setting(
        False, run_key="when_set", description="torch.compile each of the transformer's repeated blocks (diffusers' "
        "compile_repeated_blocks; SimpleTuner's name): faster steps after a compile of minutes; the numbers differ "
        "from eager by float rounding (fused kernels sum in another order), so it is part of the run key")
    enable_group_offload: bool = setting(
        False, run_key="never", description="keep transformer blocks on the CPU, each moved to the GPU only for its "
        "forward (diffusers group offloading); LoRA stays on the GPU")
    gpu_memory_gb: float | None = setting(
        None, run_key="never", gt=0, description="memory of the GPU this config must fit, in GB (counted as GiB): "
        "`loraflow check` names the switches that would make training fit it; default: the CUDA GPU of the machine "
        "running check, if any")
    group_offload_type: Literal["block_level", "leaf_level"] = setting("block_level", run_key="never")
    group_offload_blocks_per_group: int = setting(
        1, run_key="never", ge=1, description="block_level: blocks moved together")
    group_offload_use_stream: bool = setting(
        False, run_key="never", description="overlap transfers with compute (CUDA only)")
    base_model_precision: Literal["no_change", "bf16", "fp8-layerwise", "int8-torchao", "int8-quanto"] = setting(
        "no_change", run_key="always", description="frozen transformer weights: no_change = fp32 as loaded; bf16 "
        "(modules diffusers keeps in fp32 stay fp32); fp8-layerwise = stored float8_e4m3fn, computed in bf16 per "
        "layer (diffusers layerwise casting); int8-torchao = int8 weight-only (torchao), computed in bf16; "
        "int8-quanto runs as int8-torchao (kernels/quantize.py). LoRA parameters are always fp32")
    mixed_precision: Literal["auto", "no", "bf16"] = setting(
        "auto", run_key="always", description="bf16 autocast of the forward: auto = on CUDA, or when "
        "base_model_precision is not no_change; no = fp32 compute (needs base_model_precision no_change)")
    tread_config: TreadConfig | None = setting(
        None, run_key="always", description="TREAD token routing; unset: every token, every block")
    optimizer: Literal["adamw", "adamw_bf16", "muon", "prodigy", "adamw_schedulefree"] = setting(
        "adamw", run_key="when_set", description="adamw: torch AdamW, fp32 moments; adamw_bf16: the same update with "
        "bf16 moments rounded stochastically (kernels/adamw_bf16.py), half the optimizer memory; muon: torch's Muon "
        "(the 2-D LoRA matrices); prodigy: prodigyopt (learning_rate 1.0: it finds the step size); "
        "adamw_schedulefree: schedulefree's AdamW, which needs no decay: keep lr_scheduler constant "
        "(training/optimizers.py)")
    # Adapter kind, start and EMA (SimpleTuner's names; training/adapters.py, training/ema.py). Off by default, keys unchanged.
    lora_type: Literal["standard", "lycoris"] = setting(
        "standard", run_key="when_set", description="standard: peft LoRA; lycoris: LoKr or LoHa (peft's), as "
        "`lycoris_config` says")
    lycoris_config: LycorisConfig | None = setting(
        None, run_key="when_set", description="lora_type lycoris: SimpleTuner's LyCORIS JSON (a file, relative to "
        "the config, or inline): algo lokr|loha, linear_dim, linear_alpha, factor, decompose_both, rank_dropout, "
        "module_dropout")
    use_dora: bool = setting(
        False, run_key="when_set", description="DoRA (peft `use_dora`): a learned magnitude per output row")
    init_lora: str | None = setting(
        None, run_key="never", description="start training from this LoRA file (diffusers/peft or ComfyUI key "
        "names, the same rank and targets); its content hash, not its path, is part of the run's inputs")
    use_ema: bool = setting(
        False, run_key="when_set", description="also keep an EMA of the adapter, written beside the LoRA as "
        "pytorch_lora_weights_ema.safetensors (and in every checkpoint); the LoRA itself is unchanged")
    ema_decay: float = setting(0.995, run_key="when_set", ge=0, le=1, description="ema <- decay * ema + (1 - decay) "
                               "* weights at each update")
    ema_update_interval: int = setting(1, run_key="when_set", ge=1, description="update the EMA every N optimizer "
                                       "steps")
    ema_device: Literal["cpu", "accelerator"] = setting(
        "cpu", run_key="never", description="where the EMA lives between updates (the same numbers either way)")
    ema_validation: Literal["none", "ema_only", "comparison"] = setting(
        "comparison", run_key="never", description="with use_ema, what validation renders: none (the LoRA), "
        "ema_only (the EMA adapter instead) or comparison (both)")
    report_to: Literal["tensorboard", "wandb", "none"] = setting(
        "tensorboard", run_key="never", description="where per-step numbers go besides history.json: tensorboard "
        "(<run>/tensorboard), wandb (W&B's own environment variables, e.g. WANDB_MODE=offline) or none")

    @model_validator(mode="before")
    @classmethod
    def _default_model(cls, data: Any) -> Any:
        """Left out, the model is the flavour's diffusers-format repository, as SimpleTuner picks it."""
        if not isinstance(data, dict) or data.get("pretrained_model_name_or_path") is not None:
            return data
        flavour = known_flavour(data.get("model_family"), data.get("model_flavour"))
        return {**data, "pretrained_model_name_or_path": flavour.repo} if flavour and flavour.repo else data

    @field_validator("recache_cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        # Shape only (5 fields of cron characters or an @alias); Dagster parses it when it builds the schedule.
        aliases = ("@hourly", "@daily", "@weekly", "@monthly")
        if v is not None and v not in aliases and not re.fullmatch(r"[\w*/,?#-]+(\s+[\w*/,?#-]+){4}", v.strip()):
            raise ValueError(f"`recache_cron` must be a 5-field cron expression such as '0 3 * * *' "
                             f"or one of {', '.join(aliases)}; got {v!r}")
        return v

    @field_validator("lycoris_config", mode="before")
    @classmethod
    def _lycoris_file(cls, v: Any) -> Any:
        return read_lycoris_config(v)

    @model_validator(mode="after")
    def _adapter_kind(self) -> LoraflowConfig:
        if (self.lora_type == "lycoris") != (self.lycoris_config is not None):
            raise ValueError("`lora_type: lycoris` and `lycoris_config` go together: set both (LoKr/LoHa) or neither "
                             "(a standard LoRA)")
        if self.use_dora and self.lora_type == "lycoris":
            raise ValueError("`use_dora` is peft's DoRA for a standard LoRA; peft's LoKr/LoHa have no weight "
                             "decomposition: remove use_dora or set lora_type standard")
        if self.use_dora and self.lora_format == "comfyui":
            raise ValueError("`use_dora` with `lora_format: comfyui`: ComfyUI's weight_decompose normalises DoRA's "
                             "magnitude differently from peft (comfy/weight_adapter/base.py), so the file would not "
                             "render what was trained; use lora_format diffusers (or use_dora: false)")
        return self

    @field_validator("init_lora")
    @classmethod
    def _init_lora(cls, v: str | None) -> str | None:
        if v is not None and not (v.endswith(".safetensors") and Path(v).is_file()):
            raise ValueError(f"`init_lora` {v!r} is not a .safetensors file: give the path of the LoRA file to start "
                             "from (diffusers/peft or ComfyUI key names), or remove init_lora")
        return v

    @field_validator("validation_num_video_frames")
    @classmethod
    def _validation_frames(cls, v: int | None) -> int | None:
        return check_4k_plus_1("validation_num_video_frames", v)

    @field_validator("user_prompt_library", mode="before")
    @classmethod
    def _prompt_library(cls, v: Any) -> Any:
        return read_prompt_library(v) if isinstance(v, (str, Path)) else v

    @field_validator("validation_adapter_config", mode="before")
    @classmethod
    def _adapter_config(cls, v: Any) -> Any:
        return None if v is None else read_adapter_config(v)

    @field_validator("validation_resolution")
    @classmethod
    def _resolution(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = v.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"`validation_resolution` must look like 768x512 (WIDTHxHEIGHT); got {v!r}")
        return v

    @field_validator("text_encoder_1_precision", mode="before")
    @classmethod
    def _no_change(cls, v: Any) -> Any:
        return "fp32" if v == "no_change" else v  # the seeds' name for "not quantised"

    @field_validator("model_family")
    @classmethod
    def _family(cls, v: str) -> str:
        if v not in family_names():
            raise ValueError(_unknown("model_family", v, family_names()))
        return v

    @field_validator("model_flavour")
    @classmethod
    def _flavour(cls, v: str | None, info: ValidationInfo) -> str | None:
        family = info.data.get("model_family")
        if v is None or family not in family_names():
            return v
        if v not in flavour_names(family):
            peer = family_spec(family).peer_flavour(v)
            raise ValueError(f"`model_flavour` {v!r} is musubi-tuner's name for {peer!r}: write that" if peer
                             else _unknown("model_flavour", v, flavour_names(family)))
        return v

    @field_validator("datasets")
    @classmethod
    def _datasets(cls, v: tuple[DatasetConfig, ...]) -> tuple[DatasetConfig, ...]:
        if not any(d.dataset_type in ("video", "image") and not d.disabled for d in v):
            raise ValueError("no enabled video/image dataset: add one under `datasets`")
        return v

    @model_validator(mode="after")
    def _validation_and_eval(self) -> LoraflowConfig:
        if self.user_prompt_library and DEFAULT_PROMPT_NAME in self.user_prompt_library and self.validation_prompt:
            raise ValueError(f"`user_prompt_library` may not use the shortname '{DEFAULT_PROMPT_NAME}': "
                             "it names `validation_prompt`; rename the library entry")
        if self.validation_steps and not self.validation_prompts:
            raise ValueError(f"`validation_steps` {self.validation_steps} renders the validation prompts during "
                             "training, but there are none: set `validation_prompt` or `user_prompt_library`, or "
                             "set validation_steps: 0 (off)")
        if self.validation_on_startup and not self.validation_prompts:
            raise ValueError("`validation_on_startup` renders the validation prompts before the first step, but there "
                             "are none: set `validation_prompt` or `user_prompt_library`, or remove it")
        if self.validation_adapter_path and self.validation_adapter_config:
            raise ValueError("give either `validation_adapter_path` (one adapter) or `validation_adapter_config` "
                             "(several), not both")
        check_adapters("validation_adapter_path" if self.validation_adapter_path else "validation_adapter_config",
                       self.validation_adapters)
        if self.eval_dataset_id is not None:
            ids = [d.id for d in self.training_datasets]
            if self.eval_dataset_id not in ids:
                raise ValueError(f"`eval_dataset_id` {self.eval_dataset_id!r} is not an enabled video/image dataset; "
                                 f"allowed: {', '.join(ids)}")
            if len(ids) == 1:
                raise ValueError(f"`eval_dataset_id` {self.eval_dataset_id!r} is the only dataset: nothing would be "
                                 "left to train on; add a training dataset or use `eval_holdout_fraction`")
        return self

    @model_validator(mode="after")
    def _datasets_fit_flavour(self) -> LoraflowConfig:
        """Clip lengths the flavour can train on, checked before any file is read."""
        flavour = family_flavour(self.model_family, self.model_flavour)
        if self.validation_using_datasets and not flavour.takes_image:
            raise ValueError(f"`validation_using_datasets` gives i2v/i2i renders their image; flavour "
                             f"'{flavour.name}' takes no image: remove it, or choose an i2v or i2i flavour")
        if self.validation_using_datasets and self.eval_dataset_id is None:
            raise ValueError("`validation_using_datasets` renders i2v/i2i validation from the images of the "
                             "`eval_dataset_id` dataset: set `eval_dataset_id`")
        if self.validation_using_datasets and not self.validation_prompts:
            raise ValueError("`validation_using_datasets` only changes what validation renders from, and there is "
                             "nothing to render: set `validation_prompt` or `user_prompt_library`")
        for d in self.training_datasets:
            multi_frame = d.video.num_frames != 1 or d.video.frame_extraction == "full"
            if flavour.num_frames == 1 and d.dataset_type == "video" and multi_frame:
                raise ValueError(f"dataset '{d.id}': {self.model_family} trains on single images, but its video "
                                 f"clips have {d.video.num_frames} frames (frame_extraction "
                                 f"{d.video.frame_extraction}); set `video.num_frames` to 1 and a frame_extraction "
                                 "other than full")
            single = d.dataset_type == "image" or d.video.num_frames == 1
            if flavour.conditioning_frames and single and d.id != self.render_dataset_id:
                # the loss covers the frames after the clean first frame (`kernels.flow_matching.flow_mse`): one frame would be NaN
                raise ValueError(f"dataset '{d.id}': flavour '{flavour.name}' trains on the frames after a clean "
                                 "first frame; single images have none: use `dataset_type: video` with "
                                 "`video.num_frames` of 5 or more (or make it `eval_dataset_id` with "
                                 "`validation_using_datasets: true`: images to render validation from)")
        return self

    @model_validator(mode="after")
    def _mixed_tasks(self) -> LoraflowConfig:
        flavour = family_flavour(self.model_family, self.model_flavour)
        if self.i2v_mode == "first_last" and not flavour.conditioning_frames:
            raise ValueError(f"`i2v_mode: first_last`: flavour '{flavour.name}' takes no clean first frame to pair a "
                             "last frame with (only the Kandinsky 5 video i2v flavours): remove it or pick one")
        if self.i2v_mode == "first_last":
            for d in self.training_datasets:
                if d.dataset_type == "video" and d.video.num_frames < FIRST_LAST_MIN_FRAMES:
                    raise ValueError(f"dataset '{d.id}': `i2v_mode: first_last` gives the first and the last latent "
                                     f"frame clean; {d.video.num_frames} frames leave none to train: set "
                                     f"`video.num_frames` to {FIRST_LAST_MIN_FRAMES} or more")
        if self.i2v_prob is not None and not flavour.image_in_condition_only:
            raise ValueError(f"`i2v_prob`: flavour '{flavour.name}' cannot train batches as t2v (only the "
                             "HunyuanVideo 1.5 i2v flavours, whose image is a condition input): remove it")
        return self

    @model_validator(mode="after")
    def _source_images(self) -> LoraflowConfig:
        """i2i datasets name their source images' dataset (`conditioning_data`); no other flavour takes one."""
        flavour = family_flavour(self.model_family, self.model_flavour)
        sources = [d.id for d in self.datasets if d.dataset_type == "conditioning" and not d.disabled]
        for d in self.datasets:
            if d.dataset_type in ("conditioning", "text_embeds") and d.conditioning_data is not None:
                raise ValueError(f"dataset '{d.id}': `conditioning_data` goes on the image dataset whose images "
                                 f"are edits of the source images, not on a {d.dataset_type} dataset")
        for d in self.training_datasets:
            masks = is_mask_dataset(self.source_images(d))  # loss masks pair with any flavour's files
            if flavour.edits_image and masks:
                raise ValueError(f"dataset '{d.id}': `conditioning_data` {d.conditioning_data!r} holds loss masks; "
                                 f"flavour '{flavour.name}' needs it for the source images (masked loss with i2i is "
                                 "not supported): name the source images' dataset")
            if not flavour.edits_image and d.conditioning_data is not None and not masks:
                raise ValueError(f"dataset '{d.id}': `conditioning_data` pairs images with source images for i2i; "
                                 f"flavour '{flavour.name}' takes none: remove it, choose an i2i flavour, or give "
                                 "the conditioning dataset `conditioning_type: mask` (loss masks)")
            if flavour.edits_image and d.conditioning_data is None:
                raise ValueError(f"dataset '{d.id}': flavour '{flavour.name}' edits a source image into each "
                                 "target image: set `conditioning_data` to the id of a `dataset_type: conditioning` "
                                 f"dataset holding them (same relative paths); conditioning datasets: "
                                 f"{', '.join(sources) or 'none'}")
            if d.conditioning_data is not None and d.conditioning_data not in sources:
                raise ValueError(f"dataset '{d.id}': `conditioning_data` {d.conditioning_data!r} is not an enabled "
                                 f"dataset with `dataset_type: conditioning`; allowed: {', '.join(sources) or 'none'}")
            paired = self.source_images(d)
            if paired is not None and _nested(paired.instance_data_dir, d.instance_data_dir):
                raise ValueError(f"dataset '{d.id}': its source images ({paired.instance_data_dir}) and its images "
                                 f"({d.instance_data_dir}) must be separate folders, neither inside the other")
        return self

    @model_validator(mode="after")
    def _checkpointing_switches(self) -> LoraflowConfig:
        used = [k for k, off in (("gradient_checkpointing_interval", 1), ("gradient_checkpointing_cpu_offload", False))
                if getattr(self, k) != off]
        if used and not self.gradient_checkpointing:
            raise ValueError(f"`{used[0]}` changes how gradient checkpointing runs, which is off: set "
                             "gradient_checkpointing: true, or remove it")
        return self

    @model_validator(mode="after")
    def _outputs_outside_datasets(self) -> LoraflowConfig:
        """Dataset folders are read recursively and watched by the sensor: a cache or output folder inside one would
        feed rendered videos back as training data and make every run look like a dataset change."""
        written = {"output_dir": self.output_dir}
        if "://" not in self.cache_dir:  # an object store is no dataset folder
            written["cache_dir"] = self.cache_dir
        for d in self.datasets:
            if d.disabled or not d.instance_data_dir:
                continue
            for key, folder in written.items():
                inside = Path(folder).resolve()
                data = Path(d.instance_data_dir).resolve()
                if inside == data or data in inside.parents:
                    raise ValueError(f"`{key}` {folder} is inside dataset '{d.id}' ({d.instance_data_dir}), which is "
                                     "read recursively: put it outside every dataset folder")
        return self

    @model_validator(mode="after")
    def _model_location(self) -> LoraflowConfig:
        """A repository loraflow cannot read is refused before any work; component folders are checked now."""
        from loraflow.pipelines.sources import FOLDER_KEYS, folder_problem, is_hub_id, unused_problem

        flavour, spec = self.flavour, self.pretrained_model_name_or_path
        if spec in NOT_DIFFUSERS:
            instead = f"use {flavour.repo!r}, the flavour's diffusers-format repository (or leave the key out)" \
                if flavour.repo else "point it at a local diffusers-layout folder"
            raise ValueError(f"`pretrained_model_name_or_path` {spec!r} is {NOT_DIFFUSERS[spec]}: {instead}")
        if self.revision is not None and not is_hub_id(spec):
            raise ValueError(f"`revision` {self.revision!r} picks a version of a Hugging Face repository, but "
                             f"`pretrained_model_name_or_path` {spec!r} is a local folder: remove `revision`")
        for key, component in FOLDER_KEYS.items():
            folder = getattr(self, key)
            problem = folder and (folder_problem(key, folder) or unused_problem(key, component, flavour))
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _validation_renders(self) -> LoraflowConfig:
        """A validation size the family cannot render is refused now, not after training; a local checkpoint's
        configs say the sizes its pipeline renders at (a repository's: `loraflow check`, once it is cached)."""
        from loraflow.pipelines import plan_family
        from loraflow.pipelines.sources import ModelSource, is_hub_id

        if self.validation_size is None:
            return self
        spec = self.pretrained_model_name_or_path
        model = None if is_hub_id(spec) else ModelSource(Path(spec), folders=(("vae", Path(self.vae_path)),)
                                                         if self.vae_path else ())
        problem = plan_family(self).validation_size_problem(model, *self.validation_size)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _training_memory(self) -> LoraflowConfig:
        if self.group_offload_use_stream and not self.enable_group_offload:
            raise ValueError("`group_offload_use_stream` needs `enable_group_offload: true`; set both or neither")
        if self.mixed_precision == "no" and self.base_model_precision != "no_change":
            raise ValueError(f"`base_model_precision` {self.base_model_precision} computes in bf16: set "
                             "`mixed_precision` to auto or bf16 (or base_model_precision to no_change)")
        return self

    @model_validator(mode="after")
    def _sharding(self) -> LoraflowConfig:
        if not self.fsdp:
            return self
        if self.num_processes < 2:
            raise ValueError(f"`fsdp: true` shards the model over the training processes but num_processes is "
                             f"{self.num_processes}: set num_processes: N (one per GPU, N > 1) or fsdp: false")
        # Each of these runs the sharded transformer (or its LoRA) on rank 0 alone or beside FSDP's own hooks
        for key in ("enable_group_offload", "crepa_enabled", "validation_steps", "use_ema", "lycoris_config",
                    "validation_on_startup"):
            if getattr(self, key):
                raise ValueError(f"`{key}` is not supported with `fsdp: true` (untested together): remove `{key}` "
                                 "or set fsdp: false")
        return self

    @model_validator(mode="after")
    def _crepa(self) -> LoraflowConfig:
        if self.crepa_enabled and self.crepa_encoder_path is None:
            raise ValueError("`crepa_enabled` needs the teacher's weights: set `crepa_encoder_path` to a local folder "
                             "holding a transformers DINOv2 (save_pretrained)")
        if self.crepa_enabled and self.tread_config is not None:
            raise ValueError("`crepa_enabled` reads every token of block `crepa_block_index`; TREAD routes a subset "
                             "of them: remove `tread_config` or set crepa_enabled: false")
        return self

    @property
    def flavour(self) -> Flavour:
        """The flavour the two model keys pick (the family's default when `model_flavour` is unset)."""
        return family_flavour(self.model_family, self.model_flavour)

    @property
    def validation_prompts(self) -> dict[str, str]:
        """Every prompt validation renders, by shortname: `validation_prompt` first, then the library."""
        prompts = {DEFAULT_PROMPT_NAME: self.validation_prompt} if self.validation_prompt else {}
        return {**prompts, **(self.user_prompt_library or {})}

    @property
    def validation_adapters(self) -> tuple[ValidationAdapter, ...]:
        """The adapters validation renders beside the trained one: the single one's keys, or the list."""
        if self.validation_adapter_path is None:
            return self.validation_adapter_config or ()
        return (ValidationAdapter(path=self.validation_adapter_path, label=self.validation_adapter_name,
                                  strength=self.validation_adapter_strength),)

    @property
    def training_datasets(self) -> tuple[DatasetConfig, ...]:
        return tuple(d for d in self.datasets if d.dataset_type in ("video", "image") and not d.disabled)

    def source_images(self, dataset: DatasetConfig) -> DatasetConfig | None:
        """The conditioning dataset i2i pairs `dataset`'s images with (its `conditioning_data`), if any."""
        return next((d for d in self.datasets if d.id == dataset.conditioning_data), None)

    @property
    def render_dataset_id(self) -> str | None:
        """The dataset i2v/i2i validation renders from (`validation_using_datasets`); for i2v it may hold images."""
        return self.eval_dataset_id if self.validation_using_datasets else None

    @property
    def validation_size(self) -> tuple[int, int] | None:
        """(height, width) in pixels; None: left out (`contracts.renders.render_settings` picks the default)."""
        if self.validation_resolution is None:
            return None
        width, height = (int(p) for p in self.validation_resolution.lower().split("x"))
        return height, width


def read_prompt_library(path: str | Path) -> dict[str, str]:
    """SimpleTuner's user_prompt_library: a JSON object {shortname: prompt}."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`user_prompt_library` file {path} does not exist; give a JSON file or an inline mapping")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"`user_prompt_library` file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"`user_prompt_library` file {path} must hold one JSON object of shortname -> prompt strings")
    return data


def _nested(a: str | None, b: str | None) -> bool:
    """One folder is the other or inside it (a dataset folder is read recursively)."""
    first, second = Path(a or "").resolve(), Path(b or "").resolve()
    return first == second or first in second.parents or second in first.parents


def _unknown(key: str, value: str, allowed: list[str]) -> str:
    return f"`{key}` {value!r} is not known; allowed: {', '.join(allowed)}"


def parse_config(data: dict[str, Any], source: str = "config", base_dir: Path | None = None) -> LoraflowConfig:
    """Validate a config dict; raise ConfigError listing every problem with its key path."""
    data = dict(data)
    backend = data.get("dataset_backend_config")
    if backend and "datasets" not in data:
        path = Path(backend) if base_dir is None or Path(backend).is_absolute() else base_dir / backend
        if not path.is_file():
            raise ConfigError([f"dataset_backend_config: file {path} does not exist"], source)
        data["datasets"] = json.loads(path.read_text())
    lycoris = data.get("lycoris_config")  # relative to the config file, like the datasets file
    if isinstance(lycoris, str) and base_dir is not None and not Path(lycoris).is_absolute():
        data["lycoris_config"] = str(base_dir / lycoris)
    for key in ("user_prompt_library", "validation_adapter_config"):  # JSON files relative to the config file
        named = data.get(key)
        if isinstance(named, str) and base_dir is not None and not Path(named).is_absolute():
            data[key] = str(base_dir / named)
    try:
        return LoraflowConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([describe(e, LoraflowConfig) for e in exc.errors()], source) from None


def load_config(path: str | Path) -> LoraflowConfig:
    """Read a YAML or JSON config file (JSON is YAML) and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist"], str(path))
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping of keys to values"], str(path))
    return parse_config(data, str(path), path.parent)


def select_datasets(config: LoraflowConfig, ids: list[str] | None) -> list[DatasetConfig]:
    """The training datasets named by `ids` (None: all of them), in config order; an unknown id raises."""
    known = [d.id for d in config.training_datasets]
    unknown = sorted(set(ids or ()) - set(known))
    if unknown:
        raise ValueError(f"dataset(s) {', '.join(unknown)} not among the config's training datasets "
                         f"({', '.join(known) or 'none'})")
    return [d for d in config.training_datasets if ids is None or d.id in ids]
