"""Every key of a config: its type, default, bounds, description and what it does to the run key (`setting`),
with the checks of one key alone (a cron's shape, a known family, a file that exists). The checks across keys are
`LoraflowConfig`'s (loraflow_config.py), which adds no field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationInfo, field_validator, model_validator

from loraflow.config.adapter_kinds import LycorisConfig, read_lycoris_config
from loraflow.config.config_files import read_json_file
from loraflow.config.dataset import DatasetConfig, check_4k_plus_1
from loraflow.config.guide_features import GuideFeatures
from loraflow.config.run_key import StrictModel, setting
from loraflow.config.training_options import TrainingOptions
from loraflow.config.validation_adapters import ValidationAdapter, read_adapter_config
from loraflow.pipelines import describe_families, family_names, family_spec, flavour_names, known_flavour
from loraflow.safetensors_header import read_adapter_header


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


class ConfigFields(GuideFeatures, TrainingOptions):
    """A whole run's keys: model, data, training and validation. Units are in each field's description."""

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
    # caption_strategy auto (stages/captions/captions.py, docs/footage.md); unset, they leave every run its key
    caption_model_path: str | None = setting(
        None, run_key="when_set", description="caption_strategy auto: a Qwen2.5-VL folder or Hub id "
        "(Qwen2_5_VLForConditionalGeneration with its processor); unset: the checkpoint's own first text encoder where "
        "it is that full model (Kandinsky 5, Kandinsky 6), with the checkpoint's tokenizer folder as processor")
    caption_prompt: str = setting(
        "Describe this video in one sentence: the subject, what happens, the setting and the camera.",
        run_key="when_set", min_length=1, description="caption_strategy auto: what the captioner is asked, shown the "
        "clip's frames")
    caption_max_new_tokens: int = setting(
        77, run_key="when_set", ge=1, description="caption_strategy auto: the longest caption, in tokens (greedy "
        "decoding)")
    caption_prefix: str = setting(
        "", run_key="when_set", description="caption_strategy auto: put before every generated caption (a trigger "
        "word: 'sks, '); user caption files are taken as written")
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
    # export formats, not part of the run: a finished run converts its file on reuse (training/checkpoints.py)
    lora_format: Literal["diffusers", "comfyui", "musubi"] | None = setting(
        None, run_key="never", description="unset: the diffusers file and, for every adapter kind ComfyUI applies as "
        "peft does (not DoRA; not LoKr/LoHa on HunyuanVideo 1.5), the ComfyUI file beside it, and for a plain LoRA "
        "of a family musubi-tuner loads (Kandinsky 5, HunyuanVideo 1.5) the musubi-tuner file; diffusers: the "
        "diffusers file only; comfyui / musubi: the diffusers file and that one, an error where it cannot be "
        "written (docs/lora-files.md)")
    # Tencent-Hunyuan/HunyuanVideo-1.5 train.py's `i2v_prob` (its default 0.3); unset keeps runs from before it
    i2v_prob: float | None = setting(
        None, run_key="when_set", ge=0, le=1, description="HunyuanVideo 1.5 and Kandinsky 6 i2v flavours: train "
        "each micro-batch as i2v with this probability, else as t2v (no image; the i2v cache serves both); unset: "
        "always i2v")
    # musubi-tuner's `--i2v_mode`; first keeps every key and result of runs from before it
    i2v_mode: Literal["first", "first_last"] = setting(
        "first", run_key="when_set", description="Kandinsky 5 i2v flavours: first_last also gives the clip's last "
        "frame clean (training: the last latent frame is input, not loss; validation renders to the clip's last "
        "frame); first: the first frame only")
    # issue 44; "original" is the default because the checkpoints were trained with it (docs/families.md); part of
    # every text key through the family's text signature, so the run's inputs change with it
    kandinsky5_prompt_template: Literal["original", "diffusers"] = setting(
        "original", run_key="when_set", description="Kandinsky 5 Video and t2i: the Qwen system prompt captions and "
        "validation prompts are encoded with; original: the original repository's (\"You are a promt engineer\", "
        "crop 129 / 41: what the checkpoints saw, and what ComfyUI encodes); diffusers: diffusers 0.42.1's "
        "(\"prompt\", crop 128 / 40). i2i always uses the original's")
    # issue 46: a flavour whose model generates sound (Kandinsky 6's audio VAE) trains it from each clip's own track
    train_audio: bool = setting(
        False, run_key="when_set", description="train the sound with the picture (a flavour with an audio VAE: "
        "Kandinsky 6): each clip's audio over its own time span, encoded by the checkpoint's audio VAE (the "
        "`audio_latents` stage), denoised with its picture at one noise level, the LoRA on both streams and the "
        "attentions between them; false: the picture alone, no audio read. Kandinsky 6's π-Flow distilled flavours "
        "always train it (default true there; false is refused: the original samples them with both streams only)")
    clips_without_audio: Literal["video_only", "leave_out"] = setting(
        "video_only", run_key="when_set", description="with `train_audio`: a clip without usable sound (no track, a "
        "track that starts late or ends early, a source rate that would put it out of sync, a track that does not "
        "decode: the audio_latents rows say which) trains its picture alone (video_only) or not at all (leave_out)")
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
        "train_batch_size samples per micro-step; > 1, or any CUDA run, trains in launched processes (torchrun's "
        "launcher, its rendezvous on loopback)")
    fsdp: bool = setting(
        False, run_key="when_set", description="FSDP2: shard the frozen transformer, the LoRA and AdamW's state over "
        "the num_processes ranks (`fully_shard` per block, then the root); needs num_processes > 1")

    # validation_*: what validation renders, never part of the run (a new prompt re-renders, never retrains)
    validation_prompt: str | None = setting(None, run_key="never")
    validation_audio_prompt: str | None = setting(
        None, run_key="never", description="what `validation_prompt`'s render sounds like, for a family whose prompt "
        "describes the sound (Kandinsky 6): composed into the release's prompt `validation_prompt "
        "<AUDCAP>validation_audio_prompt<ENDAUDCAP>`, as each clip's audio caption is (docs/families.md)")
    validation_resolution: str | None = setting(
        None, run_key="never", description="WIDTHxHEIGHT in pixels; default: the flavour's release "
        "size (docs/families.md), and where the pipeline sizes the render from its image (HunyuanVideo 1.5 i2v) "
        "the size it renders the image validation starts from at")
    validation_num_video_frames: int | None = setting(None, run_key="never", description="4k+1; default: the flavour's")
    validation_guidance: float | None = setting(None, run_key="never", description="default: the flavour's")
    validation_flow_shift: float | None = setting(
        None, run_key="never", gt=0, description="the sigma shift of validation renders; default: the checkpoint's "
        "scheduler config (scheduler/scheduler_config.json `shift`), else the flavour's")
    validation_num_inference_steps: int | None = setting(
        None, run_key="never", ge=1, description="default: the flavour's (docs/families.md: the "
        "release's, or 30 where loraflow kept its earlier default)")
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
        None, run_key="always", description="sigma shift for training; default: the flavour's training shift "
        "(docs/families.md: a guide's where it states one, e.g. 1.0 for Kandinsky 5 Image, which renders at 3.0)")
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
    blocks_to_swap: int = setting(
        0, run_key="never", ge=0, description="keep the last N of the transformer's blocks on the CPU, each moved to "
        "the GPU for its forward (and backward), the rest resident (musubi-tuner's name; diffusers' group offloading "
        "of those N blocks): the same numbers, less GPU memory than none, faster than `enable_group_offload` (every "
        "block). Renders (validation, progress renders) swap at least as many. `loraflow check` proposes the "
        "smallest N that fits `gpu_memory_gb`; 0: off")
    gpu_memory_gb: float | None = setting(
        None, run_key="never", gt=0, description="memory of the GPU this config must fit, in GB (counted as GiB): "
        "`loraflow check` names, for each stage that does not fit it, the switches that would; validation chooses its "
        "render's offload and VAE tiling to fit it; default: the CUDA GPU of the machine running, if any")
    attention_backend: Literal["auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
                               "flex"] = setting(
        "auto", run_key="never", description="the attention kernel of training and renders (diffusers' attention "
        "dispatcher): auto: flex for NABLA checkpoints, on CUDA the first of sdpa_cudnn, sdpa_flash, sdpa_efficient, "
        "sdpa_math that runs on the card, on the CPU sdpa (torch chooses); a kernel this machine lacks is refused "
        "before the first step, naming those it has. Kernels differ in rounding only (not in the run key)")
    gpu_peak_tflops: float | None = setting(
        None, run_key="never", gt=0, description="the GPU's dense bf16 peak in TFLOP/s, for the MFU in each step's "
        "log line and the lora asset; default: the card's by name (H100, H200, A100, L40S, RTX 3090/4090/5090), "
        "else only the FLOP rate is logged")
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
    fp32_modules_storage: Literal["fp32", "bf16", "fp8"] = setting(
        "fp32", run_key="when_set", description="how the modules diffusers keeps in fp32 are stored when "
        "base_model_precision is bf16, fp8 or int8 (Kandinsky 5's time embeddings and modulations: 2.38B parameters, "
        "8.9 GiB on Pro, 1 GiB on Lite; HunyuanVideo 1.5 has none): fp32, bf16 or fp8 (float8_e4m3fn), computing in "
        "fp32 either way (diffusers' layerwise casting). Default with such a base: bf16, which changes the tiny "
        "model's velocity no more than the bf16 base itself does (docs/families.md); fp8 doubles that change and "
        "saves as much again")
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
        "(training/options/optimizers.py)")
    # Adapter kind, start and EMA (SimpleTuner's names; training/options/adapters.py, training/options/ema.py). Off by
    # default, keys unchanged.
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
        None, run_key="never", description="start training from this LoRA file (diffusers/peft, ComfyUI or "
        "musubi-tuner key names, the same rank and targets); its content hash, not its path, is part of the run's "
        "inputs")
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

    @field_validator("init_lora")
    @classmethod
    def _init_lora(cls, v: str | None) -> str | None:
        if v is not None and not (v.endswith(".safetensors") and Path(v).is_file()):
            raise ValueError(f"`init_lora` {v!r} is not a .safetensors file: give the path of the LoRA file to start "
                             "from (diffusers/peft or ComfyUI key names), or remove init_lora")
        if v is not None:
            read_adapter_header(v, "init_lora")
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
        ids = [d.id for d in v]
        shared = sorted({i for i in ids if ids.count(i) > 1})  # an id is one Dagster partition, one cache part
        if shared:
            raise ValueError(f"id {shared[0]!r} names {ids.count(shared[0])} datasets: give each dataset its own `id`")
        return v


def read_prompt_library(path: str | Path) -> dict[str, str]:
    """SimpleTuner's user_prompt_library: a JSON object {shortname: prompt}."""
    path = Path(path)
    data = read_json_file(path, "user_prompt_library", "give a JSON file or an inline mapping")
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"`user_prompt_library` file {path} must hold one JSON object of shortname -> prompt strings")
    return data


def _unknown(key: str, value: str, allowed: list[str]) -> str:
    return f"`{key}` {value!r} is not known; allowed: {', '.join(allowed)}"
