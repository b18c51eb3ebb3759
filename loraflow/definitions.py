"""The one Definitions object: `dagster dev` and `dagster asset materialize -m loraflow.definitions` load this."""

from dagster import AssetSelection, Backoff, Definitions, RetryPolicy, define_asset_job

from loraflow.assets.checks import ALL_CHECKS
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.schedules import recache_schedule
from loraflow.assets.sensors import dataset_watch
from loraflow.assets.stages import ALL_ASSETS

# Transient failures (a flaky network store, a worker killed for memory) are retried; a config error raises
# Failure(allow_retries=False) in LoraflowResource.load and is not. Retries resume from committed shards.
TRANSIENT = RetryPolicy(max_retries=2, delay=10, backoff=Backoff.EXPONENTIAL)

all_stages = define_asset_job("all_stages", AssetSelection.all(), description="clips -> ... -> validation")
cache_only = define_asset_job("cache_only", AssetSelection.assets("clips", "latents", "text_embeds"),
                              op_retry_policy=TRANSIENT, description="clips, latents, text_embeds and their checks")
train_and_validate = define_asset_job("train_and_validate", AssetSelection.assets("lora", "validation"))

resource = LoraflowResource()
defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[all_stages, cache_only, train_and_validate],
    schedules=[recache_schedule(resource.config_path)],
    sensors=[dataset_watch],
    resources={"loraflow": resource},
)
