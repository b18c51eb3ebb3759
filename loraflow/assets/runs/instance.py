"""The Dagster instance the `loraflow demo` and `loraflow partitions` commands use (the CLI imports no dagster)."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import DagsterInstance


def home_instance() -> DagsterInstance:
    """The instance under DAGSTER_HOME as `make` sets it (.dagster), for runs and partitions the UI shows afterwards."""
    os.environ.setdefault("DAGSTER_HOME", str(Path(".dagster").resolve()))
    Path(os.environ["DAGSTER_HOME"]).mkdir(parents=True, exist_ok=True)
    return DagsterInstance.get()
