"""The text_embeds store: resumable after SIGKILL, truncation counted, length batching exact, schema as documented.

Dedupe and fingerprint invalidation are in tests/stages/test_caching.py; encoder parity per family in
tests/pipelines/test_families.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from loraflow.contracts.clip_rows import PairedImage
from loraflow.contracts.reports import TruncatedText
from loraflow.contracts.text_set import TextSetRow
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.text.text_embeds import encode_texts, load_encoders, needed_texts, truncation_table
from loraflow.store import Store
from tests.factory import REPO, clip_row, config_for


def setup(model: Path, data: Path, root: Path, captions: list[str] | None = None, **overrides):
    """Config, family and store with clips built; `captions` replace the clips' captions (one clip each)."""
    config = config_for(model, data, root, **overrides)
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model_source(config), store)
    if captions is not None:
        clip = store.read_manifest("clips")[0]
        store.write_manifest("clips", [{**clip, "key": f"k{i}", "path": f"/data/clip{i}.mp4", "captions": [c]}
                                       for i, c in enumerate(captions)])
    return config, family, store


KILLABLE = """
import sys
from loraflow.config import load_config
from loraflow.contracts.reports import TruncatedText
from loraflow.contracts.text_set import TextSetRow
from loraflow.stages.text.text_embeds import encode_texts
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
config = load_config(sys.argv[1])
encode_texts(config, get_family(config), model_source(config), Store(config.cache_dir), batch_texts=1)
"""


def test_killed_text_run_resumes_without_duplicate_or_missing_keys(tiny_k5: Path, demo_data: Path,
                                                                   tmp_path: Path) -> None:
    captions = [f"caption number {i} " + "word " * (i % 7) for i in range(120)]
    config, family, store = setup(tiny_k5, demo_data, tmp_path, captions)
    shards = Path(config.cache_dir) / "text_embeds" / "shards"
    worker = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tmp_path / "config.yaml")], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not list(shards.glob("*.parquet")) and time.time() < deadline and worker.poll() is None:
        time.sleep(0.01)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    committed = store.keys("text_embeds")
    total = len(needed_texts(config, family, model_source(config), store))
    assert 1 <= len(committed) < total, "the kill should land after the first shard and before the last"
    report = encode_texts(config, family, model_source(config), store)
    assert (report.computed, report.reused) == (total - len(committed), len(committed))
    keys = [row["key"] for row in store.read_manifest("text_embeds")]
    assert len(keys) == len(set(keys)) == len(store.keys("text_embeds")) == total
    # no key committed twice: the rerun only wrote what the killed run had not
    all_keys = [k for shard in shards.glob("*.parquet")
                for k in pq.read_table(shard, columns=["key"])["key"].to_pylist()]
    assert len(all_keys) == len(set(all_keys)) == total
    assert all(np.isfinite(row["text_embeds"]).all() for row in store.get("text_embeds", keys).values())


def test_a_caption_over_the_token_limit_is_truncated_and_counted(tiny_k5: Path, demo_data: Path,
                                                                 tmp_path: Path) -> None:
    family = get_family(config_for(tiny_k5, demo_data, tmp_path, name="c.yaml"))
    long = "x" * (family.max_text_tokens + 50)  # the tiny tokenizer is byte-level: one token per character
    config, family, store = setup(tiny_k5, demo_data, tmp_path, ["a short caption", long, long])
    report = encode_texts(config, family, model_source(config), store)
    assert report.truncated_texts == 1
    (row,) = report.truncated
    assert row.files == "/data/clip1.mp4, /data/clip2.mp4" and row.limit == family.max_text_tokens
    manifest = {r["text"]: r for r in store.read_manifest("text_embeds")}
    assert manifest[long]["truncated"] and not manifest["a short caption"]["truncated"]
    stored = store.get("text_embeds", [manifest[long]["key"]])[manifest[long]["key"]]
    assert stored["truncated"] and stored["n_tokens"] == len(stored["text_embeds"]) == family.max_text_tokens
    again = encode_texts(config, family, model_source(config), store)  # reused rows are still counted
    assert again.computed == 0 and again.truncated == report.truncated


def test_an_i2i_caption_cut_beside_one_source_lists_only_that_sources_files(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "cache"))  # the same caption with two source images: two items, one cut
    source = PairedImage("", "", (64, 64), (0, 0, 64, 64))
    store.write_manifest("clips", [clip_row(f"k{i}", "d", path=f"/data/t{i}.png", captions=("cap",),
                                            condition=replace(source, key=f"src{i}")).to_row() for i in (1, 2)])
    rows = [TextSetRow(key="a", text="cap", image="src1", n_tokens=9, truncated=True),
            TextSetRow(key="b", text="cap", image="src2", n_tokens=7, truncated=False)]
    assert truncation_table(rows, store, 9) == (TruncatedText(text="cap", tokens_kept=9, limit=9,
                                                              files="/data/t1.png"),)


