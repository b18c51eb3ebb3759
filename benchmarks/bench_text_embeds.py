"""CPU benchmark of the text_embeds stage: throughput, bytes on disk, and batch load time.

1. tiny pipeline (the tiny Kandinsky 5 Video checkpoint, 200 captions of realistic lengths):
   texts/s of `encode_texts` from an empty store (model load included) and of a second, fully cached run;
   bytes of our Parquet store vs one `torch.save` file per caption holding
     same_tokens  exactly the tensors we store (valid tokens only): the file format alone
     padded       the Qwen embeddings padded to the family's max_text_tokens plus a mask: what a
                  per-caption cache of the pipeline's padded output holds
   and the time to load one training batch (`store.get` of 16 keys) vs `torch.load` of 16 files.
2. real width (3584, Qwen2.5-VL-7B): synthetic float32 rows of the same token counts for 40 captions,
   Parquet vs torch.save per caption (same tensors): does the format still win when the tensors are big?
   Random values compress worse than real hidden states, so this is a conservative ratio.

Bytes are reported as file sizes ("bytes") and as allocated blocks ("disk": st_blocks * 512), which is
what many small files really cost. torch.save appears only here, as the baseline; the package never uses it.

`parquet_no_float_dictionary` rewrites our shards with Parquet dictionary encoding off for the float
columns (pyarrow's default tries a dictionary for every column; for float embeddings it only adds bytes):
what store.py would write with that one option.

One torch thread by default: on a shared 2-core machine with other load, two OpenMP threads ran the tiny
encoders ~30x slower than one (spin-waiting), which measures the neighbours, not this stage.

    .venv/bin/python benchmarks/bench_text_embeds.py     # writes benchmarks/results/text_embeds_cpu.json
    .venv/bin/python benchmarks/bench_text_embeds.py --threads 2
    .venv/bin/python benchmarks/bench_text_embeds.py --quick      # 20 captions, 8 at real width: that it runs
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loraflow.pipelines.sources import model_source

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow comes from this checkout
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("text_embeds_cpu.json")
WORK = ROOT / "benchmarks" / "out" / "text_embeds"  # git-ignored
CAPTIONS, REAL_CAPTIONS, REAL_DIM, BATCH = 200, 40, 3584, 16
WORDS = ("a woman in a red coat walks slowly along the wet street at night while neon signs reflect in "
         "puddles the camera follows her from behind with a shallow depth of field then pans left to "
         "reveal a tram passing by soft rain falls warm light cinematic footage handheld close-up").split()


def captions(n: int, seed: int = 0) -> list[str]:
    """Captions of 8..70 words (median ~30), like hand-written or VLM captions of short clips."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(min(70, max(8, int(rng.gauss(32, 14))))))
            for i in range(n)]


def sizes(paths: list[Path]) -> dict[str, int]:
    return {"bytes": sum(p.stat().st_size for p in paths), "disk": sum(p.stat().st_blocks * 512 for p in paths)}


def without_float_dictionary(shards: list[Path]) -> int:
    """Bytes of `shards` rewritten with dictionary encoding only for the non-tensor columns."""
    import pyarrow.parquet as pq

    total = 0
    for shard in shards:
        table = pq.read_table(shard)
        plain = [n for n in table.column_names if n.endswith("__shape") or not n.endswith("embeds")]
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd", use_dictionary=plain)
        total += buffer.tell()
    return total


