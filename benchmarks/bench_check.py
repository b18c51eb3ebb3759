"""`loraflow check`'s wall time, first and second run: the demo config and two released configs before download.

Each check is `python -m loraflow.cli check CONFIG` in a fresh process, as a user types it, with its own empty
estimates cache (`LORAFLOW_ESTIMATES_CACHE`): the first run computes the estimates (the fake-tensor traces of the
stages and of the switch list), the second reads them back (`estimates.remembered`). Then `--no-estimates` on the
demo config (the plan alone). The configs:
- demo: configs/demo.yaml on a tiny Kandinsky 5 Video i2v checkpoint (`build_tiny`: the demo's architecture; the
  pre-trained tiny world has the same configs, so the same estimates) and the demo dataset;
- Kandinsky 5 Pro t2v 5 s HD and HunyuanVideo 1.5 720p t2v, not downloaded (an empty Hugging Face cache, offline:
  check estimates from the released config files in loraflow/pipelines/released/), with no clips yet (so at the
  bucket the dataset asks for: 512x512, 61 frames),
  `gradient_checkpointing: true`, `base_model_precision: fp8-layerwise`, `gpu_memory_gb: 24` (so the switch list
  and the render plan for the card are computed too): what a user with a 24 GB card checks before downloading.
A check of a model not downloaded exits 2 (it says the model is missing) after printing its estimates.
Each time is the wall time and the CPU time (user + system) of the check's process: on a shared host the CPU time
moves less with the load than the wall time. `--before TREE` (a checkout of an earlier commit, its git-ignored
tokenizer folder `.loraflow` copied in) runs every check there too, interleaved with this tree's (before's first,
this first, before's second, this second), so that both meet the same load: the rows carry its times beside.

    .venv/bin/python benchmarks/bench_check.py      # writes benchmarks/results/check_cpu.json (minutes)
    git worktree add /tmp/before HEAD~1 && cp -r .loraflow /tmp/before/ && \
        .venv/bin/python benchmarks/bench_check.py --before /tmp/before
    .venv/bin/python benchmarks/bench_check.py --quick   # the demo config only: that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

OUT = record.results_path("check_cpu.json")
RELEASED = {"kandinsky5-video t2v-pro-sft-5s-hd": ("kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers",
                                                   "kandinsky5-video", "t2v-pro-sft-5s-hd"),
            "hunyuanvideo-1.5 t2v-720p": ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
                                          "hunyuanvideo-1.5", "t2v-720p")}


def timed_check(config: Path, cache: Path, *flags: str, tree: Path = ROOT) -> tuple[float, float, int, str]:
    """(wall s, CPU s, exit code, output) of `loraflow check` of the `tree` checkout (its loraflow: the cwd)."""
    env = {**os.environ, "LORAFLOW_ESTIMATES_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(cache.parent / "hub")}
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "loraflow.cli", "check", str(config), *flags], cwd=tree, env=env,
                          capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, done.returncode, \
        done.stdout + done.stderr


def configs(root: Path) -> dict[str, Path]:
    from loraflow.demo.dataset import make_demo_dataset
    from loraflow.demo.tiny import build_tiny

    data = make_demo_dataset(root / "data")
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    model = build_tiny("kandinsky5-video", root / "tiny", flavour=demo["model_flavour"])
    demo.update(pretrained_model_name_or_path=str(model), output_dir=str(root / "output"),
                cache_dir=str(root / "cache"))
    demo["datasets"][0]["instance_data_dir"] = str(data)
    demo["datasets"][1]["cache_dir"] = str(root / "cache" / "text")
    found = {"demo": root / "demo.yaml"}
    found["demo"].write_text(yaml.safe_dump(demo))
    for name, (repo, family, flavour) in RELEASED.items():
        released = {**demo, "model_family": family, "model_flavour": flavour, "pretrained_model_name_or_path": repo,
                    "gradient_checkpointing": True, "base_model_precision": "fp8-layerwise", "gpu_memory_gb": 24,
                    "validation_resolution": "768x512"}
        # no clips yet (an empty folder): check estimates at the bucket the dataset asks for, 512x512@61
        (root / "empty").mkdir(exist_ok=True)
        released["datasets"] = [{**demo["datasets"][0], "instance_data_dir": str(root / "empty"), "resolution": 512,
                                 "video": {**demo["datasets"][0]["video"], "num_frames": 61, "min_frames": 61}},
                                demo["datasets"][1]]
        found[name] = root / f"{flavour}.yaml"
        found[name].write_text(yaml.safe_dump(released))
    return found


def first_and_second(name: str, config: Path, cache: Path, trees: dict[str, Path]) -> dict[str, dict]:
    """Each tree's first check (empty estimates cache), then each one's second (the cache it wrote)."""
    times: dict[str, dict] = {label: {} for label in trees}
    for run in ("first", "second"):
        for label, tree in trees.items():
            wall, cpu, code, log = timed_check(config, cache / label, tree=tree)
            if code not in (0, 2) or (run == "second" and "reused from" not in log):
                sys.exit(f"{run} check of {name} in {tree} failed (exit {code}):\n{log[-3000:]}")
            times[label].update({f"{run}_s": round(wall, 1), f"{run}_cpu_s": round(cpu, 1), "exit": code})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit, checked interleaved")
    parser.add_argument("--quick", action="store_true", help="the demo config only: that it runs")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "now": ROOT} if args.before else {"now": ROOT}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        for name, config in configs(Path(tmp)).items():
            if args.quick and name != "demo":
                continue
            times = first_and_second(name, config, Path(tmp) / "estimates" / name.replace(" ", "-"), trees)
            row = {"config": name, **times["now"]}
            if name == "demo":
                plan, _, _, _ = timed_check(config, Path(tmp) / "estimates" / "demo" / "now", "--no-estimates")
                row["no_estimates_s"] = round(plan, 2)
            if args.before:
                row["before"] = times["before"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    host = {"cores": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    result = {"host": host, "rows": rows}
    if args.before:
        result["before"] = subprocess.run(["git", "log", "-1", "--format=%H"], cwd=args.before, capture_output=True,
                                          text=True).stdout.strip() or str(args.before)
    record.write(OUT, result, quick=args.quick)


if __name__ == "__main__":
    main()
