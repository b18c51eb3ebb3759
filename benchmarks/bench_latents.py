"""CPU benchmark of the latents stage: encode throughput, and the store's write/read speed against raw `.npy`.

1. tiny pipeline (the tiny Kandinsky 5 Video checkpoint, the demo dataset at its demo config):
   latents/s of `encode_latents` from an empty latents cache (VAE load included; median of 3 fresh caches)
   and the time of a fully cached rerun (computed: 0), for `latent_sampling: mode` and `distribution`
   (mean + log-variance: twice the tensor bytes).
2. the store at a real latent size (Kandinsky 5 Video, 61 frames at 480x720: float32 (16, 16, 60, 90),
   5.5 MB; random normal values, so compression finds little, as in real latents' mantissas):
   write `ITEMS` latents as the stage writes them (`Store.put` of SHARD_CLIPS rows per shard) vs one
   `np.save` file per latent; then read random batches of 16 keys as training does (`Store.get` of 16 keys
   vs 16 `np.load(allow_pickle=False)`), from the page cache ("warm") and after evicting every file from
   it with POSIX_FADV_DONTNEED ("evicted": the guest's cache only; a VM host may still hold the bytes).
   Writes are timed to the page cache and again including `os.sync()`. `bf16_as_uint16` repeats this with
   the same latents as bf16 bit patterns (uint16): what a bf16 cache would cost (the stage stores float32).
   Reads report the useful bytes (16 latents) per second; a Parquet shard is read whole, so `Store.get`
   reads about `shards_read_per_batch` x SHARD_CLIPS latents to return 16.
   Two what-ifs for store.py, same shards (SHARD_CLIPS rows, zstd): `parquet_binary` holds each latent as
   one raw-bytes cell (`large_binary`) instead of a fixed-shape tensor column (which Parquet encodes as a
   list, with repetition/definition levels per value), read the same way (key columns, then whole shards);
   `parquet_binary_row_groups` also writes one row group per latent and reads only the row groups of the
   wanted keys, so a batch no longer reads its shards' other latents.

One torch/Arrow thread by default: the machine is shared; numbers are for comparing, not absolute.

    .venv/bin/python benchmarks/bench_latents.py     # writes benchmarks/results/latents_cpu.json
    .venv/bin/python benchmarks/bench_latents.py --threads 2 --items 100
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow comes from this checkout
RESULTS = ROOT / "benchmarks" / "results" / "latents_cpu.json"
WORK = ROOT / "benchmarks" / "out" / "latents"  # git-ignored
K5_VIDEO_LATENT = (16, 16, 60, 90)  # (C, T, h, w): 61 frames at 480x720 through the 8x/4x VAE
ITEMS, BATCH, READ_BATCHES = 200, 16, 5


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def shard_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "latents" / "shards").glob("*.parquet"))


# 1. the stage on the tiny default -----------------------------------------------------------------------------
def tiny_stage() -> dict[str, Any]:
    import yaml

    from loraflow.config import parse_config
    from loraflow.ops.clips import build_clips
    from loraflow.ops.demo_data import make_demo_dataset
    from loraflow.ops.latents import encode_latents
    from loraflow.pipelines import get_family
    from loraflow.pipelines.tiny import build_tiny
    from loraflow.store import Store

    model = build_tiny("kandinsky5-video", WORK / "model")
    data = make_demo_dataset(WORK / "data")
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw.update(pretrained_model_name_or_path=str(model), output_dir=str(WORK / "output"), cache_dir=str(WORK / "cache"))
    raw["datasets"][0]["instance_data_dir"] = str(data)
    raw["datasets"][1]["cache_dir"] = str(WORK / "cache" / "text")
    configs = {s: parse_config({**raw, "latent_sampling": s}) for s in ("mode", "distribution")}
    family, store = get_family(configs["mode"]), Store(str(WORK / "cache"))
    build_clips(configs["mode"], family, store)
    result: dict[str, Any] = {}
    for sampling, config in configs.items():
        first = []
        for _ in range(3):
            shutil.rmtree(WORK / "cache" / "latents", ignore_errors=True)
            report, seconds = timed(lambda: encode_latents(config, family, store))
            first.append(seconds)
        cached = [timed(lambda: encode_latents(config, family, store)) for _ in range(3)]
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


class BinaryShards:
    """The what-if: Parquet shards whose latent column holds each tensor's raw bytes (one cell per latent)."""

    def __init__(self, root: Path, shape: tuple[int, ...], dtype: Any, row_groups: bool) -> None:
        self.root, self.shape, self.dtype, self.row_groups = root, shape, dtype, row_groups
        root.mkdir(parents=True)

    def put(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"key": [r["key"] for r in rows],
                          "latent": pa.array([r["latent"].tobytes() for r in rows], type=pa.large_binary())})
        pq.write_table(table, self.root / f"{rows[0]['key']}.parquet", compression="zstd", use_dictionary=["key"],
                       row_group_size=1 if self.row_groups else None)

    def get(self, keys: list[str]) -> dict[str, Any]:
        import numpy as np
        import pyarrow.parquet as pq

        wanted, found = set(keys), {}
        for shard in sorted(self.root.glob("*.parquet")):
            shard_keys = pq.read_table(shard, columns=["key"]).column("key").to_pylist()
            hits = [i for i, k in enumerate(shard_keys) if k in wanted]
            if hits:
                # one row per row group: read just those; else the whole shard, then take, as Store.get does
                if self.row_groups:
                    table = pq.ParquetFile(shard).read_row_groups(hits)
                else:
                    table = pq.read_table(shard).take(hits)
                for key, cell in zip(table.column("key").to_pylist(), table.column("latent")):
                    found[key] = np.frombuffer(cell.as_buffer(), self.dtype).reshape(self.shape)
        return found


