"""What a config would cache, before any model loads: buckets, dropped files, and the bytes they will take.

`loraflow check` prints this; the latents asset check uses `LatentGeometry` for the shape every latent must
have. Planning reuses the clips stage's own functions (list_folder, read_captions, probe, plan_clips), so
the plan is what the clips stage will do, not a second opinion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from tqdm import tqdm

from loraflow.config import LoraflowConfig
from loraflow.contracts.reports import BucketRow
from loraflow.stages.clips.buckets import LatentGeometry, tally_buckets
from loraflow.stages.clips.captions import read_captions
from loraflow.stages.clips.clips import check_name, dropped, find_source_image, plan_clips
from loraflow.stages.clips.dataset_folder import list_folder
from loraflow.media.frames import probe
from loraflow.media.types import MediaError

if TYPE_CHECKING:  # the family protocol module imports torch; planning must stay light
    from loraflow.pipelines import FamilyPlan
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.sources import ModelSource


@dataclass
class BucketPlan:
    buckets: list[BucketRow] = field(default_factory=list)
    dropped: list[dict[str, str]] = field(default_factory=list)  # {dataset, file, reason, detail}
    problems: list[str] = field(default_factory=list)  # datasets that cannot be planned at all


def plan_buckets(config: LoraflowConfig, family: FamilyPlan | ModelFamily, geometry: LatentGeometry | None,
                 model: ModelSource | None = None, progress: bool = True) -> BucketPlan:
    """Probe every source file (metadata and one frame, no full decode) and plan its clips (`model`: the checkpoint
    on disk, for sizes that depend on it; None: as the config names it)."""
    plan = BucketPlan()
    clips_seen: list[tuple[str, int, int, int]] = []
    for dataset in config.training_datasets:
        try:
            listing = list_folder(dataset)
        except FileNotFoundError as exc:
            plan.problems.append(str(exc))
            continue
        files = listing.files
        plan.dropped += [dropped(dataset.id, path, exc) for path, exc in listing.others]
        if not files:
            plan.problems.append(f"dataset '{dataset.id}': no video/image files under {dataset.instance_data_dir}")
        sources = config.source_images(dataset)
        for path in tqdm(files, desc=f"probe {dataset.id}", unit="file", disable=not progress or not files):
            try:
                read_captions(check_name(path), dataset)
                if sources is not None:  # i2i: a target without its source image is dropped by clips too
                    probe(check_name(find_source_image(path, dataset, sources)))
                clips = plan_clips(path, probe(path), dataset, family, model or config.pretrained_model_name_or_path,
                                   dataset.id == config.render_dataset_id)
            except MediaError as exc:
                plan.dropped.append(dropped(dataset.id, path, exc))
                continue
            clips_seen += [(dataset.id, c["height"], c["width"], len(c["indices"])) for c in clips]
    plan.buckets = tally_buckets(clips_seen, geometry)
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
