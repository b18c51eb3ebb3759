"""The one config model: the seed guides' names, validated once at load, every problem named at once.

A config is YAML or JSON. Its keys are declared in `fields.py` (`ConfigFields`); `LoraflowConfig` adds the checks
across keys (flavour and task fit, the peers' exclusive options, validation sizes, adapters, folders) and what the
stages read from a config. Dataset entries (`config/dataset.py`) have the shape of SimpleTuner's
`multidatabackend.json`; they go inline under `datasets:` or in a separate file named by `dataset_backend_config`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from loraflow.config.config_files import not_a_file, read_json_file, read_yaml_file
from loraflow.config.dataset import DatasetConfig, is_mask_dataset
from loraflow.config.errors import ConfigError, describe
from loraflow.config.fields import ConfigFields
from loraflow.config.validation_adapters import ValidationAdapter, check_adapters
from loraflow.keys import ManifestNames, content_key
from loraflow.pipelines import family_flavour, family_spec, known_flavour
from loraflow.pipelines.flavours import NOT_DIFFUSERS, Flavour

DEFAULT_PROMPT_NAME = "validation"  # the shortname of `validation_prompt` among the validation prompts
FIRST_LAST_MIN_FRAMES = 9  # 3 latent frames: `i2v_mode: first_last` gives 2 clean, so one carries the loss

# What each caching stage's list of a dataset is made from besides the dataset itself (its files and its entry's
# settings, `dataset_sources`): the config keys that change the stage's items, and the stages whose items it takes.
# The store names each stage's manifest of a dataset by a digest of all of it (`manifest_names`), so two configs
# sharing one cache_dir never read each other's lists, and a config that changes one stage's keys (`latent_sampling`)
# re-lists that stage and those made from it, never its clips. The memory features that leave every value as it is
# (`vae_enable_slicing`, `vae_enable_patch_conv`, `offload_during_startup`) are in none: turning one on after an OOM
# keeps the cache. tests/config/test_manifest_names.py holds each stage's reads of the config to its keys.
MODEL_KEYS = ("model_family", "model_flavour", "pretrained_model_name_or_path", "revision")
STAGE_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # stage -> (config keys, stages it takes)
    "clips": ((*MODEL_KEYS, "vae_path"), ()),  # frame counts and buckets follow the VAE's compression
    "captions": (("caption_model_path", "caption_prompt", "caption_max_new_tokens", "caption_prefix",
                  "text_encoder_path"), ("clips",)),  # without caption_model_path, the text encoder captions
    # i2v_mode: which frames are given (the key's last_frame_given); the image encoder: HunyuanVideo 1.5 i2v's tokens
    "latents": ((*MODEL_KEYS, "vae_path", "vae_enable_tiling", "latent_sampling", "i2v_mode", "vision_encoder_path"),
                ("clips",)),
    "audio_latents": (MODEL_KEYS, ("clips",)),  # the sound of each clip, whatever training then does with it
    "teacher_features": (("crepa_encoder", "crepa_encoder_path", "crepa_encoder_image_size"),
                         ("clips", "latents")),  # the clips that have latents
    "text_embeds": ((*MODEL_KEYS, "text_encoder_path", "vision_encoder_path", "kandinsky5_prompt_template",
                     "text_encoder_1_precision", "validation_prompt", "validation_audio_prompt", "user_prompt_library",
                     "validation_negative_prompt"), ("clips", "captions")),
}
# The text set's keys too where prompts see an image (i2i): what picks the image its validation prompts see
# (contracts.renders: the clip and its size)
PROMPT_IMAGE_KEYS = ("validation_resolution", "validation_using_datasets", "eval_dataset_id", "eval_holdout_fraction",
                     "seed")
WRITTEN_BESIDE = {"quarantine": "clips", "latents_quarantine": "latents"}  # a list a stage writes beside its own
MODEL_FOLDER_KEYS = ("pretrained_model_name_or_path", "vae_path", "text_encoder_path", "vision_encoder_path",
                     "caption_model_path", "crepa_encoder_path")  # one folder written two ways is one


class LoraflowConfig(ConfigFields):
    """A whole run: model, data, training and validation. Units are in each field's description."""

    # The keys are ConfigFields' (fields.py); here, the checks across keys and what the stages read from a config.
    @model_validator(mode="before")
    @classmethod
    def _kept_storage(cls, data: Any) -> Any:
        """`fp32_modules_storage` left out under a bf16/fp8/int8 base is bf16 (its field's default, fp32, is what an
        fp32 base keeps anyway): so a run key changes with what the run computes (keys say the fields that differ
        from their defaults), and one that asks fp32 keeps the key it had before the option."""
        if isinstance(data, dict) and "fp32_modules_storage" not in data and \
                data.get("base_model_precision", "no_change") != "no_change":
            return {**data, "fp32_modules_storage": "bf16"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _sound_of_distilled(cls, data: Any) -> Any:
        """`train_audio` left out is true for a flavour that never runs its picture without its sound
        (`Flavour.sound_required`: Kandinsky 6's π-Flow checkpoints); an explicit false is refused below."""
        if isinstance(data, dict) and "train_audio" not in data:
            flavour = known_flavour(data.get("model_family"), data.get("model_flavour"))
            if flavour is not None and flavour.sound_required:
                return {**data, "train_audio": True}
        return data

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

    @model_validator(mode="after")
    def _validation_and_eval(self) -> LoraflowConfig:
        if self.user_prompt_library and DEFAULT_PROMPT_NAME in self.user_prompt_library and self.validation_prompt:
            raise ValueError(f"`user_prompt_library` may not use the shortname '{DEFAULT_PROMPT_NAME}': "
                             "it names `validation_prompt`; rename the library entry")
        if self.validation_audio_prompt is not None and family_spec(self.model_family).compose_prompt is None:
            raise ValueError(f"`validation_audio_prompt`: {self.model_family}'s prompts do not describe the sound; "
                             "remove it")
        if self.validation_audio_prompt is not None and not self.validation_prompt:
            raise ValueError("`validation_audio_prompt` describes the sound of `validation_prompt`'s render: set "
                             "`validation_prompt` too")
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
        check_adapters(self.validation_adapters_key, self.validation_adapters)
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
                # the loss covers the frames after the clean first frame (`kernels.flow_matching.flow_mse`):
                # one frame would be NaN
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
        if self.kandinsky5_prompt_template != "original" and (
                self.kandinsky5_prompt_template not in family_spec(self.model_family).prompt_templates
                or flavour.prompt_sees_image):
            raise ValueError(f"`kandinsky5_prompt_template: {self.kandinsky5_prompt_template}`: flavour "
                             f"'{flavour.name}' encodes with its own template only (the Kandinsky 5 Video and t2i "
                             "flavours offer the diffusers one): remove it")
        if flavour.sound_required and not self.train_audio:
            raise ValueError(f"`train_audio: false`: flavour '{flavour.name}' {flavour.sound_required}")
        if self.train_audio and "audio_vae" not in flavour.components:
            raise ValueError(f"`train_audio`: flavour '{flavour.name}' has no audio VAE and generates no sound (a "
                             "Kandinsky 6 flavour does): remove it")
        if self.train_audio and self.scheduled_sampling_max_step_offset:
            raise ValueError("`scheduled_sampling_max_step_offset` with `train_audio`: the rollout steps the picture "
                             "alone, not its sound beside it (not built): set scheduled_sampling_max_step_offset: 0, "
                             "or train_audio: false")
        if self.train_audio and self.fsdp and self.clips_without_audio == "video_only":
            raise ValueError("`fsdp` with `train_audio` and `clips_without_audio: video_only`: a step where one "
                             "process's clip has sound and another's has none runs the audio stream on one process "
                             "only, and FSDP's gradient reduce-scatter waits for the other (gloo aborts on the "
                             "mismatch): set clips_without_audio: leave_out (every batch then has sound), or fsdp: "
                             "false (the processes then average every gradient, zeros where a stream did not run)")
        if self.clips_without_audio != "video_only" and not self.train_audio:
            raise ValueError("`clips_without_audio` says what training does with clips without sound when "
                             "`train_audio` is true: set train_audio: true, or remove it")
        if self.i2v_prob is not None and not flavour.image_in_condition_only:
            raise ValueError(f"`i2v_prob`: flavour '{flavour.name}' cannot train batches as t2v (only the "
                             "HunyuanVideo 1.5 and Kandinsky 6 i2v flavours, whose image no generated frame holds): "
                             "remove it")
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
        feed rendered videos back as training data and make every run look like a dataset change. Nor is a system
        folder (`/`, `/etc`, a home folder itself) a place for a run's files."""
        written = {"output_dir": self.output_dir}
        if "://" not in self.cache_dir:  # an object store is no dataset folder
            written["cache_dir"] = self.cache_dir
        for key, folder in written.items():
            if system := system_folder(folder):
                raise ValueError(f"`{key}` {folder} is {system}: loraflow writes runs and caches there; give `{key}` "
                                 f"a folder of its own (the default is ./{type(self).model_fields[key].default})")
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
        if self.blocks_to_swap and self.enable_group_offload:
            raise ValueError(f"`blocks_to_swap` {self.blocks_to_swap} streams the last blocks, `enable_group_offload` "
                             "every block: set one (blocks_to_swap: 0, or enable_group_offload: false)")
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
        for key in ("enable_group_offload", "blocks_to_swap", "crepa_enabled", "validation_steps", "use_ema",
                    "lycoris_config", "validation_on_startup"):
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
        compose = family_spec(self.model_family).compose_prompt
        if prompts and self.validation_audio_prompt and compose is not None:  # validated: only such a family
            prompts[DEFAULT_PROMPT_NAME] = compose(self.validation_prompt or "", self.validation_audio_prompt, ())
        return {**prompts, **(self.user_prompt_library or {})}

    @property
    def validation_adapters(self) -> tuple[ValidationAdapter, ...]:
        """The adapters validation renders beside the trained one: the single one's keys, or the list."""
        if self.validation_adapter_path is None:
            return self.validation_adapter_config or ()
        return (ValidationAdapter(path=self.validation_adapter_path, label=self.validation_adapter_name,
                                  strength=self.validation_adapter_strength),)

    @property
    def validation_adapters_key(self) -> str:
        """The key that gives `validation_adapters`, for messages."""
        return "validation_adapter_path" if self.validation_adapter_path else "validation_adapter_config"

    @property
    def training_datasets(self) -> tuple[DatasetConfig, ...]:
        return tuple(d for d in self.datasets if d.dataset_type in ("video", "image") and not d.disabled)

    @property
    def dataset_folders(self) -> dict[str, str]:
        """Each training dataset's id -> its folder (`instance_data_dir`; a Hugging Face dataset's: `as_folder`)."""
        return {d.id: self.folder_dataset(d).instance_data_dir or "" for d in self.training_datasets}

    @property
    def dataset_sources(self) -> dict[str, str]:
        """Each training dataset's id -> a fingerprint of its files and what its entry asks of them: its folder
        resolved (links followed), a Hugging Face dataset's name, split and revision, its i2i source images' or
        masks' folder, and those entries' settings (frames, buckets, captions), and whether validation renders from
        it. What `manifest_names` starts from."""
        def where(dataset: DatasetConfig) -> dict[str, Any]:
            folder = dataset.instance_data_dir  # a Hub dataset's default folder is under the shared cache_dir
            hub = [dataset.dataset_name, dataset.split, dataset.revision] if dataset.type != "local" else None
            return {"folder": os.path.realpath(folder) if folder and "://" not in folder else folder, "hub": hub,
                    "settings": dataset.model_dump(mode="json", exclude={"id", "instance_data_dir"})}

        fingerprints = {}
        for dataset in self.training_datasets:
            paired = self.source_images(dataset)
            fingerprints[dataset.id] = content_key(source=where(dataset), paired=where(paired) if paired else None,
                                                   renders_from=dataset.id == self.render_dataset_id)[:16]
        return fingerprints

    @property
    def manifest_names(self) -> ManifestNames:
        """The names of this config's manifests in the store: per caching stage, each dataset id -> a digest of its
        `dataset_sources` fingerprint, the stage's config keys and the names of the stages it takes (STAGE_INPUTS).
        What every store of a config is opened with (`Store(cache_dir, config.manifest_names)`)."""
        from loraflow.pipelines.sources import FOLDER_KEYS

        from_environment = dict(self.flavour.folder_variables)  # component -> the guide's variable (HunyuanVideo 1.5)

        def setting(key: str) -> Any:
            value = getattr(self, key)
            if value is None and from_environment.get(FOLDER_KEYS.get(key, "")):  # as `component_folders` takes it
                value = os.environ.get(from_environment[FOLDER_KEYS[key]])
            if key in MODEL_FOLDER_KEYS and value and "://" not in value and os.path.exists(value):
                return os.path.realpath(value)
            return value

        named: dict[str, dict[str, str]] = {}
        for stage, (keys, inputs) in STAGE_INPUTS.items():  # each stage after those it takes
            if stage == "text_embeds" and self.flavour.prompt_sees_image:
                keys = (*keys, *PROMPT_IMAGE_KEYS)
            settings = {key: setting(key) for key in keys}
            named[stage] = {}
            for dataset, source in self.dataset_sources.items():
                made_from = [named[i][dataset] for i in inputs] if inputs else source
                named[stage][dataset] = content_key(settings=settings, made_from=made_from)[:16]
        return ManifestNames(named, aliases=WRITTEN_BESIDE)

    def folder_dataset(self, dataset: DatasetConfig) -> DatasetConfig:
        """`dataset` as the clips stage reads it (`DatasetConfig.as_folder`)."""
        return dataset.as_folder(self.cache_dir)

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


# System folders: what is inside them is the system's, and the rest are folders of folders (a home folder itself).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys",
                "/usr", "/System", "/Library", "/private/etc")
