"""What the stage ops return: one frozen report per stage on a shared base, enough for the asset's metadata.

Table rows are small frozen dataclasses whose field names are the columns the asset shows. Paths are str: they
go into JSON (results, the launched trainer's summary) and Dagster metadata as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module stays free of torch and of the stages
    from loraflow.contracts.clip_rows import DroppedFile  # the quarantine row: a report row too
    from loraflow.pipelines.base import RenderSettings


@dataclass(frozen=True, kw_only=True)
class StageReport:
    data_version: str
    computed: int  # items (or runs) this call made
    reused: int  # items found in the store
    quarantined: tuple[object, ...] = ()  # items left out, with the reason; each stage names its row type


# -- clips ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DropReason:
    """Files dropped for one reason in one dataset, with one example."""

    dataset: str
    reason: str
    files: int
    example: str


@dataclass
class BucketRow:
    """Clips of one bucket in one dataset, and what they cost in the store."""

    dataset: str
    bucket: str
    clips: int = 0
    frames_bytes: int = 0  # uint8 RGB frames the clips stage stores
    latent_bytes: int | None = 0  # None when the VAE config is not readable


@dataclass(frozen=True)
class SceneRow:
    """The scenes of one file with scene cuts on (`video.scene_cuts: detect`): found, and used (yielding a clip)."""

    dataset: str
    file: str  # the dataset-relative path
    scenes: int
    used: int
    cuts: tuple[int, ...]  # the first frame of each scene after the first
    path: str  # where the file is on this machine (the cut strip decodes its frames around each cut)


@dataclass(frozen=True, kw_only=True)
class ClipsReport(StageReport):
    quarantined: tuple[DroppedFile, ...] = ()
    buckets: tuple[BucketRow, ...]
    dropped: tuple[DropReason, ...]
    scenes: tuple[SceneRow, ...] = ()  # scene cuts on: per file

    @property
    def clips(self) -> int:
        return sum(r.clips for r in self.buckets)

    @property
    def est_latent_bytes(self) -> int | None:
        """What the latents stage will write (an estimate); None when the VAE config is not readable."""
        sizes = [r.latent_bytes for r in self.buckets]
        return None if None in sizes else sum(sizes)


@dataclass(frozen=True, kw_only=True)
class CaptionsReport(StageReport):
    captioner: str  # the model's folder or Hub id ("": nothing to caption)
    prompt: str


# -- latents --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadLatent:
    """A clip whose latent was not stored: a row of the store's `latents_quarantine` manifest."""

    key: str
    clip_key: str
    dataset: str
    reason: str
    detail: str = ""  # the clip, what was not finite, and the precision to try


@dataclass(frozen=True)
class OomFallback:
    """A clip encoded again with a memory-saving fallback after running out of memory."""

    clip_key: str
    fallback: str
    key: str


@dataclass(frozen=True, kw_only=True)
class LatentsReport(StageReport):
    quarantined: tuple[BadLatent, ...] = ()
    oom_fallbacks: tuple[OomFallback, ...]
    device: str
    peak_gib: float


# -- audio_latents --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoAudio:
    """A clip without an audio latent, and why (contracts/audio_rows.py REASONS)."""

    dataset: str
    source: str
    clip_key: str
    reason: str
    detail: str


@dataclass(frozen=True, kw_only=True)
class AudioLatentsReport(StageReport):
    quarantined: tuple[NoAudio, ...] = ()  # the clips without sound: they train video-only or not (the config says)
    clipped: tuple[NoAudio, ...] = ()  # clips with a latent whose sound was over full scale and clipped (`detail`)
    device: str


# -- text_embeds ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBin:
    tokens: str  # the bin's range of stored tokens, "0-16" or ">512"
    texts: int


@dataclass(frozen=True)
class TruncatedText:
    text: str  # its first 80 characters
    tokens_kept: int
    limit: int
    files: str  # the source files whose captions use it, or "(validation prompt)"


@dataclass(frozen=True, kw_only=True)
class TextEmbedsReport(StageReport):
    tokens_histogram: tuple[TokenBin, ...]
    truncated: tuple[TruncatedText, ...]
    distinct_texts: int
    device: str
    text_encoder_1_precision: str
    bytes_on_disk: int
    seconds: float
    texts_per_s: float

    @property
    def truncated_texts(self) -> int:
        return len(self.truncated)


