"""The one Definitions object: `dagster dev` and `dagster asset materialize -m loraflow.definitions` load this."""

from dagster import AssetSelection, Definitions, define_asset_job

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import ALL_ASSETS

all_stages = define_asset_job("all_stages", AssetSelection.all(), description="clips -> ... -> validation")
cache_only = define_asset_job("cache_only", AssetSelection.assets("clips", "latents", "text_embeds"))
train_and_validate = define_asset_job("train_and_validate", AssetSelection.assets("lora", "validation"))

defs = Definitions(
    assets=ALL_ASSETS,
    jobs=[all_stages, cache_only, train_and_validate],
    resources={"loraflow": LoraflowResource()},
)
