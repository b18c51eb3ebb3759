"""CPU benchmark of everything that grows with the number of files: one dataset of 10k and of 100k clips.

The dataset is synthetic and made fast: one tiny PNG (16x16) copied N times, each with a caption file (100 distinct
captions, so text_embeds deduplicates 1,000 clips per text at 100k). The model is the tiny Kandinsky 5 Video
checkpoint of the demo config (t2v takes a still as a 1-frame clip). Each step runs in a fresh process, which
reports its wall time and its peak resident memory (ru_maxrss; `rss_base_mb` is the same process after its
imports, before the step, so `peak - base` is the step's own). Steps:

- `plan`: `loraflow check` (validate, list the folder, probe every file, bucket table); it has no probe cache;
- `probe_cold`, `probe_warm`: the clips stage's planning of the dataset (listing, captions, the store's `probes`
  cache, clip keys: `stages.clips.clips._plan_dataset`), from an empty store and again from the filled one; no decoding,
  which is per clip and measured by bench_decode.py;
- `manifest`: the planned rows written as the dataset's `clips` manifest part (`Store.write_manifest`), then read
  back in a fresh Store (`read_manifest`);
- `sensor`: `folder_state` of the folder (what `dataset_watch` hashes), then two ticks of the real sensor through
  `dagster.build_sensor_context` on an ephemeral instance: the first (no cursor: adds the partition and requests a
  run) and the next (its cursor and partition in place, nothing changed: skips);
- `text_embeds`: `encode_texts` once to fill the cache (100 texts plus the fixed prompts), then again with every
  text cached: what a re-materialization costs, deduplication of N clips' captions, keys, manifest and tables.

`growth_per_10x` is the 100k value over the 10k value: 10 is linear, 100 quadratic. Files live under /tmp and are
deleted after each size (100k: about 0.8 GB of 4 KiB blocks).

    .venv/bin/python benchmarks/bench_scale.py                 # writes benchmarks/results/scale_cpu.json
    .venv/bin/python benchmarks/bench_scale.py --sizes 1000    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loraflow.pipelines.sources import model_source

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow comes from this checkout
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("scale_cpu.json")
DATASET = "demo-videos"  # the demo config's training dataset, pointed at the synthetic folder
DISTINCT_CAPTIONS = 100
STEPS = ("plan", "probe_cold", "probe_warm", "manifest", "sensor", "text_embeds")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# 1. the synthetic dataset -------------------------------------------------------------------------------------
def make_dataset(folder: Path, n: int) -> None:
    """n copies of one 16x16 PNG, each with its caption; one fixed mtime (a copy is all the work)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    png = folder / "seed.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), np.uint8)).save(png)
    data = png.read_bytes()
    png.unlink()
    for i in range(n):
        (folder / f"img_{i:06d}.png").write_bytes(data)
        (folder / f"img_{i:06d}.txt").write_text(f"a small noisy square, picture {i % DISTINCT_CAPTIONS}")


def write_config(work: Path, model: Path) -> Path:
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    # t2v: the demo's i2v flavour trains on frames after the first, which images have not
    config.update(model_flavour="t2v-lite-sft-5s", pretrained_model_name_or_path=str(model),
                  output_dir=str(work / "output"), cache_dir=str(work / "cache"))
    config["datasets"][0].update(instance_data_dir=str(work / "data"), dataset_type="image", resolution=16,
                                 minimum_image_size=0)
    config["datasets"][0].pop("video", None)
    config["datasets"][1]["cache_dir"] = str(work / "cache" / "text")
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# 2. the steps, each in its own process ------------------------------------------------------------------------
def step(name: str, config_path: str) -> dict[str, Any]:
    """Run one step here; return its timings (seconds) and counts."""
    import io
    from contextlib import redirect_stdout

    from loraflow.config import load_config
    from loraflow.pipelines import get_family
    from loraflow.store import Store

    config = load_config(config_path)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    dataset = config.training_datasets[0]
    out: dict[str, Any] = {}
    if name == "plan":
        from loraflow.cli import check

        with redirect_stdout(io.StringIO()) as printed:
            code, out["s"] = timed(lambda: check(config_path))
        out["exit_code"] = code
        out["clips"] = int(printed.getvalue().split("total: ")[1].split(" clip")[0])
    elif name in ("probe_cold", "probe_warm"):
        from loraflow.media.frames import ProbeCache
        from loraflow.stages.clips.clips import _plan_dataset

        (rows, dropped), out["s"] = timed(lambda: _plan_dataset(config, family, model_source(config), dataset,
                                                                ProbeCache(store)))
        out["clips"], out["dropped"] = len(rows), len(dropped)
        out["probe_shards"] = len(store.shard_paths("probes"))
        if name == "probe_cold":  # the manifest step reads these rows
            Path(config.cache_dir, "planned.json").write_text(json.dumps([r.to_row() for r in rows]))
    elif name == "manifest":
        rows = json.loads(Path(config.cache_dir, "planned.json").read_text())
        _, out["write_s"] = timed(lambda: store.write_manifest("clips", rows, part=dataset.id))
        read, out["read_s"] = timed(lambda: Store(config.cache_dir, config.manifest_names).read_manifest(
            "clips", parts=[dataset.id]))
        out["rows"] = len(read)
        out["bytes"] = os.path.getsize(store.manifest_file("clips", dataset.id))
    elif name == "sensor":
        out.update(sensor_ticks(config_path, dataset.instance_data_dir or ""))
    elif name == "text_embeds":
        from loraflow.stages.text.text_embeds import encode_texts

        first, out["first_s"] = timed(lambda: encode_texts(config, family, model_source(config), store))
        again, out["s"] = timed(lambda: encode_texts(config, family, model_source(config), Store(config.cache_dir)))
        out.update(first_computed=first.computed, computed=again.computed, distinct_texts=again.distinct_texts)
    return out