# -- lora -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainStep:
    """One row of the run's history.json."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    ms: float
    samples_per_s: float | None = None  # None in histories written before it was logged
    peak_gib: float | None = None  # CUDA only
    crepa_loss: float | None = None  # CREPA's weighted term (crepa_enabled), apart from `loss`, the flow loss
    audio_loss: float | None = None  # train_audio: the audio term within `loss` (training/step.py `FlowTerms`)
    tflops: float | None = None  # model TFLOP/s (training/flops.py: counted, checkpoint recompute left out)
    mfu: float | None = None  # tflops over the card's peak (gpu_peak_tflops); None: the CPU or an unknown card
    recompute_tflop: float | None = None  # gradient checkpointing's recomputed forward, TFLOP per step; None: none

    def json_row(self) -> dict[str, float]:
        """Its history.json row, also what the `report_to` sink logs: the numbers measured (a CPU run has no
        peak_gib, a run without CREPA no crepa_loss, one without sound no audio_loss), so files keep the keys they
        always had."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class LoraReport(StageReport):
    history: tuple[TrainStep, ...]
    lora_path: str
    run_dir: str
    inputs: dict[str, str]  # upstream stage -> the data version trained on
    resumed_at_step: int
    samples_per_s: float  # median over the steps
    peak_gib: float
    comfyui_lora_path: str | None = None  # where the ComfyUI file was written
    musubi_lora_path: str | None = None  # where the musubi-tuner file was written
    attention_backend: str | None = None  # the kernel the run's attention ran (kernels/attention_backend.py)
    tflops: float | None = None  # median model TFLOP/s over the steps
    mfu: float | None = None  # median MFU over the steps (None: peak unknown)

    @property
    def final_loss(self) -> float | None:
        return self.history[-1].loss if self.history else None

    def summary(self) -> dict[str, Any]:
        """The report as JSON values, as a launched trainer hands it to Dagster: the history stays in the run
        folder's history.json, the data version goes beside, comfyui_ / musubi_lora_path only where exported."""
        left_out = {"data_version", "quarantined", "history"}
        left_out |= {name for name in ("comfyui_lora_path", "musubi_lora_path", "attention_backend", "tflops", "mfu")
                     if getattr(self, name) is None}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}
        return values | {"final_loss": self.final_loss}


# -- validation -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)  # keywords only: the fields keep result.json's key order
class PromptRenders:
    """One validation prompt's base and LoRA renders (its result.json)."""

    name: str
    prompt: str
    base: str
    lora: str
    contact_sheet: str
    animation: str | None = None  # preview.webp, base beside LoRA; None for an image family's stills
    mean_abs_pixel_change: float
    adapters: dict[str, str] | None = None  # other adapters' renders by name (`validation_adapter_*`)
    flat: list[str] | None = None  # the renders all of one value (all black: NaN in the model, LoRA or an adapter)

    def json_row(self) -> dict[str, Any]:
        """Its result.json: `adapters` and `flat` only where there are any, as the files always had it."""
        return {key: value for key, value in asdict(self).items() if value is not None or key not in OPTIONAL}


OPTIONAL = ("adapters", "flat")  # PromptRenders' fields a result.json holds only where they are set


@dataclass(frozen=True)
class EvalLoss:
    """Mean held-out loss at one sigma, base and LoRA."""

    sigma: float
    timestep: int
    base: float
    lora: float


@dataclass(frozen=True, kw_only=True)
class ValidationReport(StageReport):
    settings: RenderSettings
    fps: float
    prompts: tuple[PromptRenders, ...]
    eval_loss: tuple[EvalLoss, ...]
    eval_clips: int
    mean_abs_pixel_change: float | None = None  # over the prompts; None without prompts
    eval_loss_base: float | None = None  # means over the sigmas; None without eval clips
    eval_loss_lora: float | None = None
    eval_loss_change: float | None = None  # (lora - base) / base: negative when the LoRA fits held-out clips better
    eval_plot: str | None = None
    condition_image: str | None = None  # i2v's first frame, i2i's source image


# -- teacher_features (CREPA) ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TeacherFeaturesReport(StageReport):
    teacher: str  # the teacher checkpoint's folder
    image_size: int  # the side the teacher sees each frame at
