"""ruff in the suite: pyflakes, sorted imports and the 120-column width (pyproject.toml [tool.ruff]) do not drift."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.factory import REPO, missing_input

# The package, the benchmarks and the tests themselves.
CHECKED = ("loraflow", "benchmarks", "tests")


def test_ruff_passes() -> None:
    if importlib.util.find_spec("ruff") is None:
        missing_input("ruff is not installed: `pip install -e .[test]` (pins ruff==0.17.5)")
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *CHECKED]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check {' '.join(CHECKED)}:\n{done.stdout}{done.stderr}"
