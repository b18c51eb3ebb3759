"""One dataset entry of the config (the seeds' multidatabackend.json) and its `video:` block.

Part of the one config model (`loraflow.config` imports and re-exports these): what a dataset folder holds and how
its files become clips. Cross-dataset rules (pairing, flavour fit, folders) are checked by `LoraflowConfig`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VideoSettings(StrictModel):
    """How frames are chosen from one video (the `video:` block of a dataset)."""

    num_frames: int = Field(17, description="frames per training clip; 4k+1")
    min_frames: int | None = Field(None, description="videos with fewer frames (after fps resampling) are skipped")
    max_frames: int | None = Field(None, description="videos with more frames are skipped; caps `full` clips")
    frame_rate: float | None = Field(None, description="resample to this fps; default: the flavour's fps")
    bucket_strategy: Literal["aspect_ratio", "resolution_frames"] = "aspect_ratio"
    frame_interval: int | None = Field(None, description="resolution_frames: round frame counts down to this step")
    frame_extraction: Literal["head", "chunk", "slide", "uniform", "full"] = "head"
    frame_stride: int = Field(1, ge=1, description="slide: start offset between clips, in frames")
    frame_sample: int = Field(1, ge=1, description="uniform: number of clips spread over the video")

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

    id: str = Field(description="names the dataset everywhere, and its Dagster partition")
    type: Literal["local"] = "local"
    dataset_type: Literal["video", "image", "conditioning", "text_embeds"] = Field(
        "video", description="conditioning: i2i source images, named by another dataset's `conditioning_data`; "
        "never trained on by themselves")
    conditioning_data: str | None = Field(
        None, description="i2i: id of the `dataset_type: conditioning` dataset holding each image's source image, "
        "paired by path relative to the folder (any image extension)")
    instance_data_dir: str | None = None
    caption_strategy: Literal["textfile", "filename", "instanceprompt", "metadata"] = "textfile"
    instance_prompt: str | None = None
    metadata_file: str | None = Field(None, description="caption_strategy metadata: .jsonl/.csv/.parquet of file -> "
                                      "caption(s); a relative path is inside instance_data_dir")
    resolution: int = Field(512, gt=0, description="pixel: the shorter side; area: the side of a square of equal area")
    resolution_type: Literal["pixel", "area", "pixel_area"] = Field(
        "pixel", description="pixel: shorter side = resolution; area (alias pixel_area): resolution**2 pixels")
    minimum_image_size: int | None = Field(
        None, ge=0, description="sources whose edge is smaller are dropped (source_too_small), in `resolution`'s unit: "
        "pixel: the shorter side; area/pixel_area: the side of a square of equal area (pixels, not SimpleTuner's "
        "megapixels); unset: resolution / 4; 0: keep every size")
    crop_aspect: Literal["preserve", "square", "closest"] = Field(
        "preserve", description="bucket aspect: the source's, 1:1, or the closest of `crop_aspect_buckets`")
    crop_aspect_buckets: tuple[float, ...] = Field((), description="crop_aspect closest: width/height ratios")
    video: VideoSettings = VideoSettings()
    crop_style: Literal["center", "random", "none"] = "center"
    repeats: int = Field(1, ge=1, description="how many times each clip is seen per epoch")
    cache_dir: str | None = Field(None, description="accepted for multidatabackend.json compatibility and not used: "
                                  "every cache lives under the top-level cache_dir, keyed by content")
    default: bool = False
    disabled: bool = False

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        # the id is a Dagster partition key and a file name: Dagster refuses "..." and control characters
        if not v.strip() or "..." in v or any(ord(c) < 32 for c in v):
            raise ValueError(f"id {v!r} must be non-empty, without '...' or control characters (it names the "
                             "dataset's Dagster partition)")
        return v

    @model_validator(mode="after")
    def _needs(self) -> DatasetConfig:
        if self.dataset_type != "text_embeds" and not self.instance_data_dir:
            raise ValueError(f"dataset '{self.id}' needs `instance_data_dir` (a folder of videos/images)")
        if self.caption_strategy == "instanceprompt" and not self.instance_prompt:
            raise ValueError(f"dataset '{self.id}' uses caption_strategy instanceprompt but has no `instance_prompt`")
        if (self.caption_strategy == "metadata") != bool(self.metadata_file):
            raise ValueError(f"dataset '{self.id}': `metadata_file` goes with caption_strategy metadata (both or neither)")
        if self.crop_aspect == "closest" and not self.crop_aspect_buckets:
            raise ValueError(f"dataset '{self.id}': crop_aspect closest needs `crop_aspect_buckets` (width/height ratios)")
        if self.crop_aspect_buckets and self.crop_aspect != "closest":
            raise ValueError(f"dataset '{self.id}': `crop_aspect_buckets` is only used with crop_aspect closest")
        if any(a <= 0 for a in self.crop_aspect_buckets):
            raise ValueError(f"dataset '{self.id}': `crop_aspect_buckets` must be positive width/height ratios")
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