def store_vs_npy(latents: list, name: str) -> dict[str, Any]:
    import numpy as np

    from loraflow.ops.latents import SHARD_CLIPS
    from loraflow.store import Store

    root, npy = WORK / name, WORK / name / "npy"
    npy.mkdir(parents=True)
    store = Store(str(root / "store"))
    binary, grouped = (BinaryShards(root / f"binary{g}", latents[0].shape, latents[0].dtype, g) for g in (0, 1))
    rows = [{"key": f"k{i:04d}", "latent": latent} for i, latent in enumerate(latents)]
    shards = [rows[start : start + SHARD_CLIPS] for start in range(0, len(rows), SHARD_CLIPS)]  # as the stage writes
    item_mb = latents[0].nbytes / 1e6
    ways = {  # name -> (write all, read a batch of keys, the files it wrote)
        "store": (lambda: [store.put("latents", shard) for shard in shards],
                  lambda keys: store.get("latents", keys), lambda: sorted((root / "store").rglob("*.parquet"))),
        "parquet_binary": (lambda: [binary.put(shard) for shard in shards],
                           binary.get, lambda: sorted(binary.root.glob("*.parquet"))),
        "parquet_binary_row_groups": (lambda: [grouped.put(shard) for shard in shards],
                                      grouped.get, lambda: sorted(grouped.root.glob("*.parquet"))),
        "npy": (lambda: [np.save(npy / f"{r['key']}.npy", r["latent"], allow_pickle=False) for r in rows],
                lambda keys: [np.load(npy / f"{k}.npy", allow_pickle=False) for k in keys],
                lambda: sorted(npy.glob("*.npy"))),
    }
    batches = [random.Random(b).sample([r["key"] for r in rows], BATCH) for b in range(READ_BATCHES)]
    out: dict[str, Any] = {"items": len(rows), "item_mb": round(item_mb, 2), "dtype": str(latents[0].dtype)}
    for way, (write, read, files) in ways.items():
        os.sync()
        _, seconds = timed(write)
        _, sync_s = timed(os.sync)
        out[way] = {"write_items_per_s": round(len(rows) / seconds, 1),
                    "write_mb_per_s": round(len(rows) * item_mb / seconds, 1),
                    "write_with_sync_mb_per_s": round(len(rows) * item_mb / (seconds + sync_s), 1),
                    "bytes_on_disk": sum(p.stat().st_size for p in files())}
        for cache in ("warm", "evicted"):
            times = []
            for keys in batches:
                evict(files()) if cache == "evicted" else read(keys)  # warm: the batch's pages cached
                times.append(timed(lambda: read(keys))[1])
            median = statistics.median(times)
            out[way][f"read16_{cache}_ms"] = round(median * 1e3, 1)
            out[way][f"read16_{cache}_items_per_s"] = round(BATCH / median, 1)
            out[way][f"read16_{cache}_mb_per_s"] = round(BATCH * item_mb / median, 1)
        first = batches[0][0]
        got = read([first])
        got = got[first] if isinstance(got, dict) else got[0]
        got = got["latent"] if isinstance(got, dict) else got
        assert np.array_equal(got, rows[int(first[1:])]["latent"]), f"{way} returned other numbers"
    shard_of = {r["key"]: i // SHARD_CLIPS for i, r in enumerate(rows)}
    out["shards_read_per_batch"] = statistics.median(len({shard_of[k] for k in keys}) for keys in batches)
    shutil.rmtree(root)
    return out


def real_size(items: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    float32 = [rng.standard_normal(K5_VIDEO_LATENT, dtype=np.float32) for _ in range(items)]
    result = {"shape": list(K5_VIDEO_LATENT), "float32": store_vs_npy(float32, "float32")}
    bf16 = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in float32]  # bf16 bits (truncated)
    del float32
    result["bf16_as_uint16"] = store_vs_npy(bf16, "bf16")
    return result


def main() -> None:
    import pyarrow as pa
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch and Arrow CPU threads")
    parser.add_argument("--items", type=int, default=ITEMS, help="latents written per store/npy run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pa.set_cpu_count(args.threads)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    started = time.perf_counter()
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__, "pyarrow": pa.__version__},
              "tiny_kandinsky5_video": tiny_stage(), "store_vs_npy_k5_video_latent": real_size(args.items)}
    result["total_s"] = round(time.perf_counter() - started, 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