def sensor_ticks(config_path: str, folder: str) -> dict[str, Any]:
    from dagster import DagsterInstance, build_sensor_context

    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.sensors import dataset_watch, folder_state

    state, seconds = timed(lambda: folder_state(folder))
    out: dict[str, Any] = {"folder_state_s": seconds, "files": state["files"]}
    with DagsterInstance.ephemeral() as instance:
        resources = {"loraflow": LoraflowResource(config_path=config_path)}
        context = build_sensor_context(instance=instance, resources=resources)
        first, out["first_tick_s"] = timed(lambda: dataset_watch(context))
        instance.add_dynamic_partitions("datasets", [DATASET])  # what the daemon does with the tick's request
        context = build_sensor_context(instance=instance, resources=resources, cursor=first.cursor)
        again, out["next_tick_s"] = timed(lambda: dataset_watch(context))
    out["first_tick_runs"], out["next_tick_runs"] = len(first.run_requests or []), len(again.run_requests or [])
    return out


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, round(time.perf_counter() - start, 3)


def run_step(name: str, config_path: Path) -> dict[str, Any]:
    """The step in a fresh process (fresh caches and a peak memory of its own)."""
    child = subprocess.run([sys.executable, __file__, "--step", name, "--config", str(config_path)],
                           capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        raise RuntimeError(f"step {name} failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


# 3. sizes, growth, the JSON -----------------------------------------------------------------------------------
def one_size(n: int, model: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"loraflow-scale-{n}-"))
    try:
        _, made = timed(lambda: make_dataset(work / "data", n))
        config_path = write_config(work, model)
        result: dict[str, Any] = {"files": 2 * n, "make_files_s": made}
        for name in STEPS:
            result[name] = run_step(name, config_path)
            print(f"{n} {name}: {result[name]}", file=sys.stderr, flush=True)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def growth(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    """large / small for every time and peak-over-base memory both sizes report."""
    out: dict[str, Any] = {}
    for name in STEPS:
        a, b = small[name], large[name]
        ratios = {k: round(b[k] / a[k], 1) for k in a if k.endswith("_s") or k == "s" if a[k] > 0.001}
        ratios["own_mb"] = round((b["peak_mb"] - b["base_mb"]) / max(a["peak_mb"] - a["base_mb"], 1.0), 1)
        out[name] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="clips per dataset")
    parser.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # the child process of run_step
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="100 and 1000 clips: that it runs")
    args = parser.parse_args()
    if args.quick:
        args.sizes = [100, 1000]
    if args.step:
        # loaded before the baseline, so the peak measures the step, not the imports
        import loraflow.assets.sensors  # noqa: F401
        import loraflow.cli  # noqa: F401
        import loraflow.stages.clips.clips  # noqa: F401

        base = peak_mb()
        out = step(args.step, args.config)
        print(json.dumps({**out, "base_mb": round(base), "peak_mb": round(peak_mb())}))
        return
    from loraflow.demo.tiny import build_tiny

    model = build_tiny("kandinsky5-video", ROOT / "benchmarks" / "out" / "scale-model")
    import pyarrow as pa
    import torch

    result: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                          "load_avg_1m_at_start": round(os.getloadavg()[0], 1),
                                          "torch": torch.__version__, "pyarrow": pa.__version__}}
    for n in args.sizes:
        result[str(n)] = one_size(n, model)
    if len(args.sizes) >= 2:
        result["growth_per_10x"] = growth(result[str(args.sizes[0])], result[str(args.sizes[1])])
    out = RESULTS if args.sizes == [10_000, 100_000] or args.quick else RESULTS.with_name("scale_cpu_other_sizes.json")
    record.write(out, result, quick=args.quick)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
