"""The one Definitions object: `dagster dev` and `dagster asset materialize -m loraflow.definitions` load this."""

from dagster import Definitions

from loraflow.assets.checks import ALL_CHECKS
from loraflow.assets.jobs import JOBS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.schedules import recache_schedule
from loraflow.assets.sensors import dataset_watch
from loraflow.assets.stages import ALL_ASSETS

resource = LoraflowResource()
defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=JOBS,
    schedules=[recache_schedule(resource.config_path)],
    sensors=[dataset_watch],
    resources={"loraflow": resource},
)
