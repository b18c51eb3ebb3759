"""Where a benchmark's results JSON goes and what it records: one place for every `benchmarks/` script.

`results_path(NAME)`: `benchmarks/results/NAME`, or `$LORAFLOW_BENCH_RESULTS/NAME` where that is set (the test of
the benchmarks' `--quick` runs writes there, never over the committed results). `write(path, result)`: the JSON with
the commit it was made at first (`git rev-parse HEAD` of this checkout; "unknown" outside git), written atomically
(a temporary file beside it, then renamed), so a benchmark cut off mid-write leaves the previous file whole.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_ENV = "LORAFLOW_BENCH_RESULTS"


def results_path(name: str) -> Path:
    folder = os.environ.get(RESULTS_ENV)
    return Path(folder) / name if folder else ROOT / "benchmarks" / "results" / name


def commit(tree: Path = ROOT) -> str:
    """The commit `tree` is checked out at; "unknown" outside git (an exported tree, a machine without git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def write(path: Path, result: dict[str, Any], indent: int = 2, made_at: str | None = None, quick: bool = False) -> None:
    """`result` as JSON at `path`, its `commit` first (`made_at`, else this checkout's HEAD); `quick`: marked as a
    `--quick` run (that the benchmark runs, not a number to quote)."""
    body = {"commit": made_at or commit(), **({"quick": True} if quick else {}),
            **{k: v for k, v in result.items() if k != "commit"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(body, indent=indent) + "\n")
    partial.replace(path)
