"""The code location: importing it does nothing; Dagster's call to `defs` builds it, and then reads LORAFLOW_CONFIG.

Run alone: `.venv/bin/python -m pytest -q tests/test_definitions.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from loraflow.assets.resources import LoraflowResource
from tests.factory import REPO

# In a fresh interpreter, with a DAGSTER_HOME (where the dead-run guard would poll): the threads and the diffusers
# classes before and after importing loraflow.definitions, then every loraflow module. Every diffusers module that
# loraflow names is imported first (and every name it takes from one looked up: diffusers loads lazily), so a class
# that any loraflow module could patch is measured before loraflow runs.
IMPORT_EVERYTHING = """
import ast, importlib, json, pathlib, pkgutil, sys, threading

package = pathlib.Path(sys.argv[1])
for path in package.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "diffusers":
            module = importlib.import_module(node.module)
            for alias in node.names:
                getattr(module, alias.name, None)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "diffusers":
                    importlib.import_module(alias.name)

def classes():
    found = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "diffusers" and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__.split(".")[0] == "diffusers":
                    found[f"{value.__module__}.{value.__qualname__}"] = (value, dict(vars(value)))
    return found

def changed(before):
    return sorted(f"{name}.{attr}" for name, (cls, attrs) in before.items()
                  for attr in set(attrs) | set(vars(cls)) if vars(cls).get(attr, None) is not attrs.get(attr, None))

threads, measured = {t.ident for t in threading.enumerate()}, classes()
import loraflow.definitions
report = {"classes": len(measured), "definitions": {
    "threads": [t.name for t in threading.enumerate() if t.ident not in threads], "changed": changed(measured)}}
for module in pkgutil.walk_packages([str(package)], "loraflow."):
    importlib.import_module(module.name)
report["everything"] = {"threads": [t.name for t in threading.enumerate() if t.ident not in threads],
                        "changed": changed(measured)}
loraflow.definitions.defs()  # what Dagster calls when it loads the code location
report["loaded"] = [t.name for t in threading.enumerate() if t.ident not in threads]
print(json.dumps(report))
"""


def test_importing_loraflow_starts_no_thread_and_patches_no_diffusers_class(tmp_path: Path) -> None:
    """Diffusers never patches another library's classes at import, and Dagster's examples keep definitions.py
    declarative: importing loraflow.definitions, or any loraflow module, starts no thread (the dead-run guard starts
    when Dagster loads the code location: `defs()`, which the test then calls) and leaves every diffusers class as
    diffusers made it (HunyuanVideo 1.5's VAE mask is set on each loaded VAE: `setup_vae`)."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(REPO / ".dagster" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, str(REPO / "loraflow")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["classes"] > 100  # the diffusers classes loraflow names were there to measure
    assert report["definitions"] == {"threads": [], "changed": []}
    assert report["everything"] == {"threads": [], "changed": []}
    assert report["loaded"] == ["loraflow-dead-runs"]  # loading the code location starts the guard, as before


def test_the_code_location_reads_loraflow_config_when_it_loads(tmp_path: Path, monkeypatch) -> None:
    """LORAFLOW_CONFIG is read when a resource is built (the code location builds its own when Dagster calls `defs`),
    not when the resource's class was defined: a config named after the import is the one it runs."""
    config = str(tmp_path / "later.yaml")
    monkeypatch.setenv("LORAFLOW_CONFIG", config)
    assert LoraflowResource().config_path == config
    monkeypatch.delenv("LORAFLOW_CONFIG")
    assert LoraflowResource().config_path == "configs/demo.yaml"
