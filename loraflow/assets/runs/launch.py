"""How the `lora` asset trains: in the Dagster process on the CPU, or as launched processes under Dagster Pipes.

One CPU process (the default) trains in-process, as every other stage does. Any CUDA run, or `num_processes > 1`,
starts `python -m loraflow.train_main CONFIG` (one process) or `python -m loraflow.training.launch.local_launch N -m
loraflow.train_main CONFIG` (torchrun's launcher, every socket on loopback) through PipesSubprocessClient: the GPUs'
memory is the launched processes' alone and is given back when they exit, every rank trains, and rank 0 streams its
log lines and reports the materialization, which becomes this asset's (see loraflow/train_main.py). Trainers die
with the process that started them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dagster import AssetExecutionContext, PipesSubprocessClient

from loraflow.config import LoraflowConfig
from loraflow.contracts.reports import LoraReport
from loraflow.pipelines.sources import ModelSource

if TYPE_CHECKING:
    from loraflow.pipelines.base import ModelFamily  # imports torch


def needs_launch(config: LoraflowConfig) -> bool:
    import torch

    return config.num_processes > 1 or torch.cuda.is_available()


def launch_command(config_path: str, num_processes: int) -> list[str]:
    """The training entry point: one process runs it directly (the process Pipes starts is the trainer, so stopping
    the run stops it); more go through torchrun's launcher with its rendezvous on loopback
    (`loraflow.training.launch.local_launch`: plain torchrun and `accelerate launch` listen on every interface), on
    CPUs as well, with `fsdp: true` too: loraflow shards the model itself (tests/training/test_fsdp.py: the same bits as
    `accelerate launch` with the README's FSDP file)."""
    entry = ["-m", "loraflow.train_main", str(Path(config_path).resolve())]
    if num_processes == 1:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "loraflow.training.launch.local_launch", str(num_processes), *entry]


def run_training(context: AssetExecutionContext, config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                 config_path: str, store: Any) -> LoraReport:
    """The lora stage's report, trained here or by the launched processes (`family`, `model`: resolved by the asset
    either way, so the Hub is asked once, before any process starts; each launched process resolves them again, the
    model from the cache)."""
    from loraflow.train_main import report_from_summary
    from loraflow.training.loop import train_lora

    if not needs_launch(config):
        return train_lora(config, family, model, store)
    command = launch_command(config_path, config.num_processes)
    context.log.info(f"launching {config.num_processes} training process(es): {' '.join(command)}")
    result = PipesSubprocessClient().run(command=command, context=context).get_materialize_result()
    values = {name: value.value for name, value in (result.metadata or {}).items()}
    return report_from_summary(values)
