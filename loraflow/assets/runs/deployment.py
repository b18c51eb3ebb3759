"""A deployment past one machine (docs/scale.md): steps on Celery workers, and what steps hand each other in storage
every machine reaches. Both are off unless the environment names them, so one machine's `dagster dev` is unchanged.

- LORAFLOW_CELERY_BROKER (a Redis URL, also the result backend): every job's steps go to Celery workers
  (`dagster-celery worker start` on each GPU machine) instead of child processes of the run.
- LORAFLOW_STEP_IO (an fsspec URL, e.g. s3://bucket/loraflow/dagster-io): the outputs a step hands the next (the
  fan-out's shard specs and counts) are JSON files there. Dagster's default keeps them, pickled, under the run
  machine's DAGSTER_HOME, which a worker on another machine cannot read (the Celery executor refuses it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from dagster import InputContext, OutputContext, UPathIOManager


class JsonStepIO(UPathIOManager):
    """Step outputs as JSON files under one URL (no pickle: only JSON values pass between loraflow's steps)."""

    extension = ".json"

    def dump_to_path(self, context: OutputContext, obj: Any, path: Any) -> None:
        path.write_text(json.dumps(obj))  # one object store PUT, or one local write: whole or absent

    def load_from_path(self, context: InputContext, path: Any) -> Any:
        return json.loads(path.read_text())


def deployment_defs() -> dict[str, Any]:
    """The Definitions arguments the environment asks for: {} on one machine."""
    broker, step_io = os.environ.get("LORAFLOW_CELERY_BROKER"), os.environ.get("LORAFLOW_STEP_IO")
    if broker and not step_io:
        raise ValueError("LORAFLOW_CELERY_BROKER is set but LORAFLOW_STEP_IO is not: Celery workers on other machines "
                         "read the outputs of earlier steps from it; set it to a URL every machine reaches, e.g. "
                         "s3://bucket/loraflow/dagster-io (docs/scale.md)")
    defs: dict[str, Any] = {}
    if step_io:
        from upath import UPath

        defs["resources"] = {"io_manager": JsonStepIO(base_path=UPath(step_io))}
    if broker:
        from dagster_celery import celery_executor

        defs["executor"] = celery_executor.configured({"broker": broker, "backend": broker})
    return defs
