"""The lora stage as a process of its own, one per GPU: what a launcher starts (local_launch, torchrun, accelerate).

    python -m loraflow.training.launch.local_launch 2 -m loraflow.train_main CONFIG   # num_processes: 2, on loopback
    python -m loraflow.train_main CONFIG                                       # one process

Every rank trains. Rank 0 alone logs; when Dagster started the launch (Pipes environment variables set) it streams
its log lines to Dagster and reports the materialization: the summary below and the run's data version. Without
Dagster it prints the summary as one JSON line. Other ranks print warnings and errors only and never open Pipes.
Uses the lightweight `dagster-pipes` package: a GPU box needs no Dagster installed. It lives outside `training/`
because the stage logic (stages/, training/, validation/) imports no Dagster package at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraflow.contracts.reports import LoraReport
from loraflow.lifetime import die_with_parent

log = logging.getLogger(__name__)


def report_from_summary(values: dict[str, Any]) -> LoraReport:
    """The report a launched run summarised (`LoraReport.summary`), the rest read back from its run folder."""
    from loraflow.training.run import lora_report  # torch: imported when used, as in train_config_file()

    return lora_report(Path(values["run_dir"]), values["inputs"], computed=int(values["computed"]),
                       resumed_at=int(values["resumed_at_step"]))


def train_config_file(config_path: str) -> LoraReport:
    from loraflow.config import load_config
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.store import Store
    from loraflow.training.loop import train_lora

    config = load_config(config_path)
    return train_lora(config, get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names))


def main(argv: Sequence[str] | None = None) -> int:
    from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

    from loraflow.config import ConfigError
    from loraflow.training.launch.distributed import leave, world_from_env

    parser = argparse.ArgumentParser(prog="python -m loraflow.train_main", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the YAML/JSON config of the run")
    args = parser.parse_args(argv)
    # SIGTERM when the Dagster step (or the launcher) dies: a killed step leaves no trainer holding the GPU
    # and writing into a run folder a resumed run also writes to
    die_with_parent()
    world = world_from_env()
    logging.basicConfig(level=logging.INFO if world.main else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s rank {world.rank} %(levelname)s %(name)s: %(message)s")
    try:
        if world.main and PipesEnvVarParamsLoader().is_dagster_pipes_process():
            with open_dagster_pipes() as pipes:
                (to_dagster,) = pipes.log.handlers
                logging.getLogger("loraflow").addHandler(to_dagster)  # loraflow's log lines go to Dagster too
                try:
                    report = train_config_file(args.config)
                finally:
                    logging.getLogger("loraflow").removeHandler(to_dagster)
                # A mapping would read as Pipes' {raw_value, type} schema: mappings are marked json
                metadata = {k: {"raw_value": v, "type": "json"} if isinstance(v, dict) else v
                            for k, v in report.summary().items()}
                pipes.report_asset_materialization(metadata=metadata, data_version=report.data_version)
        else:
            report = train_config_file(args.config)
            if world.main:
                print(json.dumps({"data_version": report.data_version, **report.summary()}))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    finally:
        leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