def test_batching_by_length_gives_the_embeddings_of_one_at_a_time(tiny_k5: Path, demo_data: Path,
                                                                   tmp_path: Path) -> None:
    captions = ["a cat", "a much longer caption about a dog running on a beach at sunset", "a red ball rolls",
                'a sign that says "open"', "z" * 90]
    config, family, store = setup(tiny_k5, demo_data, tmp_path, captions)
    report = encode_texts(config, family, model_source(config), store, batch_texts=4)
    assert report.computed == len(needed_texts(config, family, model_source(config), store)) > 4  # more than one batch
    components = load_encoders(config, family, model_source(config), torch.device("cpu"))
    manifest = store.read_manifest("text_embeds")
    stored = store.get("text_embeds", [r["key"] for r in manifest])
    # bit for bit by construction: the family encodes one text at a time, unpadded, inside any batch (Kandinsky 5's
    # transformer has no text mask), so a batch runs each text through the same kernels on the same shapes
    for row in manifest:
        (alone,) = family.encode_text(components, [row["text"]])
        for name, value in alone.items():
            np.testing.assert_array_equal(stored[row["key"]][name], value, err_msg=f"{name} of {row['text']!r}")
    histogram = report.tokens_histogram
    assert sum(b.texts for b in histogram) == report.distinct_texts == len(manifest)


def test_store_rows_have_the_documented_columns_and_no_padding(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config, family, store = setup(tiny_k5, demo_data, tmp_path, ["short", "a somewhat longer caption here"])
    report = encode_texts(config, family, model_source(config), store)
    shards = sorted((Path(config.cache_dir) / "text_embeds" / "shards").glob("*.parquet"))
    table = pq.read_table(shards[0])
    assert {"key", "text", "image", "family", "encoders", "precision", "n_tokens", "truncated", "text_embeds",
            "text_embeds__shape", "pooled_embeds"} <= set(table.column_names)
    assert report.bytes_on_disk == sum(s.stat().st_size for s in shards) > 0
    manifest = store.read_manifest("text_embeds")
    assert set(manifest[0]) == {"key", "text", "image", "n_tokens", "truncated"}
    rows = store.get("text_embeds", [r["key"] for r in manifest])
    lengths = {r["n_tokens"] for r in rows.values()}
    assert len(lengths) > 1  # valid tokens only: different texts, different lengths
    for row in rows.values():
        assert row["text_embeds"].shape[0] == row["n_tokens"] and row["family"] == family.name


@pytest.mark.parametrize("precision", ["bf16", "int8-torchao"])
def test_a_lower_precision_text_encoder_is_its_own_cache_entry(tiny_k5: Path, demo_data: Path, tmp_path: Path,
                                                               precision: str) -> None:
    config, family, store = setup(tiny_k5, demo_data, tmp_path, ["a blue bird on a wire"])
    fp32 = encode_texts(config, family, model_source(config), store)
    before = {r["text"]: r["key"] for r in store.read_manifest("text_embeds")}
    config_low = config.model_copy(update={"text_encoder_1_precision": precision})
    low = encode_texts(config_low, family, model_source(config_low), store)
    assert low.computed == fp32.computed and low.reused == 0  # a different precision is a different key
    after = {r["text"]: r["key"] for r in store.named(config_low.manifest_names).read_manifest("text_embeds")}
    assert {r["text"]: r["key"] for r in store.named(config.manifest_names).read_manifest("text_embeds")} == before
    text = "a blue bird on a wire"
    rows = store.get("text_embeds", [before[text], after[text]])
    full, half = rows[before[text]], rows[after[text]]
    assert (full["precision"], half["precision"]) == ("fp32", precision) and half["text_embeds"].dtype == np.float32
    assert full["text_embeds"].shape == half["text_embeds"].shape
    assert not np.array_equal(full["text_embeds"], half["text_embeds"])  # the lower precision really ran
    cosine = (full["text_embeds"] * half["text_embeds"]).sum(-1) / (
        np.linalg.norm(full["text_embeds"], axis=-1) * np.linalg.norm(half["text_embeds"], axis=-1))
    # A relative error r keeps the cosine >= 1 - r^2 / 2. The format rounds each value by at most `unit` of it (bf16:
    # 2^-9; int8 weights: half a 1/127 step of their channel's largest, 1/254), and the tiny 3-layer encoder is about
    # 16 roundings deep (embedding, per layer 2 norms, attention and MLP, the final norm): r <= 16 unit (measured 3.7
    # and 1.7 units), whatever kernels run the lower precision.
    unit = {"bf16": 2**-9, "int8-torchao": 1 / 254}[precision]
    assert cosine.min() > 1 - (16 * unit) ** 2 / 2


def test_int8_text_encoder_holds_its_linear_weights_in_int8(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config, family, _ = setup(tiny_k5, demo_data, tmp_path, [])
    cpu = torch.device("cpu")
    encoders = {p: load_encoders(config.model_copy(update={"text_encoder_1_precision": p}), family,
                                 model_source(config), cpu)
                for p in ("bf16", "int8-torchao")}
    linear = {p: [m.weight for m in e["text_encoder"].modules() if isinstance(m, torch.nn.Linear)]
              for p, e in encoders.items()}
    assert linear["int8-torchao"] and all(w.qdata.dtype == torch.int8 for w in linear["int8-torchao"])
    assert all(w.dtype == torch.bfloat16 for w in linear["bf16"])
    assert encoders["int8-torchao"]["text_encoder_2"].dtype == torch.float32  # only the first encoder
