"""The README's first command on a fresh clone: how long it takes, and what its LoRA visibly learnt.

Clones this repository's HEAD into a temporary folder (so `.venv` and `.loraflow/` start empty) and runs `make demo`
there twice: the first run sets up, builds the tiny world (its pre-trained weights ship with loraflow; a recipe
without shipped weights pre-trains, timed as `tiny_world_pretraining_s`, else null) and materializes every stage; the
second reuses everything. The setup's part of the first run is timed apart: `make
setup` first, then `make demo` (whose setup then finds everything done), the sum being the README's first command.
From the first run's validation videos it measures what `tests/demo/test_demo_learns.py` asserts: the circle's mean
rightward shift over the generated frames, base and LoRA, and the eval loss change at the fixed sigmas.

    .venv/bin/python benchmarks/bench_demo.py      # writes benchmarks/results/demo_cpu.json (about 4 minutes)
    .venv/bin/python benchmarks/bench_demo.py --quick   # `loraflow demo` in this checkout, 8 steps: that it runs
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

OUT = record.results_path("demo_cpu.json")


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


def learnt(output: Path, relative_to: Path) -> dict:
    import numpy as np

    from loraflow.demo.tiny_world import rightward_shift
    from loraflow.media.writers import read_media

    [results_file] = (output / "validation").glob("*/results.json")
    results = json.loads(results_file.read_text())
    [prompt] = results["prompts"]  # paths relative to the checkout, as the demo config writes them
    base = float(np.mean([r["base"] for r in results["eval_loss"]]))
    lora = float(np.mean([r["lora"] for r in results["eval_loss"]]))
    return {"shift_px": {k: round(rightward_shift(read_media(relative_to / prompt[k])), 2) for k in ("base", "lora")},
            "eval_loss": {"base": base, "lora": lora, "change": (lora - base) / base}}


def quick() -> dict:
    """`loraflow demo` in this checkout on configs/demo.yaml at 8 steps and 2 denoising steps, every path under a
    temporary folder (no clone, no setup): that the demo and this benchmark's reading of it run."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="bench-demo-quick-") as tmp:
        root = Path(tmp)
        config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
        config.update(output_dir=str(root / "output"), cache_dir=str(root / "cache"), max_train_steps=8,
                      checkpointing_steps=1000, validation_num_inference_steps=2)
        config["datasets"][0]["instance_data_dir"] = str(root / "data")
        config["datasets"][1]["cache_dir"] = str(root / "cache" / "text")
        (root / "demo.yaml").write_text(yaml.safe_dump(config))
        (root / "dagster_home").mkdir()
        env = {**os.environ, "DAGSTER_HOME": str(root / "dagster_home")}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "loraflow.cli", "demo", "--config", str(root / "demo.yaml")],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"loraflow demo failed:\n{done.stderr[-4000:]}")
        return {"loraflow_demo_8_steps_s": round(time.perf_counter() - start, 1), **learnt(root / "output", ROOT)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="`loraflow demo` in this checkout, 8 steps")
    if parser.parse_args().quick:
        return record.write(OUT, quick(), quick=True)
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        clone = Path(tmp) / "loraflow"
        load_before = os.getloadavg()[0]  # these 2 cores are shared: the load says how quiet the host was
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        setup, _ = timed_make("setup", clone)
        first, log = timed_make("demo", clone)
        again, _ = timed_make("demo", clone)
        made_at = record.commit(clone)
        result = {
            "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                     "load_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
            "make_demo_fresh_clone_s": round(setup + first, 1),
            "setup_s": round(setup, 1),
            "tiny_world_pretraining_s": pretraining_seconds(log),
            "make_demo_again_s": round(again, 1),
            **learnt(clone / ".loraflow" / "output", clone),
        }
    record.write(OUT, result, made_at=made_at)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
