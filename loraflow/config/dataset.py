"""One dataset entry of the config (the seeds' multidatabackend.json) and its `video:` block.

Part of the one config model (`loraflow.config` imports and re-exports these): what a dataset folder holds and how
its files become clips. Cross-dataset rules (pairing, flavour fit, folders) are checked by `LoraflowConfig`.
Every config field is a `setting` that declares what it does to a training run's key (`config/run_key.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from loraflow.config.run_key import StrictModel, setting
from loraflow.keys import PART_STEM_LIMIT, part_file_stem

VAE_TEMPORAL_FACTOR = 4  # all three families' VAEs compress time 4x: video clips have 4k+1 frames
# Without `minimum_image_size`, a source whose edge is under resolution / 4 is dropped: a 16x upscale in pixels is
# blur, not training data (a 2x2 video filled a 256x256 bucket), while 480p videos at resolution 512 still pass.
DEFAULT_MAX_UPSCALE = 4


def check_4k_plus_1(name: str, frames: int | None) -> int | None:
    """Video frame counts must be 4k+1 for the 4x temporal VAE; suggest the two nearest legal values."""
    if frames is None:
        return frames
    if frames < 1:
        raise ValueError(f"`{name}` must be >= 1; got {frames}")
    if (frames - 1) % VAE_TEMPORAL_FACTOR:
        lower = (frames - 1) // VAE_TEMPORAL_FACTOR * VAE_TEMPORAL_FACTOR + 1
        raise ValueError(
            f"`{name} - 1` must be divisible by {VAE_TEMPORAL_FACTOR} (the VAE's temporal factor); "
            f"got {frames}. Use {lower} or {lower + VAE_TEMPORAL_FACTOR}."
        )
    return frames


def is_mask_dataset(dataset: DatasetConfig | None) -> bool:
    """A conditioning dataset of loss masks (`conditioning_type: mask`, contracts/masks.py), not of i2i source
    images."""
    return dataset is not None and dataset.conditioning_type == "mask"


class VideoSettings(StrictModel):
    """How frames are chosen from one video (the `video:` block of a dataset)."""

    num_frames: int = setting(17, run_key="always", description="frames per training clip; 4k+1")
    min_frames: int | None = setting(
        None, run_key="always", description="videos with fewer frames (after fps resampling) are skipped")
    max_frames: int | None = setting(
        None, run_key="always", description="videos with more frames are skipped; caps `full` clips")
    frame_rate: float | None = setting(
        None, run_key="always", description="resample to this fps; default: the flavour's fps")
    bucket_strategy: Literal["aspect_ratio", "resolution_frames"] = setting("aspect_ratio", run_key="always")
    frame_interval: int | None = setting(
        None, run_key="always", description="resolution_frames: round frame counts down to this step")
    frame_extraction: Literal["head", "chunk", "slide", "uniform", "full"] = setting("head", run_key="always")
    frame_stride: int = setting(1, run_key="always", ge=1, description="slide: start offset between clips, in frames")
    frame_sample: int = setting(1, run_key="always", ge=1, description="uniform: number of clips spread over the video")
    # Long recordings (docs/footage.md). Unset, they leave every run its key.
    scene_cuts: Literal["detect", "off"] = setting(
        "off", run_key="when_set", description="detect: find hard cuts (PySceneDetect's content detector) and choose "
        "clips inside scenes only, each scene as if it were a video of its own (frame_extraction, min_frames and "
        "max_frames apply per scene); off: the whole file is one scene")
    scene_threshold: float = setting(
        27.0, run_key="when_set", gt=0, description="scene_cuts detect: the frame-to-frame change (mean HSV "
        "difference, 0-255) that counts as a cut; PySceneDetect's `threshold`: lower finds more cuts")
    min_scene_len: float = setting(
        0.6, run_key="when_set", ge=0, description="scene_cuts detect: seconds a scene lasts at least; cuts closer "
        "together are merged (a camera flash is no scene); PySceneDetect's `min_scene_len`")

    @field_validator("num_frames")
    @classmethod
    def _num_frames(cls, v: int) -> int:
        return check_4k_plus_1("num_frames", v)

    @model_validator(mode="after")
    def _bounds(self) -> VideoSettings:
        if self.max_frames is not None and self.max_frames < self.num_frames:
            raise ValueError(f"`max_frames` ({self.max_frames}) is below `num_frames` ({self.num_frames})")
        return self


class DatasetConfig(StrictModel):
    """One entry of the dataset list (the seeds' multidatabackend.json)."""

    id: str = setting(run_key="always", description="names the dataset everywhere, and its Dagster partition")
    type: Literal["local"] = setting("local", run_key="always")
    dataset_type: Literal["video", "image", "conditioning", "text_embeds"] = setting(
        "video", run_key="always", description="conditioning: i2i source images, named by another dataset's "
        "`conditioning_data`; never trained on by themselves")
    # conditioning_data, minimum_image_size and the aspect limits came after runs existed: unset, they leave those
    # runs their keys
    conditioning_data: str | None = setting(
        None, run_key="when_set", description="i2i: id of the `dataset_type: conditioning` dataset holding each "
        "image's source image, paired by path relative to the folder (any image extension); any flavour: of the "
        "`conditioning_type: mask` dataset holding each file's loss mask, paired the same way")
    conditioning_type: Literal["mask"] | None = setting(
        None, run_key="when_set", description="conditioning datasets: mask = loss masks (images: white trains, black "
        "is ignored), paired by `conditioning_data` with any flavour's files (contracts/masks.py); unset: i2i source "
        "images")
    instance_data_dir: str | None = setting(None, run_key="always")
    caption_strategy: Literal["textfile", "filename", "instanceprompt", "metadata", "auto"] = setting(
        "textfile", run_key="always", description="auto: NAME.txt beside the file where there is one (a user's caption "
        "always wins), else each clip is captioned from its frames by a Qwen2.5-VL (the `captions` asset; "
        "caption_model_path, caption_prompt)")
    instance_prompt: str | None = setting(None, run_key="always")
    metadata_file: str | None = setting(
        None, run_key="always", description="caption_strategy metadata: .jsonl/.csv/.parquet of file -> caption(s); a "
        "relative path is inside instance_data_dir")
    # Hostile and careless input (docs/reliability.md); unset, they leave every run its key.
    allow_links_outside: bool = setting(
        False, run_key="when_set", description="read files (media, captions, masks, a relative metadata_file) that "
        "are links to places outside instance_data_dir; false: such a file is quarantined as link_outside, unread")
    max_captions_per_file: int = setting(
        100, run_key="when_set", ge=1, description="a file with more captions (non-empty lines of its .txt, rows of "
        "the metadata file) is quarantined as too_many_captions")
    max_caption_chars: int = setting(
        10_000, run_key="when_set", ge=1, description="a file with a longer caption is quarantined as "
        "caption_too_long (text encoders read a caption's first few hundred tokens)")
    resolution: int = setting(
        512, run_key="always", gt=0, description="pixel: the shorter side; area: the side of a square of equal area")
    resolution_type: Literal["pixel", "area", "pixel_area"] = setting(
        "pixel", run_key="always", description="pixel: shorter side = resolution; area (alias pixel_area): "
        "resolution**2 pixels")
    minimum_image_size: int | None = setting(
        None, run_key="when_set", ge=0, description="sources whose edge is smaller are dropped (source_too_small), in "
        "`resolution`'s unit: pixel: the shorter side; area/pixel_area: the side of a square of equal area (pixels, "
        "not SimpleTuner's megapixels); unset: resolution / 4; 0: keep every size")
    # SimpleTuner's names and measure: the source's own width / height (as shown: rotation and pixel aspect applied),
    # before any crop; after crop_aspect square every ratio would be 1. Unset (the default): no limit, keys unchanged.
    minimum_aspect_ratio: float | None = setting(
        None, run_key="when_set", gt=0, description="sources narrower than this width/height are dropped "
        "(aspect_too_tall), e.g. 0.5 drops what is more than twice as tall as wide")
    maximum_aspect_ratio: float | None = setting(
        None, run_key="when_set", gt=0, description="sources wider than this width/height are dropped "
        "(aspect_too_wide), e.g. 3 drops a 16:1 banner")
    crop_aspect: Literal["preserve", "square", "closest"] = setting(
        "preserve", run_key="always", description="bucket aspect: the source's, 1:1, or the closest of "
        "`crop_aspect_buckets`")
    crop_aspect_buckets: tuple[float, ...] = setting(
        (), run_key="always", description="crop_aspect closest: width/height ratios")
    video: VideoSettings = setting(VideoSettings(), run_key="always")
    audio_stream: int | None = setting(
        None, run_key="when_set", ge=0, description="train_audio: which audio track of each video the audio_latents "
        "stage reads, counted among the file's audio tracks from 0 (ffmpeg's -map 0:a:N); unset: the one FFmpeg picks "
        "(its default-disposition track, else its best), as ffmpeg and players do; a file without that track gets a "
        "no_audio row")
    crop_style: Literal["center", "random", "none"] = setting("center", run_key="always")
    repeats: int = setting(1, run_key="always", ge=1, description="how many times each clip is seen per epoch")
    # unused, yet part of every run key since the first runs: declaring it neutral now would move them all
    cache_dir: str | None = setting(
        None, run_key="always", description="accepted for multidatabackend.json compatibility and not used: every "
        "cache lives under the top-level cache_dir, keyed by content")
    default: bool = setting(False, run_key="always")
    disabled: bool = setting(False, run_key="always")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        # the id is a Dagster partition key and a file name: Dagster refuses "..." and control characters
        if not v.strip() or "..." in v or any(ord(c) < 32 for c in v):
            raise ValueError(f"id {v!r} must be non-empty, without '...' or control characters (it names the "
                             "dataset's Dagster partition)")
        stem = part_file_stem(v)
        if len(stem) > PART_STEM_LIMIT:
            raise ValueError(f"id {v[:40]!r}... is {len(stem)} characters as a file name (it names the dataset's "
                             f"cached manifest); at most {PART_STEM_LIMIT} fit: shorten it (a character outside "
                             "ASCII letters, digits and _.-~ takes 3 to 12)")
        return v

    @model_validator(mode="after")
    def _needs(self) -> DatasetConfig:
        if self.conditioning_type is not None and self.dataset_type != "conditioning":
            raise ValueError(f"dataset '{self.id}': `conditioning_type` goes on a `dataset_type: conditioning` "
                             f"dataset, not on a {self.dataset_type} dataset")
        if self.dataset_type != "text_embeds" and not self.instance_data_dir:
            raise ValueError(f"dataset '{self.id}' needs `instance_data_dir` (a folder of videos/images)")
        if self.caption_strategy == "instanceprompt" and not self.instance_prompt:
            raise ValueError(f"dataset '{self.id}' uses caption_strategy instanceprompt but has no `instance_prompt`")
        if (self.caption_strategy == "metadata") != bool(self.metadata_file):
            raise ValueError(f"dataset '{self.id}': `metadata_file` goes with caption_strategy metadata "
                             "(both or neither)")
        if self.crop_aspect == "closest" and not self.crop_aspect_buckets:
            raise ValueError(f"dataset '{self.id}': crop_aspect closest needs `crop_aspect_buckets` "
                             "(width/height ratios)")
        if self.crop_aspect_buckets and self.crop_aspect != "closest":
            raise ValueError(f"dataset '{self.id}': `crop_aspect_buckets` is only used with crop_aspect closest")
        if any(a <= 0 for a in self.crop_aspect_buckets):
            raise ValueError(f"dataset '{self.id}': `crop_aspect_buckets` must be positive width/height ratios")
        low, high = self.minimum_aspect_ratio, self.maximum_aspect_ratio
        if low is not None and high is not None and low > high:
            raise ValueError(f"dataset '{self.id}': `minimum_aspect_ratio` {low} is above `maximum_aspect_ratio` "
                             f"{high}: every source would be dropped")
        if self.resolution_type != "pixel" and self.resolution < 16:  # 1.0 would be megapixels, SimpleTuner-style
            raise ValueError(f"dataset '{self.id}': `resolution` {self.resolution} with resolution_type "
                             f"{self.resolution_type} is the side in pixels of a square of the target area (e.g. "
                             "512 for 0.26 MP), not megapixels")
        if self.resolution_type != "pixel" and self.minimum_image_size and self.minimum_image_size < 16:
            raise ValueError(f"dataset '{self.id}': `minimum_image_size` {self.minimum_image_size} with "
                             f"resolution_type {self.resolution_type} is the side in pixels of a square of the "
                             "smallest area kept, like `resolution`, not megapixels")
        return self

    def minimum_source_edge(self) -> float:
        """The smallest source edge kept (`buckets.source_edge`'s measure): `minimum_image_size` or the default."""
        if self.minimum_image_size is not None:
            return self.minimum_image_size
        return self.resolution / DEFAULT_MAX_UPSCALE
