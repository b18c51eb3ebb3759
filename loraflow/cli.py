"""`loraflow`: what Dagster's CLI does not do well. Stage runs go through `dagster asset materialize`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from loraflow.config import ConfigError, load_config

DEMO_CONFIG = "configs/demo.yaml"


def prepare_demo(config_path: str = DEMO_CONFIG) -> None:
    """Build what the demo config points at: the tiny model and the generated dataset (idempotent)."""
    from loraflow.ops.demo_data import make_demo_dataset
    from loraflow.pipelines.tiny import build_tiny

    config = load_config(config_path)
    build_tiny(config.model_family, config.pretrained_model_name_or_path)
    for dataset in config.training_datasets:
        make_demo_dataset(dataset.instance_data_dir)


def run_demo(config_path: str) -> int:
    from dagster import DagsterInstance

    from loraflow.definitions import defs

    os.environ.setdefault("DAGSTER_HOME", str(Path(".dagster").resolve()))
    os.environ["LORAFLOW_CONFIG"] = config_path
    prepare_demo(config_path)
    result = defs.get_job_def("all_stages").execute_in_process(instance=DagsterInstance.get())
    if not result.success:
        return 1
    for event in result.get_asset_materialization_events():
        materialization = event.asset_materialization
        if materialization.asset_key.path[-1] in ("lora", "validation"):
            for name in ("lora_path", "video", "status"):
                if name in materialization.metadata:
                    print(f"{materialization.asset_key.path[-1]:>10} {name}: {materialization.metadata[name].value}")
    print("browse it: DAGSTER_HOME=.dagster .venv/bin/dagster dev  (then open http://127.0.0.1:3000)")
    return 0


def check(config_path: str) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{config_path}: ok ({config.model_family}, flavour {config.model_flavour or 'default'}, "
          f"{len(config.training_datasets)} dataset(s))")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the tiny model + demo data, materialize every stage")
    demo.add_argument("--config", default=DEMO_CONFIG)
    checker = sub.add_parser("check", help="validate a config and print every problem, without loading models")
    checker.add_argument("config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.command == "demo":
        return run_demo(args.config)
    return check(args.config)


if __name__ == "__main__":
    sys.exit(main())
