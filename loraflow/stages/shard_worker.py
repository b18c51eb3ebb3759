"""One dataset cached by N processes at once: its clips split into stable shards by key hash, one worker per shard.

A worker encodes the latents of its shard's clips that the store lacks and commits them as every run does (a store
shard per SHARD_CLIPS clips); it writes no manifest. So N workers never write the same file, each resumes from its
own committed keys, and a killed worker started again with the same shard redoes only its share. Once every worker is
done, one ordinary run of the dataset (`encode_latents` without a shard: the `latents` asset, or `cache_dataset`
below) finds every latent committed, computes nothing (but tries a clip a worker quarantined again, as every run does)
and writes the dataset's manifest part.

The shard of a clip depends on its key and N only: the same on every machine and in every run, so the shards can
equally be N local processes (`loraflow cache --workers N`), N GPUs of one machine, or N steps that Dagster's Docker or
Kubernetes executor places on other machines over an `s3://` store (docs/multi-gpu.md, "Caching one dataset with N
workers").
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from loraflow.config import LoraflowConfig
from loraflow.contracts.reports import AudioLatentsReport, ClipsReport, LatentsReport
from loraflow.keys import Shard
from loraflow.lifetime import die_with_parent
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store

if TYPE_CHECKING:
    from loraflow.pipelines.base import ModelFamily  # imports torch

log = logging.getLogger(__name__)


def cache_shard(config: LoraflowConfig, family: ModelFamily, model: ModelSource, dataset: str,
                shard: Shard) -> LatentsReport:
    """One worker: the latents of the shard's clips of the dataset that the store lacks. The dataset's clips must be
    cached (its clips manifest part is what is split). On a machine of several GPUs, shard i takes GPU i mod N."""
    import torch

    from loraflow.stages.latents.latents import encode_latents

    if torch.cuda.device_count() > 1:  # N local processes (`run_workers`, Dagster's multiprocess executor) see all
        torch.cuda.set_device(shard.index % torch.cuda.device_count())
    store = Store(config.cache_dir, config.manifest_names)
    return encode_latents(config, family, model, store, datasets=[dataset], shard=shard)


class WorkersFailed(RuntimeError):
    """Latents workers that exited non-zero, each having printed why: `loraflow cache` says so without a traceback."""


def run_workers(config_path: str, dataset: str, count: int) -> dict[int, int]:
    """Run `loraflow cache --shard i/count` for every i as local processes at once; wait for all; return the exit
    code of each shard that failed. Each worker gets an equal part of the CPU's threads and dies with this process."""
    workers = {}
    for index in range(count):
        env = dict(os.environ)  # N processes of all-cores BLAS threads would fight over the cores (torchrun sets 1)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
        command = [sys.executable, "-m", "loraflow.cli", "cache", config_path, "--dataset", dataset,
                   "--shard", f"{index}/{count}"]
        workers[index] = subprocess.Popen(command, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    return {index: code for index, worker in workers.items() if (code := worker.wait()) != 0}


def cache_dataset(config_path: str, config: LoraflowConfig, family: ModelFamily, model: ModelSource, dataset: str,
                  workers: int) -> tuple[ClipsReport, LatentsReport, AudioLatentsReport | None]:
    """Clips (one process), latents by `workers` processes, then the manifest parts, and with `train_audio` the
    clips' sound (this process): what a `cache_dataset` run does for one dataset, with the VAE work fanned out. A
    failed worker raises after the others finished; running this again redoes only what is still missing."""
    from loraflow.stages.audio.audio_latents import encode_audio
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents

    store = Store(config.cache_dir, config.manifest_names)
    with store.part_lock(dataset, on_wait=lambda: log.info("waiting for another process writing '%s'", dataset)):
        clips = build_clips(config, family, model, store, datasets=[dataset])
    failed = run_workers(config_path, dataset, workers)
    if failed:
        raise WorkersFailed(f"latents worker(s) {', '.join(f'{i}/{workers}' for i in failed)} of dataset '{dataset}' "
                            f"failed (exit codes {', '.join(map(str, failed.values()))}; each worker's message is "
                            "above: a full disk, ...); fix that, then run again to resume them")
    with store.part_lock(dataset):  # every latent is committed: this writes the manifest parts
        latents = encode_latents(config, family, model, store, datasets=[dataset])
        return clips, latents, encode_audio(config, model, store, [dataset]) if config.train_audio else None
