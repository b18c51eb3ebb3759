"""`cache_latents_fanout`: one dataset's latents by N steps at once, fanned out by Dagster itself (dynamic outputs).

Each mapped step is one worker of stages/shard_worker.py: it commits its shard's latents and writes no manifest. Which
process, container or pod runs a step is the executor's business: Dagster's multiprocess executor (the default) runs the
N steps as N local processes, `k8s_job_executor` (dagster-k8s) as N Kubernetes Jobs, `docker_executor` (dagster-docker)
as N containers (docs/multi-gpu.md, "Caching one dataset with N workers"). A `cache_dataset` run of the dataset
afterwards finds every latent committed and materializes `clips` and `latents` (their data versions, checks, manifest
parts).
"""

# No `from __future__ import annotations` here: Dagster inspects the real annotations of config and context.
from collections.abc import Iterator

from dagster import Config, DynamicOut, DynamicOutput, OpExecutionContext, job, op

from loraflow.assets.jobs import TRANSIENT
from loraflow.assets.resources import LoraflowResource
from loraflow.keys import Shard


class FanoutConfig(Config):
    dataset: str  # a training dataset's id: the `datasets` partition whose latents to fan out
    workers: int = 4  # shards, one step each; `dagster instance concurrency set gpu N` lets N run at once


@op(out=DynamicOut(dict))
def latents_shards(config: FanoutConfig) -> Iterator[DynamicOutput]:
    Shard(0, config.workers)  # a workers count below 1 fails here, naming the rule
    for index in range(config.workers):
        yield DynamicOutput({"dataset": config.dataset, "shard": f"{index}/{config.workers}"},
                            mapping_key=f"shard_{index}")


# One GPU per step's pod under dagster-k8s' k8s_job_executor; every other executor ignores this tag.
ONE_GPU_POD = {"dagster-k8s/config": {"container_config": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}}


@op(pool="gpu", retry_policy=TRANSIENT, tags=ONE_GPU_POD)
def latents_shard(context: OpExecutionContext, loraflow: LoraflowResource, work: dict) -> int:
    from loraflow.pipelines import get_family
    from loraflow.stages.shard_worker import cache_shard

    config = loraflow.load()
    dataset = loraflow.dataset(config, work["dataset"])
    report = cache_shard(config, get_family(config), loraflow.model(config), dataset, Shard.parse(work["shard"]))
    context.log.info(f"latents shard {work['shard']} of '{dataset}': computed {report.computed}, "
                     f"reused {report.reused}, quarantined {len(report.quarantined)}")
    return report.computed


@op
def latents_fanned_out(context: OpExecutionContext, computed: list[int]) -> int:
    context.log.info(f"{sum(computed)} latent(s) computed by {len(computed)} step(s); a cache_dataset run of the "
                     "dataset now lists them")
    return sum(computed)


@job(description="One dataset's latents by N steps at once (run config: dataset, workers); then run cache_dataset")
def cache_latents_fanout() -> None:
    latents_fanned_out(latents_shards().map(latents_shard).collect())
