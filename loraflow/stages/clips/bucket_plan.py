"""What a config would cache, before any model loads: buckets, dropped files, and the bytes they will take.

`loraflow check` prints this; the latents asset check uses `LatentGeometry` for the shape every latent must
have. Planning is the clips stage's own per-file planner (`plan_files`), so the plan is what the clips stage will
do, not a second opinion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import ClipRow, DroppedFile
from loraflow.contracts.reports import BucketRow
from loraflow.media.frames import ProbeCache
from loraflow.stages.clips.buckets import LatentGeometry, tally_buckets
from loraflow.stages.clips.clips import plan_files, reads_sound_captions
from loraflow.stages.clips.hub_dataset import readable

if TYPE_CHECKING:  # planning asks the plain protocol (`FamilyPlanning`): no torch
    from loraflow.pipelines import FamilyPlanning
    from loraflow.pipelines.sources import ModelSource


@dataclass
class BucketPlan:
    buckets: list[BucketRow] = field(default_factory=list)
    dropped: list[DroppedFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # datasets that cannot be planned at all
    # one clip's first caption as the text encoder gets it (the family's composed prompt; a clip with an audio
    # caption where there is one), "" without clips; how many clips, how many of them without an audio caption
    example_caption: str = ""
    clips: int = 0
    without_audio_caption: int = 0  # clips with no audio caption (NAME.audio.txt, `audio_caption`)


def plan_buckets(config: LoraflowConfig, family: FamilyPlanning, geometry: LatentGeometry | None,
                 model: ModelSource | None = None, progress: bool = True) -> BucketPlan:
    """Probe every source file (metadata and one frame, no full decode) and plan its clips (`model`: the checkpoint
    on disk, for sizes that depend on it; None: as the config names it)."""
    plan = BucketPlan()
    planned: list[ClipRow] = []
    probes = ProbeCache()  # in memory: checking a config writes nothing to its cache
    for dataset in config.training_datasets:
        try:  # a Hugging Face dataset's rows are written to its folder first (hub_dataset.readable)
            dataset, listing = readable(dataset, config.cache_dir, reads_sound_captions(family))
        except (FileNotFoundError, ValueError, ImportError) as exc:
            plan.problems.append(str(exc))
            continue
        if not listing.files:
            plan.problems.append(f"dataset '{dataset.id}': no video/image files under {dataset.instance_data_dir}")
        clips, dropped = plan_files(config, family, model or config.pretrained_model_name_or_path, dataset, listing,
                                    probes, progress)
        if listing.files and not clips:  # check passed it, and training blamed the eval holdout
            plan.problems.append(f"dataset '{dataset.id}': none of its {len(listing.files)} file(s) gives a clip "
                                 f"(each is dropped, with its reason, in the list above): fix them, or set "
                                 f"`disabled: true` on dataset '{dataset.id}'")
        plan.dropped += dropped
        planned += clips
    shown = next((c for c in planned if c.audio_caption), planned[0] if planned else None)
    plan.example_caption = shown.captions[0] if shown else ""
    plan.clips, plan.without_audio_caption = len(planned), sum(not c.audio_caption for c in planned)
    plan.buckets = tally_buckets([(c.dataset, c.height, c.width, c.num_frames) for c in planned], geometry)
    return plan


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
