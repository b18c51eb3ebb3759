"""The one Definitions object: `dagster dev` and `dagster asset materialize -m loraflow.definitions` load this."""

from dagster import Definitions

from loraflow.assets.checks import ALL_CHECKS
from loraflow.assets.fanout import cache_latents_fanout
from loraflow.assets.jobs import graph
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.runs.dead_runs import watch_dead_runs
from loraflow.assets.runs.deployment import deployment_defs
from loraflow.assets.schedules import recache_schedule
from loraflow.assets.sensors import dataset_watch

resource = LoraflowResource()
deployment = deployment_defs()  # Celery workers and shared step outputs, where the environment names them
assets, jobs = graph(resource)  # with the config's `train_audio`: its sound's asset and job too
defs = Definitions(
    assets=assets,
    asset_checks=ALL_CHECKS,
    jobs=[*jobs, cache_latents_fanout],
    schedules=[recache_schedule(resource.config_path)],
    sensors=[dataset_watch],
    resources={"loraflow": resource, **deployment.get("resources", {})},
    executor=deployment.get("executor"),
)

# A killed `dagster asset materialize` run stays STARTED and keeps its `gpu` slot, and nothing in Dagster watches CLI
# runs. Loading this module is the one piece of our code that runs in such a process before its run claims a slot
# (and in the code server of `dagster dev`), so the dead-run guard runs here: once now, then on a thread (dead_runs.py).
watch_dead_runs()
