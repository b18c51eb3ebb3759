"""CPU benchmark: training's read of a 16-latent batch from the store on an S3 server on loopback vs a local store.

The latents are bench_latents.py's real size (Kandinsky 5 Video Lite, 5 s at 512x768: float32 16x31x64x96, 12.2 MB,
random normal values), written as the latents stage writes them (`Store.put` of SHARD_CLIPS rows per shard) to a local
folder and to a bucket of moto's S3 server (started here on loopback, as the tests start it: tests/servers.py), read
through s3fs. A batch is what training asks the store for (`Store.get` of 16 random keys, through one Store for the
whole run, so the shards' keys and footers are read once: one warm-up batch first). The two ways read their batches
interleaved, so load on a shared machine hits both alike. moto keeps objects in a Python process's memory: its speed
is not a real S3's; the number says what the client side (s3fs, ranged GETs of row groups) costs over loopback.

    .venv/bin/python benchmarks/bench_s3_read.py     # writes benchmarks/results/s3_read_cpu.json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow and tests/servers.py come from this checkout

from bench_latents import BATCH, K5_LITE_5S_LATENT, QUICK_LATENT, READ_BATCHES, timed  # noqa: E402

from benchmarks import record  # noqa: E402

RESULTS = record.results_path("s3_read_cpu.json")
WORK = ROOT / "benchmarks" / "out" / "s3_read"  # git-ignored
ITEMS = 48


def main() -> None:
    import numpy as np
    import pyarrow as pa
    import s3fs

    from loraflow.stages.latents.latents import SHARD_CLIPS
    from loraflow.store import Store
    from tests.servers import make_bucket, s3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=ITEMS, help="latents written to each store")
    parser.add_argument("--batches", type=int, default=READ_BATCHES, help="timed 16-key batches per store")
    parser.add_argument("--quick", action="store_true", help=f"{BATCH} small latents, 2 batches: that it runs")
    args = parser.parse_args()
    shape = QUICK_LATENT if args.quick else K5_LITE_5S_LATENT
    if args.quick:
        args.items, args.batches = BATCH, 2
    pa.set_cpu_count(1)
    shutil.rmtree(WORK, ignore_errors=True)
    rng = np.random.default_rng(0)
    rows = [{"key": f"k{i:04d}", "latent": rng.standard_normal(shape, dtype=np.float32)}
            for i in range(args.items)]
    item_mb = rows[0]["latent"].nbytes / 1e6
    with s3() as env:
        os.environ.update(env)
        stores = {"local": Store(str(WORK / "cache")), "s3": Store(make_bucket(env, f"bench-{uuid.uuid4().hex[:8]}"))}
        out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "pyarrow": pa.__version__, "s3fs": s3fs.__version__},
               "items": len(rows), "item_mb": round(item_mb, 2), "shape": list(shape), "batch": BATCH}
        for way, store in stores.items():
            _, seconds = timed(lambda: [store.put("latents", rows[s : s + SHARD_CLIPS])
                                        for s in range(0, len(rows), SHARD_CLIPS)])
            out[way] = {"write_mb_per_s": round(len(rows) * item_mb / seconds, 1)}
            store.get("latents", [r["key"] for r in rows[:BATCH]])  # warm-up: the index, as after a first step
        keys = [r["key"] for r in rows]
        times: dict[str, list[float]] = {way: [] for way in stores}
        for b in range(args.batches):
            batch = random.Random(b).sample(keys, BATCH)
            for way, store in stores.items():
                got, seconds = timed(lambda: store.get("latents", batch))
                times[way].append(seconds)
                assert all(np.array_equal(got[k]["latent"], rows[int(k[1:])]["latent"]) for k in batch), way
        for way in stores:
            median = statistics.median(times[way])
            out[way].update(read16_ms=round(median * 1e3, 1), read16_mb_per_s=round(BATCH * item_mb / median, 1))
        out["s3_vs_local_time"] = round(statistics.median(times["s3"]) / statistics.median(times["local"]), 2)
    shutil.rmtree(WORK, ignore_errors=True)
    record.write(RESULTS, out, quick=args.quick)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"{time.perf_counter() - started:.1f} s")
