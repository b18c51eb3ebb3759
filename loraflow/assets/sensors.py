"""A sensor that re-caches when a dataset folder changes: files added, changed (size or mtime) or removed.

The cursor is, per dataset, a hash of its files' identities (dataset-relative path, size, mtime) and a
file count: cheap to compute (stat only, nothing read) and small to store. Caption files count too: a
changed caption must re-encode its text. The assets are not partitioned, so the run re-plans every
dataset (unchanged ones cost nothing: every item they hold is cached); which datasets changed travels
in the run's tags and in an observation on `clips`, shown on its asset page.
"""

# No `from __future__ import annotations` here: Dagster inspects the real annotations of sensor functions.
import json
from pathlib import Path
from typing import Any

from dagster import (
    AssetObservation,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from loraflow.assets.resources import LoraflowResource
from loraflow.keys import content_key, file_identity

CHANGED_TAG = "loraflow/changed_datasets"
MISSING = "missing"  # the state of a folder that does not exist (yet)


def folder_state(root: str | Path) -> dict[str, Any]:
    """{"hash", "files"} of every non-hidden file under root; hidden files (editor swap files, .DS_Store) are
    not data and would trigger runs for nothing."""
    root = Path(root)
    if not root.is_dir():
        return {"hash": MISSING, "files": 0}
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    return {"hash": content_key(files=[file_identity(p, root) for p in files]), "files": len(files)}


def changed_datasets(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Ids whose state differs from the last tick (a dataset seen for the first time counts as changed)."""
    return sorted(i for i, state in current.items() if previous.get(i, {}).get("hash") != state["hash"])


@sensor(job_name="cache_only", minimum_interval_seconds=30, default_status=DefaultSensorStatus.STOPPED,
        description="Requests a cache_only run when files are added, changed or removed in any dataset's "
                    "instance_data_dir. The changed dataset ids are in the run tag " + CHANGED_TAG + ".")
def dataset_watch(context: SensorEvaluationContext, loraflow: LoraflowResource) -> SensorResult:
    config = loraflow.load()
    previous = json.loads(context.cursor) if context.cursor else {}
    current = {d.id: folder_state(d.instance_data_dir or "") for d in config.training_datasets}
    cursor = json.dumps(current, sort_keys=True)
    changed = changed_datasets(previous, current)
    if not changed:
        return SensorResult(skip_reason=f"no file added, changed or removed in {', '.join(current)}", cursor=cursor)
    files = {i: {"before": previous.get(i, {}).get("files"), "after": current[i]["files"],
                 "missing_folder": current[i]["hash"] == MISSING} for i in changed}
    context.log.info(f"datasets changed: {files}")
    return SensorResult(
        run_requests=[RunRequest(run_key=content_key(state=current), tags={CHANGED_TAG: ",".join(changed)})],
        cursor=cursor,
        asset_events=[AssetObservation(asset_key="clips", metadata={"changed_datasets": ",".join(changed),
                                                                    "files": files})],
    )
