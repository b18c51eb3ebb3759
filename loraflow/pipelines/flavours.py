"""What a family declares as plain data (no torch: the config model reads it at load): its flavours, and the
`FamilySpec` each registered family module holds as `SPEC` (`loraflow.pipelines.FAMILIES`).

fps, frames and size are what validation renders and clips are resampled to unless the config says
otherwise; flow_shift is the sigma shift renders use (the checkpoint's scheduler config wins where there is one),
training_shift the one training draws with (`flow_schedule_shift` unset); components are the
sub-folders a local checkpoint must hold for this flavour; conditioning_frames are the latent frames the model
is given clean (Kandinsky 5 i2v: the first), which training and eval loss leave out of the loss; repo is the
flavour's diffusers-format Hugging Face repository, the default `pretrained_model_name_or_path` (None: none is
published, the config must name a folder). Each family's spec module says where its repository ids come from.
guidance and steps are how validation and eval render unless the config says otherwise: a distilled checkpoint's
own step count, and guidance 1.0 (no classifier-free guidance: the pipelines skip the negative pass at 1.0) where
guidance was distilled into it. Every number carries its citation (`sources`, loraflow/pipelines/citations.py;
docs/families.md shows them), and `transformer_config` is the mode a flavour sets over its checkpoint's config
(Kandinsky 5 Pro's SD and HD attention, as musubi-tuner's `--task` configs set it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

Task = Literal["t2v", "i2v", "t2i", "i2i"]
# The components of a diffusers pipeline with two text encoders (Kandinsky 5, HunyuanVideo 1.5 and its guider)
TWO_ENCODER_PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
# Tokenizer classes that read the same files: transformers 5's, and transformers 4's fast one (what conversion
# scripts run under 4.x wrote into model_index.json).
QWEN_TOKENIZERS = ("transformers.Qwen2Tokenizer", "transformers.Qwen2TokenizerFast")
CLIP_TOKENIZERS = ("transformers.CLIPTokenizer", "transformers.CLIPTokenizerFast")
# Hugging Face repositories that are not in the diffusers layout, refused before any work with the flavour's repo
# named instead. tencent/HunyuanVideo-1.5 (the HunyuanVideo 1.5 guide's id, 338 GB) holds transformer/<res>_<task>/
# folders, vae/ and scheduler/ but no model_index.json, tokenizers or text/vision encoders (separate downloads):
# loading it would mean diffusers' conversion script (not part of the wheel) plus three other repositories.
NOT_DIFFUSERS = {"tencent/HunyuanVideo-1.5": "HunyuanVideo 1.5's original release, not in the diffusers layout "
                                             "(no model_index.json; text and vision encoders are separate downloads)"}


@dataclass(frozen=True)
class Flavour:
    name: str
    task: Task  # callers ask the properties below, which say what the task means for them
    fps: float
    num_frames: int  # validation default, 4k+1 (1 for images)
    size: tuple[int, int]  # validation default (height, width)
    flow_shift: float
    guidance: float
    components: tuple[str, ...]
    # Latent frames given clean, not generated: their x_t is x0 and they carry no loss
    # (`kernels.flow_matching.flow_mse`).
    # 0 for t2v, for K5 i2i (its source image is extra input channels, not a frame) and for HV1.5 i2v, whose
    # pipeline noises and steps frame 0 like every frame and gives the image only through its condition channels
    # (`hunyuanvideo15.HunyuanVideo15._condition`).
    conditioning_frames: int = 0
    repo: str | None = None  # the diffusers-format Hugging Face repository (module docstring)
    # Component folders the family's guide names by environment variable: (component, variable). loraflow reads each
    # as a diffusers component folder (config.json + safetensors, as the diffusers repository's text_encoder/).
    folder_variables: tuple[tuple[str, str], ...] = ()
    # Validation's sampling steps (`validation_num_inference_steps` left out): the release's for the distilled
    # flavours; 30, the config's old default, for the flavours that predate this field (their validation keys stay).
    steps: int = 30
    # Other trainers' names for this flavour (musubi-tuner's `--task`), which the importer translates.
    peer_names: tuple[str, ...] = ()
    # The last latent frame is given clean too (config `i2v_mode: first_last`, musubi-tuner's name): set on the
    # flavour by `get_family` from the config, never by a spec row (last: rows pass fields by position); only where
    # conditioning_frames > 0.
    last_frame_given: bool = False
    # The sigma shift training draws with when `flow_schedule_shift` is unset (`training.batches.step_draws`); left
    # out, the render shift. Two numbers: a guide's training default and a release's render shift differ.
    training_shift: float | None = None
    # Training's default shift is the checkpoint's scheduler config (its render shift), this flavour's recipe, with
    # `training_shift` the fallback before the checkpoint is on disk (`contracts.shifts.training_shift`)
    training_shift_from_checkpoint: bool = False
    # Caption tokens the first text encoder keeps after the template (the family's `max_text_tokens`)
    text_tokens: int = 512
    # Transformer config keys this flavour sets over its checkpoint's (a mode of the same weights: Kandinsky 5 Pro's
    # SD and HD attention): applied where the transformer loads, for training and renders, and where planning and
    # estimates read its config (`configured`)
    transformer_config: tuple[tuple[str, Any], ...] = ()
    # Why this flavour never trains or renders its picture without its sound ("": it may), for `train_audio: false`'s
    # refusal: Kandinsky 6's π-Flow distilled checkpoints, whose original sampler runs both streams or nothing
    sound_required: str = ""
    # A checkpoint's transformer config -> why this flavour cannot run it ("" it can), asked where its config.json
    # is read before anything loads (`sources.check_layout`, `loraflow check`): Kandinsky 6 i2v needs the I2VA token
    # types. None: any config of the right class runs.
    transformer_problem: Callable[[Mapping[str, Any]], str] | None = field(default=None, hash=False, compare=False)
    # (field, citation) for each number above: loraflow/pipelines/citations.py
    sources: tuple[tuple[str, str], ...] = ()
    # component -> the classes its model_index.json entry may name, "library.Class" (`sources.component_problems`):
    # that entry picks the Python class from_pretrained imports, so nothing but these is ever imported.
    classes: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.task not in get_args(Task):
            raise ValueError(f"flavour '{self.name}': task must be one of {', '.join(get_args(Task))}; "
                             f"got {self.task!r}")
        if self.training_shift is None:
            object.__setattr__(self, "training_shift", self.flow_shift)

    def source(self, field: str) -> str:
        """The citation of one of this flavour's numbers ("" when it has none)."""
        return dict(self.sources).get(field, "")

    def configured(self, transformer_config: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's transformer config as this flavour runs it: its mode's keys over the checkpoint's."""
        return {**transformer_config, **dict(self.transformer_config)}

    @property
    def takes_image(self) -> bool:
        """Renders start from an image: i2v from the video's first frame, i2i from the source image it edits."""
        return self.task in ("i2v", "i2i")

    @property
    def image_is_first_frame(self) -> bool:
        """i2v: the image is the first frame of the video (training: each clip's own first frame)."""
        return self.task == "i2v"

    @property
    def image_in_condition_only(self) -> bool:
        """i2v given its image only through condition inputs that a t2v call leaves zero (HunyuanVideo 1.5: no
        clean latent frame), so one run can train batches of both tasks (`i2v_prob`)."""
        return self.image_is_first_frame and not self.conditioning_frames

    @property
    def edits_image(self) -> bool:
        """i2i: each training image is an edit of a source image from another dataset (`conditioning_data`)."""
        return self.task == "i2i"

    @property
    def prompt_sees_image(self) -> bool:
        """Prompts are encoded together with the image (Kandinsky 5 i2i), so a text key names its image too."""
        return self.task == "i2i"


class ComponentFolders(Protocol):
    """What a spec's functions ask of a checkpoint (`sources.ModelSource` answers it): where a component's folder is."""

    def folder(self, component: str) -> Path:
        """The component's folder (its config.json and weights)."""


@dataclass(frozen=True)
class BucketBlocks:
    """Bucket sides in blocks of `factor` times the family's spatial multiple, and what asks it: `attention` and
    `blocks` name it for `loraflow check`'s note, `short` in a refusal of a validation size."""
    factor: int
    attention: str
    blocks: str
    short: str


@dataclass(frozen=True)
class FamilySpec:
    """A family's plain data, the `SPEC` at the top of its registered module; nothing here imports torch.

    `module` is where the adapter lives, imported only when a stage needs it: `make_family(flavour name or None) ->
    ModelFamily`; `tiny_module` where its tiny checkpoint's builder does: `tiny(flavour) -> (pipeline class, recipe
    name, build)`, for `loraflow.demo.tiny.build_tiny`. A family folder names its `family.py` and `tiny.py`; a family
    without heavy imports at its top may name its own module for both.
    """

    name: str  # the config's `model_family`
    description: str  # one line, shown in the config's help for `model_family`
    flavours: tuple[Flavour, ...]
    default_flavour: str
    spatial_multiple: int  # pixel sizes must be multiples of this (VAE factor x patch size)
    vae_temporal_factor: int  # frames per latent frame after the first (1: an image VAE)
    module: str
    tiny_module: str = ""  # "": `module` holds `tiny` too
    # SimpleTuner's `model_family` values that import as this family: its registered names and its model metadata
    # keys (simpletuner/helpers/models/model_metadata.json: kandinsky5_video), either case (registry.py `get`)
    simpletuner_names: tuple[str, ...] = ()
    # The class names of its transformer's feed-forward modules, as a LyCORIS `apply_preset` names them
    # (`target_module`); a preset naming one of them trains the feed-forward (lora_include_ffn)
    ffn_classes: tuple[str, ...] = ()
    # Flavours whose bucket sizes only the family module can judge (`ModelFamily.size_problem`: Kandinsky 5 Image
    # i2i asks its tokenizer); for every other flavour any bucket size trains.
    size_checked: tuple[str, ...] = ()
    # (flavour, model source, height, width) -> the (height, width) the family's pipeline renders at when asked for
    # that size, None while unknown (no checkpoint configs yet); unset: every size renders as asked.
    render_size: Callable[..., tuple[int, int] | None] | None = None
    # The prompt templates its text side offers (config `kandinsky5_prompt_template`), the default first; () none
    prompt_templates: tuple[str, ...] = ()
    # (caption, audio caption, speech lines) -> the text its text encoder gets, for a family whose release captions
    # the sound in the prompt (Kandinsky 6); None: the family reads no audio captions (`a.audio.txt`, `a.speech.txt`,
    # the `audio_caption` and `speech` metadata columns are not its: the clips stage lists them as not used)
    compose_prompt: Callable[[str, str, tuple[str, ...]], str] | None = None
    # (flavour, transformer config, (frames, height, width), caption tokens) -> `loraflow check`'s line on what the
    # family's attention leaves out of a training step; unset: every token attends
    attention_note: Callable[..., str] | None = None
    # (flavour, the transformer's config as the flavour runs it) -> the blocks bucket sides come in (Kandinsky 5's
    # NABLA checkpoints: kandinsky5/nabla_buckets.py), None where the spatial multiple is all; unset: never any
    bucket_rule: Callable[[Flavour, Mapping[str, Any]], BucketBlocks | None] | None = None

    def __post_init__(self) -> None:
        names = [f.name for f in self.flavours]
        if len(set(names)) != len(names) or self.default_flavour not in names:
            raise ValueError(f"family '{self.name}': flavour names must be distinct and include the default "
                             f"'{self.default_flavour}'; got {', '.join(names)}")

    def flavour_names(self) -> list[str]:
        return sorted(f.name for f in self.flavours)

    def bucket_blocks(self, flavour: Flavour, transformer_config: Mapping[str, Any]) -> BucketBlocks | None:
        """The blocks the bucket sides of `flavour` come in, for a checkpoint of this transformer config (its own,
        before the flavour's mode is set over it); None: multiples of `spatial_multiple` train."""
        return None if self.bucket_rule is None else self.bucket_rule(flavour, flavour.configured(transformer_config))

    def peer_flavour(self, name: str) -> str | None:
        """The flavour another trainer calls `name` (`Flavour.peer_names`), None when none does."""
        return next((f.name for f in self.flavours if name in f.peer_names), None)

    def flavour(self, name: str | None) -> Flavour:
        """The flavour called `name` (None: the family's default)."""
        wanted = name or self.default_flavour
        for flavour in self.flavours:
            if flavour.name == wanted:
                return flavour
        raise ValueError(f"unknown flavour {wanted!r} of {self.name}; expected one of {self.flavour_names()}")
