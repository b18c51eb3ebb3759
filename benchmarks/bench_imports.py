"""CPU benchmark: what each entry point pays in imports before any work, each in a fresh interpreter.

A Dagster step process and the code server import `loraflow.definitions`; `loraflow check` imports `loraflow.cli`
and then its planning (`stages.clips.bucket_plan`, the family's plain spec through `plan_family`); the stages that
load a model import the family module (`get_family`: torch, diffusers, transformers). Each statement is timed inside
its own fresh `python -c` (interpreter start not counted), rounds interleaved, median reported, with whether
torch ended up imported. `--before DIR`: the same statements on another tree (an export of an older commit, say
`git archive c2246c0 loraflow tests | tar -x -C DIR`), interleaved with this one's, so both see the same load.

    .venv/bin/python benchmarks/bench_imports.py [--before DIR]   # writes benchmarks/results/imports_cpu.json
    .venv/bin/python benchmarks/bench_imports.py --quick          # one round: that it runs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("imports_cpu.json")
ENTRY_POINTS = {
    "loraflow CLI (import loraflow.cli)": "import loraflow.cli",
    "Dagster step process / code server (import loraflow.definitions)": "import loraflow.definitions",
    # before plan_family, check and the clips stage called get_family
    "loraflow check, clips stage: planning (bucket_plan + the family they ask)":
        "import loraflow.cli, loraflow.stages.clips.bucket_plan\nfrom loraflow import pipelines\n"
        "getattr(pipelines, 'plan_family', pipelines.get_family)(loraflow.cli.load_config('tests/demo_t2v.yaml'))",
    "a stage that loads a model: get_family (family module)":
        "from loraflow.pipelines import load_family\nload_family('kandinsky5-video')",
}
TIMED = """
import sys, time
began = time.perf_counter()
{statement}
print(time.perf_counter() - began, 'torch' in sys.modules)
"""


def timed(statement: str, root: Path) -> tuple[float, bool]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("DAGSTER_HOME", None)  # no dead-run guard thread
    done = subprocess.run([sys.executable, "-c", TIMED.format(statement=statement)], cwd=root, env=env,
                          capture_output=True, text=True, check=True)
    seconds, torch = done.stdout.split()[-2:]
    return float(seconds), torch == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another tree to time beside this one")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="one round: that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    trees = {"this tree": ROOT, **({f"before ({args.before})": args.before} if args.before else {})}
    keys = [(tree, name) for tree in trees for name in ENTRY_POINTS]
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    torch: dict[tuple[str, str], bool] = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):  # interleaved: a load spike on the shared host hits every entry point alike
        for tree, name in keys:
            seconds, torch[tree, name] = timed(ENTRY_POINTS[name], trees[tree])
            times[tree, name].append(seconds)
        load.append(os.getloadavg()[0])
    rows = [{"tree": tree, "entry_point": name, "median_s": round(statistics.median(t), 2),
             "min_s": round(min(t), 2), "max_s": round(max(t), 2), "imports_torch": torch[tree, name]}
            for (tree, name), t in times.items()]
    for row in rows:
        print(row, flush=True)
    result = {"benchmark": "import time of each entry point, fresh interpreter each, CPU", "rounds": args.rounds,
              "rows": rows, "load_average_1min_per_round": load, "cpu_count": os.cpu_count(),
              "machine": platform.machine(), "python": platform.python_version()}
    if args.before:
        result["before_commit"] = record.commit(args.before)
    record.write(args.out, result, indent=1, quick=args.quick)


if __name__ == "__main__":
    main()
