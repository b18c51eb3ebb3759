"""The code location: `dagster dev`, `dagster asset materialize -m loraflow.definitions` and `dg check defs` load
`defs`. Importing this module does nothing: Dagster calls `defs` when it loads the code location."""

from dagster import Definitions, definitions

from loraflow.assets.checks import ALL_CHECKS
from loraflow.assets.fanout import cache_latents_fanout
from loraflow.assets.jobs import graph
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.runs.dead_runs import watch_dead_runs
from loraflow.assets.runs.deployment import deployment_defs
from loraflow.assets.schedules import recache_schedule
from loraflow.assets.sensors import dataset_watch


def code_location() -> Definitions:
    """The assets, checks, jobs, sensor and schedule of the config LORAFLOW_CONFIG names (read now), with the
    executor and step I/O the environment names."""
    resource = LoraflowResource()
    deployment = deployment_defs()  # Celery workers and shared step outputs, where the environment names them
    assets, jobs = graph(resource)  # with the config's `train_audio`: its sound's asset and job too
    return Definitions(
        assets=assets,
        asset_checks=ALL_CHECKS,
        jobs=[*jobs, cache_latents_fanout],
        schedules=[recache_schedule(resource.config_path)],
        sensors=[dataset_watch],
        resources={"loraflow": resource, **deployment.get("resources", {})},
        executor=deployment.get("executor"),
    )


@definitions
def defs() -> Definitions:
    """The code location, as Dagster loads it: in a process of Dagster's CLI and in the code server of `dagster dev`,
    the dead-run guard first (once now, then on a thread: dead_runs.py).

    A killed `dagster asset materialize` run stays STARTED and keeps its `gpu` slot, and nothing in Dagster watches CLI
    runs. Loading the code location is the one piece of our code that runs in such a process before its run claims a
    slot, so the guard starts here."""
    watch_dead_runs()
    return code_location()
