"""The README's first command on a fresh clone: how long it takes, and what its LoRA visibly learnt.

Clones this repository's HEAD into a temporary folder (so `.venv` and `.loraflow/` start empty) and runs `make demo`
there twice: the first run sets up, builds the tiny world (its pre-trained weights ship with loraflow; a recipe
without shipped weights pre-trains, timed as `tiny_world_pretraining_s`, else null) and materializes every stage; the
second reuses everything. The setup's part of the first run is timed apart: `make
setup` first, then `make demo` (whose setup then finds everything done), the sum being the README's first command.
From the first run's validation videos it measures what `tests/demo/test_demo_learns.py` asserts: the circle's mean
rightward shift over the generated frames, base and LoRA, and the eval loss change at the fixed sigmas.

    .venv/bin/python benchmarks/bench_demo.py      # writes benchmarks/results/demo_cpu.json (about 4 minutes)
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "demo_cpu.json"


def timed_make(target: str, clone: Path) -> tuple[float, str]:
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "VIRTUAL_ENV")}
    done = subprocess.run(["make", target], cwd=clone, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"make {target} failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start, done.stdout + done.stderr


def pretraining_seconds(log: str) -> float | None:
    """The tqdm bar's elapsed time at 100% (mm:ss)."""
    found = re.findall(r"pre-training the transformer \(once\): 100%[^\[]*\[(\d+):(\d+)<", log)
    return 60 * int(found[-1][0]) + int(found[-1][1]) if found else None


def learnt(clone: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from loraflow.demo.tiny_world import rightward_shift
    from loraflow.media.writers import read_media

    [results_file] = (clone / ".loraflow" / "output" / "validation").glob("*/results.json")
    results = json.loads(results_file.read_text())
    [prompt] = results["prompts"]  # paths relative to the clone, as the demo config writes them
    base = float(np.mean([r["base"] for r in results["eval_loss"]]))
    lora = float(np.mean([r["lora"] for r in results["eval_loss"]]))
    return {"shift_px": {k: round(rightward_shift(read_media(clone / prompt[k])), 2) for k in ("base", "lora")},
            "eval_loss": {"base": base, "lora": lora, "change": (lora - base) / base}}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        clone = Path(tmp) / "loraflow"
        load_before = os.getloadavg()[0]  # these 2 cores are shared: the load says how quiet the host was
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        setup, _ = timed_make("setup", clone)
        first, log = timed_make("demo", clone)
        again, _ = timed_make("demo", clone)
        result = {
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                                     text=True).stdout.strip(),
            "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                     "load_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
            "make_demo_fresh_clone_s": round(setup + first, 1),
            "setup_s": round(setup, 1),
            "tiny_world_pretraining_s": pretraining_seconds(log),
            "make_demo_again_s": round(again, 1),
            **learnt(clone),
        }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
