"""How Dagster runs start, stop and where they live: the `lora` asset's trainer launch (`launch.py`), the dead-run
guard (`dead_runs.py`), the executor and step I/O past one machine (`deployment.py`), and the instance the CLI uses
(`instance.py`)."""