SYSTEM_FOLDERS = ("/", "/home", "/root", "/var", "/var/lib", "/tmp", "/opt", "/srv", "/mnt", "/media", "/run",
                  "/Users", "/Volumes", "/private", "/private/var")


def system_folder(folder: str) -> str | None:
    """What makes `folder` (links resolved) a system folder, or None: it is one, or it lies in one."""
    path, home = Path(folder).resolve(), os.path.expanduser("~")  # "~" where no home is known (a container's uid)
    if str(path) in SYSTEM_FOLDERS or (home != "~" and path == Path(home).resolve()):
        return "a system folder"
    tree = next((t for t in SYSTEM_TREES if path == Path(t) or Path(t) in path.parents), None)
    return f"in the system folder {tree}" if tree else None


def _nested(a: str | None, b: str | None) -> bool:
    """One folder is the other or inside it (a dataset folder is read recursively)."""
    first, second = Path(a or "").resolve(), Path(b or "").resolve()
    return first == second or first in second.parents or second in first.parents


def parse_config(data: dict[str, Any], source: str = "config", base_dir: Path | None = None) -> LoraflowConfig:
    """Validate a config dict; raise ConfigError listing every problem with its key path."""
    data = dict(data)
    backend = data.get("dataset_backend_config")
    if backend and "datasets" not in data:
        path = Path(backend) if base_dir is None or Path(backend).is_absolute() else base_dir / backend
        try:
            data["datasets"] = read_json_file(path, "dataset_backend_config", "give the dataset list's JSON file "
                                              "(multidatabackend.json), or the list itself under `datasets`")
        except ValueError as exc:
            raise ConfigError([str(exc)], source) from None
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
    if problem := not_a_file(path):
        raise ConfigError([f"config file {path} {problem}: give the config's YAML or JSON file"], str(path))
    try:
        data = read_yaml_file(path) or {}
    except ValueError as exc:
        raise ConfigError([str(exc)], str(path)) from None
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
