"""One dataset entry of the config (the seeds' multidatabackend.json) and its `video:` block.

Part of the one config model (`loraflow.config` imports and re-exports these): what a dataset folder holds and how
its files become clips. Cross-dataset rules (pairing, flavour fit, folders) are checked by `LoraflowConfig`.
Every config field is a `setting` that declares what it does to a training run's key (`config/run_key.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator

from loraflow.config.run_key import StrictModel, setting
from loraflow.keys import PART_STEM_LIMIT, part_file_stem

VAE_TEMPORAL_FACTOR = 4  # all three families' VAEs compress time 4x: video clips have 4k+1 frames
# Without `minimum_image_size`, a source whose edge is under resolution / 4 is dropped: a 16x upscale in pixels is
# blur, not training data (a 2x2 video filled a 256x256 bucket), while 480p videos at resolution 512 still pass.
DEFAULT_MAX_UPSCALE = 4
# `type: huggingface`: the rows' files go into this folder of cache_dir, as SimpleTuner puts its Hugging Face
# datasets' (simpletuner/helpers/data_backend/builders/huggingface.py `_default_cache_dir`: cache_dir/huggingface/<id>),
# their captions into this metadata file there (stages/clips/hub_dataset.py)
HUB_FOLDER = "huggingface"
HUB_METADATA = "metadata.jsonl"


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
    type: Literal["local", "huggingface"] = setting(
        "local", run_key="always", description="local: the files of instance_data_dir; huggingface: the rows of a "
        "Hugging Face dataset (`dataset_name`), through the datasets library and its cache (docs/datasets.md)")
    # `type: huggingface`, SimpleTuner's keys (simpletuner/helpers/data_backend/builders/huggingface.py)
    dataset_name: str | None = setting(
        None, run_key="when_set", description="type huggingface: the Hub dataset's id (org/name)")
    split: str | None = setting(None, run_key="when_set", description="type huggingface: the split; unset: train")
    revision: str | None = setting(
        None, run_key="when_set", description="type huggingface: branch, tag or commit of the dataset; unset: main")
    video_column: str | None = setting(
        None, run_key="when_set", description="type huggingface, dataset_type video: the column of the videos; "
        "unset: video")
    image_column: str | None = setting(
        None, run_key="when_set", description="type huggingface, dataset_type image: the column of the images; "
        "unset: image")
    caption_column: str | None = setting(
        None, run_key="when_set", description="type huggingface, caption_strategy huggingface: the column of the "
        "captions (a string, or a list of strings); a row without one is quarantined as missing_caption")
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
    caption_strategy: Literal["textfile", "filename", "instanceprompt", "metadata", "auto", "huggingface"] = setting(
        "textfile", run_key="always", description="auto: NAME.txt beside the file where there is one (a user's caption "
        "always wins), else each clip is captioned from its frames by a Qwen2.5-VL (the `captions` asset; "
        "caption_model_path, caption_prompt). huggingface: the `caption_column` of a type huggingface dataset (its "
        "default there; instanceprompt is the other strategy it takes)")
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

    @model_validator(mode="before")
    @classmethod
    def _hub_captions(cls, data: object) -> object:
        """SimpleTuner's default caption strategy for a Hugging Face dataset: its caption column."""
        if isinstance(data, dict) and data.get("type") == "huggingface" and "caption_strategy" not in data:
            return {**data, "caption_strategy": "huggingface"}
        return data

    @model_validator(mode="after")
    def _needs(self) -> DatasetConfig:
        if self.conditioning_type is not None and self.dataset_type != "conditioning":
            raise ValueError(f"dataset '{self.id}': `conditioning_type` goes on a `dataset_type: conditioning` "
                             f"dataset, not on a {self.dataset_type} dataset")
        self._hub_needs()
        if self.type == "local" and self.dataset_type != "text_embeds" and not self.instance_data_dir:
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

    def _hub_needs(self) -> None:
        hub_keys = [k for k in ("dataset_name", "split", "revision", "video_column", "image_column",
                                "caption_column") if getattr(self, k) is not None]
        if self.type == "local":
            if hub_keys:
                raise ValueError(f"dataset '{self.id}': `{hub_keys[0]}` is for `type: huggingface` datasets; this "
                                 "one is a local folder (type local)")
            if self.caption_strategy == "huggingface":
                raise ValueError(f"dataset '{self.id}': caption_strategy huggingface reads a Hugging Face dataset's "
                                 "caption column: set `type: huggingface` and `dataset_name`, or use textfile")
            return
        if not self.dataset_name:
            raise ValueError(f"dataset '{self.id}': `type: huggingface` needs `dataset_name` (the Hub dataset's id, "
                             "org/name)")
        if self.dataset_type not in ("video", "image"):
            raise ValueError(f"dataset '{self.id}': `type: huggingface` takes dataset_type video or image; a "
                             f"{self.dataset_type} dataset is a local folder")
        if self.caption_strategy not in ("huggingface", "instanceprompt"):
            raise ValueError(f"dataset '{self.id}': a Hugging Face dataset takes caption_strategy huggingface (its "
                             f"`caption_column`) or instanceprompt, as SimpleTuner's; got {self.caption_strategy}")
        if self.caption_strategy == "huggingface" and not self.caption_column:
            raise ValueError(f"dataset '{self.id}': caption_strategy huggingface needs `caption_column` (the column "
                             "of the captions)")
        other = "image_column" if self.dataset_type == "video" else "video_column"
        if getattr(self, other) is not None:
            raise ValueError(f"dataset '{self.id}': `{other}` is not read by a dataset_type {self.dataset_type} "
                             f"dataset (it reads `{self.media_column}`)")

    @property
    def media_column(self) -> str:
        """type huggingface: the column holding each row's video or image."""
        if self.dataset_type == "video":
            return self.video_column or "video"
        return self.image_column or "image"

    def as_folder(self, cache_dir: str) -> DatasetConfig:
        """The dataset as the clips stage reads it: a local dataset as it is; a Hugging Face dataset as the folder
        its rows are written to (`instance_data_dir`, default cache_dir/huggingface/<id>), captions in its
        metadata file (`caption_strategy: huggingface` read as `metadata`)."""
        if self.type == "local":
            return self
        folder = self.instance_data_dir
        if folder is None:
            if "://" in cache_dir:
                raise ValueError(f"dataset '{self.id}': a Hugging Face dataset's files go into a local folder, and "
                                 f"cache_dir {cache_dir} is an object store: set `instance_data_dir` on the dataset")
            folder = str(Path(cache_dir) / HUB_FOLDER / part_file_stem(self.id))
        captions = {"caption_strategy": "metadata", "metadata_file": HUB_METADATA} \
            if self.caption_strategy == "huggingface" else {}
        return self.model_copy(update={"instance_data_dir": folder, **captions})

    def minimum_source_edge(self) -> float:
        """The smallest source edge kept (`buckets.source_edge`'s measure): `minimum_image_size` or the default."""
        if self.minimum_image_size is not None:
            return self.minimum_image_size
        return self.resolution / DEFAULT_MAX_UPSCALE
