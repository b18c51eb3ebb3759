"""CPU benchmark of the latents stage: encode throughput, and the store's write/read speed against raw `.npy`.

1. tiny pipeline (the tiny Kandinsky 5 Video checkpoint, the demo dataset at its demo config):
   latents/s of `encode_latents` from an empty latents cache (VAE load included; median of 3 fresh caches)
   and the time of a fully cached rerun (computed: 0), for `latent_sampling: mode` and `distribution`
   (mean + log-variance: twice the tensor bytes).
2. the store at a real latent size (Kandinsky 5 Video Lite, 5 s = 121 frames at 512x768 through the 4x temporal,
   8x spatial, 16-channel VAE: float32 (16, 31, 64, 96), 12.2 MB, as the stage stores it; random normal values,
   so compression finds little, as in real latents' mantissas): write `ITEMS` latents as the stage writes them
   (`Store.put` of SHARD_CLIPS rows per shard) vs one `np.save` file per latent; then read random batches of 16
   keys as training does (`Store.get` of 16 keys vs 16 `np.load(allow_pickle=False)`), from the page cache
   ("warm") and after evicting every file from it with POSIX_FADV_DONTNEED ("evicted": the guest's cache only; a
   VM host may still hold the bytes). Writes are timed to the page cache and again including `os.sync()`.
   `store_before_raw_cells` is the layout the store wrote before raw-bytes cells (Arrow fixed-shape tensor
   columns, zstd), written here by hand and read by today's `Store.get` (how a cache from then is read now).
   Each way reads its batches interleaved with the others' (round robin), so load on a shared machine hits all
   alike; `vs_npy` is the ratio of medians (npy time / this way's time: 1.0 = as fast as `.npy`).

One torch/Arrow thread by default: the machine is shared; numbers are for comparing, not absolute.

    .venv/bin/python benchmarks/bench_latents.py     # writes benchmarks/results/latents_cpu.json
    .venv/bin/python benchmarks/bench_latents.py --threads 2 --items 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from loraflow.pipelines.sources import model_source

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow comes from this checkout
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("latents_cpu.json")
WORK = ROOT / "benchmarks" / "out" / "latents"  # git-ignored
K5_LITE_5S_LATENT = (16, 31, 64, 96)  # (C, T, h, w): 121 frames at 512x768 through the 4x/8x VAE
QUICK_LATENT = (16, 5, 16, 24)  # --quick: a small latent, that the benchmark runs
ITEMS, BATCH, READ_BATCHES = 96, 16, 9


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def shard_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "latents" / "shards").glob("*.parquet"))


# 1. the stage on the tiny default -----------------------------------------------------------------------------
def tiny_stage(runs: int = 3) -> dict[str, Any]:
    import yaml

    from loraflow.config import parse_config
    from loraflow.demo.dataset import make_demo_dataset
    from loraflow.demo.tiny import build_tiny
    from loraflow.pipelines import get_family
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.store import Store

    model = build_tiny("kandinsky5-video", WORK / "model")
    data = make_demo_dataset(WORK / "data")
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw.update(pretrained_model_name_or_path=str(model), output_dir=str(WORK / "output"), cache_dir=str(WORK / "cache"))
    raw["datasets"][0]["instance_data_dir"] = str(data)
    raw["datasets"][1]["cache_dir"] = str(WORK / "cache" / "text")
    configs = {s: parse_config({**raw, "latent_sampling": s}) for s in ("mode", "distribution")}
    family, store = get_family(configs["mode"]), Store(str(WORK / "cache"))
    build_clips(configs["mode"], family, model_source(configs["mode"]), store)
    result: dict[str, Any] = {}
    for sampling, config in configs.items():
        first = []
        for _ in range(runs):
            shutil.rmtree(WORK / "cache" / "latents", ignore_errors=True)
            report, seconds = timed(lambda: encode_latents(config, family, model_source(config), store))
            first.append(seconds)
        cached = [timed(lambda: encode_latents(config, family, model_source(config), store)) for _ in range(runs)]
        assert all(r.computed == 0 for r, _ in cached), "a rerun with nothing changed computed latents"
        row = store.get("latents", [store.read_manifest("latents")[0]["key"]])
        result[sampling] = {
            "latents": report.computed, "latent_shape": list(next(iter(row.values()))["latent"].shape),
            "first_run_s": [round(s, 3) for s in first],
            "first_run_latents_per_s": round(report.computed / statistics.median(first), 2),
            "cached_rerun_s": round(statistics.median(s for _, s in cached), 3),
            "shard_bytes": shard_bytes(WORK / "cache"),
        }
    return result


# 2. the store vs raw .npy at a real latent size ---------------------------------------------------------------
def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages only: sync first)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def put_before_raw_cells(root: Path, rows: list[dict[str, Any]]) -> None:
    """One shard as the store wrote it before raw-bytes cells: a fixed-shape tensor column, every column zstd."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loraflow.store import ROW_GROUP_BYTES

    flat = pa.array(np.stack([r["latent"] for r in rows]).reshape(-1))
    storage = pa.FixedSizeListArray.from_arrays(flat, rows[0]["latent"].size)
    latent = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, rows[0]["latent"].shape), storage)
    table = pa.table({"key": [r["key"] for r in rows], "latent": latent})
    path = root / "latents" / "shards" / f"{uuid.uuid4().hex}.parquet"  # the store reads only its own shard names
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", use_dictionary=["key"],
                   row_group_size=max(1, ROW_GROUP_BYTES * table.num_rows // table.nbytes))


def store_vs_npy(latents: list) -> dict[str, Any]:
    import numpy as np

    from loraflow.stages.latents.latents import SHARD_CLIPS
    from loraflow.store import Store

    root = WORK / "real"
    rows = [{"key": f"k{i:04d}", "latent": latent} for i, latent in enumerate(latents)]
    shards = [rows[start : start + SHARD_CLIPS] for start in range(0, len(rows), SHARD_CLIPS)]  # as the stage writes
    (root / "npy").mkdir(parents=True)
    stores = {name: Store(str(root / name)) for name in ("store", "store_before_raw_cells")}
    ways = {  # name -> (write all, read a batch of keys, the files it wrote)
        "store": (lambda: [stores["store"].put("latents", shard) for shard in shards],
                  lambda keys: stores["store"].get("latents", keys),
                  lambda: sorted((root / "store").rglob("*.parquet"))),
        "store_before_raw_cells": (lambda: [put_before_raw_cells(root / "store_before_raw_cells", s) for s in shards],
                                   lambda keys: stores["store_before_raw_cells"].get("latents", keys),
                                   lambda: sorted((root / "store_before_raw_cells").rglob("*.parquet"))),
        "npy": (lambda: [np.save(root / "npy" / f"{r['key']}.npy", r["latent"], allow_pickle=False) for r in rows],
                lambda keys: {k: np.load(root / "npy" / f"{k}.npy", allow_pickle=False) for k in keys},
                lambda: sorted((root / "npy").glob("*.npy"))),
    }
    item_mb = latents[0].nbytes / 1e6
    out: dict[str, Any] = {"items": len(rows), "item_mb": round(item_mb, 2), "dtype": str(latents[0].dtype)}
    for way, (write, _, files) in ways.items():
        os.sync()
        _, seconds = timed(write)
        _, sync_s = timed(os.sync)
        out[way] = {"write_mb_per_s": round(len(rows) * item_mb / seconds, 1),
                    "write_with_sync_mb_per_s": round(len(rows) * item_mb / (seconds + sync_s), 1),
                    "bytes_on_disk": sum(p.stat().st_size for p in files())}
    batches = [random.Random(b).sample([r["key"] for r in rows], BATCH) for b in range(READ_BATCHES)]
    for cache in ("warm", "evicted"):
        times: dict[str, list[float]] = {way: [] for way in ways}
        for keys in batches:
            for way, (_, read, files) in ways.items():
                evict(files()) if cache == "evicted" else read(keys)  # warm: the batch's pages and index cached
                got, seconds = timed(lambda: read(keys))
                times[way].append(seconds)
                assert all(np.array_equal(got[k]["latent"] if way != "npy" else got[k], latents[int(k[1:])])
                           for k in keys), f"{way} returned other numbers"
        for way in ways:
            median = statistics.median(times[way])
            out[way][f"read16_{cache}_ms"] = round(median * 1e3, 1)
            out[way][f"read16_{cache}_mb_per_s"] = round(BATCH * item_mb / median, 1)
            out[way][f"read16_{cache}_vs_npy"] = round(statistics.median(times["npy"]) / median, 2)
    shutil.rmtree(root)
    return out


def real_size(items: int, shape: tuple[int, ...] = K5_LITE_5S_LATENT) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    latents = [rng.standard_normal(shape, dtype=np.float32) for _ in range(items)]
    return {"shape": list(shape), "float32": store_vs_npy(latents)}


def main() -> None:
    import pyarrow as pa
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch and Arrow CPU threads")
    parser.add_argument("--items", type=int, default=ITEMS, help="latents written per store/npy run")
    parser.add_argument("--quick", action="store_true", help=f"{BATCH} small latents {QUICK_LATENT}: that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pa.set_cpu_count(args.threads)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    started = time.perf_counter()
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__, "pyarrow": pa.__version__},
              "tiny_kandinsky5_video": tiny_stage(1 if args.quick else 3),
              "store_vs_npy_k5_lite_5s_latent": real_size(BATCH, QUICK_LATENT) if args.quick else real_size(args.items)}
    result["total_s"] = round(time.perf_counter() - started, 1)
    record.write(RESULTS, result, quick=args.quick)
    print(json.dumps(result, indent=2))
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