def median_s(fn: Any, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_pipeline(count: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from loraflow.config import parse_config
    from loraflow.demo.tiny import build_tiny
    from loraflow.pipelines import get_family
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.store import Store
    from tests.factory import clip_row

    model = build_tiny("kandinsky5-video", WORK / "model")
    (WORK / "data").mkdir()
    config = parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(model),
                           "cache_dir": str(WORK / "cache"), "output_dir": str(WORK / "output"),
                           "datasets": [{"id": "d", "instance_data_dir": str(WORK / "data")}]})
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)  # the clips it lists
    texts = captions(count)
    store.write_manifest("clips", [clip_row(f"k{i}", "d", f"clip{i}.mp4", captions=(t,)).to_row()
                                   for i, t in enumerate(texts)])
    first = encode_texts(config, family, model_source(config), store)
    second_s = median_s(lambda: encode_texts(config, family, model_source(config), store), runs=3)
    manifest = store.read_manifest("text_embeds")
    rows = store.get("text_embeds", [r["key"] for r in manifest])
    same, padded = WORK / "torch_same", WORK / "torch_padded"
    same.mkdir(), padded.mkdir()
    for key, row in rows.items():
        tensors = {n: torch.from_numpy(np.asarray(row[n])) for n in ("text_embeds", "pooled_embeds")}
        torch.save(tensors, same / f"{key}.pt")
        full = torch.zeros(family.max_text_tokens, tensors["text_embeds"].shape[1])
        full[: row["n_tokens"]] = tensors["text_embeds"]
        mask = torch.arange(family.max_text_tokens) < row["n_tokens"]
        torch.save({"text_embeds": full, "mask": mask, "pooled_embeds": tensors["pooled_embeds"]}, padded / f"{key}.pt")
    shards = sorted((WORK / "cache" / "text_embeds" / "shards").glob("*.parquet"))
    ours, no_dict = sizes(shards), without_float_dictionary(shards)
    same_size, padded_size = sizes(sorted(same.glob("*.pt"))), sizes(sorted(padded.glob("*.pt")))
    batch = [r["key"] for r in random.Random(1).sample(manifest, BATCH)]
    load_store = median_s(lambda: store.get("text_embeds", batch))
    load_torch = median_s(lambda: [torch.load(same / f"{k}.pt", weights_only=True) for k in batch])
    tokens = [r["n_tokens"] for r in manifest]
    return {
        "texts": len(manifest), "text_dim": int(rows[batch[0]]["text_embeds"].shape[1]),
        "tokens_median": statistics.median(tokens), "tokens_max": max(tokens),
        "encode_first_run_texts_per_s": first.texts_per_s, "encode_first_run_s": first.seconds,
        "second_run_all_cached_s": round(second_s, 3), "tokens_histogram": [asdict(b) for b in first.tokens_histogram],
        "parquet": ours, "torch_save_same_tokens": same_size, "torch_save_padded": padded_size,
        "ratio_bytes_vs_same_tokens": round(ours["bytes"] / same_size["bytes"], 3),
        "ratio_disk_vs_same_tokens": round(ours["disk"] / same_size["disk"], 3),
        "ratio_bytes_vs_padded": round(ours["bytes"] / padded_size["bytes"], 3),
        "ratio_disk_vs_padded": round(ours["disk"] / padded_size["disk"], 3),
        "parquet_no_float_dictionary_bytes": no_dict,
        "ratio_no_float_dictionary_vs_same_tokens": round(no_dict / same_size["bytes"], 3),
        "ratio_no_float_dictionary_vs_padded": round(no_dict / padded_size["bytes"], 3),
        "load_batch16_store_get_ms": round(load_store * 1e3, 2),
        "load_batch16_torch_load_ms": round(load_torch * 1e3, 2),
    }


def real_width(token_counts: list[int]) -> dict[str, Any]:
    import numpy as np
    import torch

    from loraflow.store import Store

    rng = np.random.default_rng(0)
    store = Store(str(WORK / "real"))
    files = WORK / "real_torch"
    files.mkdir()
    rows = [{"key": f"r{i}", "text": f"caption {i}", "n_tokens": n,
             "text_embeds": (rng.standard_normal((n, REAL_DIM)) * 3).astype(np.float32),
             "pooled_embeds": rng.standard_normal(768).astype(np.float32)} for i, n in enumerate(token_counts)]
    for start in range(0, len(rows), BATCH):  # shards as the stage writes them
        store.put("text_embeds", rows[start : start + BATCH])
    for row in rows:
        torch.save({n: torch.from_numpy(row[n]) for n in ("text_embeds", "pooled_embeds")}, files / f"{row['key']}.pt")
    shards = sorted((WORK / "real" / "text_embeds" / "shards").glob("*.parquet"))
    ours, theirs, no_dict = sizes(shards), sizes(sorted(files.glob("*.pt"))), without_float_dictionary(shards)
    keys = [r["key"] for r in rows[:BATCH]]
    return {"texts": len(rows), "text_dim": REAL_DIM, "parquet": ours, "torch_save_same_tokens": theirs,
            "ratio_bytes": round(ours["bytes"] / theirs["bytes"], 3),
            "parquet_no_float_dictionary_bytes": no_dict,
            "ratio_no_float_dictionary": round(no_dict / theirs["bytes"], 3),
            "load_batch16_store_get_ms": round(median_s(lambda: store.get("text_embeds", keys), runs=3) * 1e3, 1),
            "load_batch16_torch_load_ms": round(median_s(
                lambda: [torch.load(files / f"{k}.pt", weights_only=True) for k in keys], runs=3) * 1e3, 1)}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="20 captions, 8 at real width: that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    tiny = tiny_pipeline(BATCH + 4 if args.quick else CAPTIONS)
    # real Qwen token counts are ~1.3 per word, not one per byte as in the tiny tokenizer
    real_tokens = [max(4, int(len(c.split()) * 1.3)) for c in captions(8 if args.quick else REAL_CAPTIONS)]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__},
              "tiny_kandinsky5_video": tiny, "real_width_synthetic": real_width(real_tokens)}
    record.write(RESULTS, result, quick=args.quick)
    print(json.dumps(result, indent=2))
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
