"""Every `benchmarks/bench_*.py` runs in its `--quick` form, into a temporary results folder
(`LORAFLOW_BENCH_RESULTS`, benchmarks/record.py), and the JSON it writes records the commit it was made at.
A benchmark that no test runs rots: four of them crashed at the commit this test came with (the training report's
`tables`, the clips row's `dataset`, `quantize_int8`'s key, the scale benchmark's image dataset on an i2v flavour).
The quick runs whose fresh processes take minutes on a loaded 2-core host are in the soak marker (`make soak`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factory import REPO

sys.path.insert(0, str(REPO))
from benchmarks import record  # noqa: E402

SCRIPTS = sorted(path.name for path in (REPO / "benchmarks").glob("bench_*.py"))
# quick runs of one to six minutes at load 10 (fresh processes, each importing torch): a clone's demo, 12 scale
# steps in their own processes, three `loraflow check` processes, three VAE processes
SLOW = {"bench_demo.py", "bench_scale.py", "bench_check.py", "bench_patch_conv.py"}


def committed_results() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (REPO / "benchmarks" / "results").glob("*.json")}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.soak) if s in SLOW else s for s in SCRIPTS])
def test_each_benchmark_runs_quick_and_its_json_names_the_commit(script: str, tmp_path: Path) -> None:
    before = committed_results()
    env = {**os.environ, record.RESULTS_ENV: str(tmp_path / "results"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stderr[-4000:]}"
    written = sorted((tmp_path / "results").glob("*.json"))
    assert written, f"{script} --quick wrote no results JSON under {record.RESULTS_ENV}"
    for path in written:
        result = json.loads(path.read_text())
        assert result["commit"] == record.commit(REPO) != "unknown", path.name
        assert result["quick"] is True, path.name
    assert committed_results() == before, "a quick run wrote over benchmarks/results"


def test_a_results_json_made_outside_git_says_unknown(tmp_path: Path) -> None:
    record.write(tmp_path / "r.json", {"x": 1}, made_at=record.commit(tmp_path))
    assert json.loads((tmp_path / "r.json").read_text()) == {"commit": "unknown", "x": 1}
    assert list(tmp_path.iterdir()) == [tmp_path / "r.json"]  # the temporary file renamed, none left beside


def test_every_results_json_names_a_commit_of_this_history() -> None:
    """Each committed result names the commit it was made at, one this repository holds. The thirteen measured
    before results recorded it carry the commit that wrote them, from `git log` (`commit_from` says so). In a
    shallow clone (no history to look in) only the hash's form is checked."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip() != "false"
    for name, body in committed_results().items():
        made_at = json.loads(body).get("commit")
        assert made_at and len(made_at) == 40, f"{name}: no full commit hash"
        if shallow:
            continue
        known = subprocess.run(["git", "cat-file", "-e", f"{made_at}^{{commit}}"], cwd=REPO, capture_output=True)
        assert known.returncode == 0, f"{name}: commit {made_at} is not in this repository's history"
