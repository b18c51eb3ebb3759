"""The latents and text_embeds caches: incremental, deduplicated, keyed by content, safe to kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.text.text_embeds import encode_texts
from tests.factory import REPO, demo_clips, uninterrupted_latents


def test_one_new_clip_computes_one_latent(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    extra = sorted(data.glob("*.mp4"))[0]
    extra_caption = extra.with_suffix(".txt")
    moved = tmp_path / "held_back"
    moved.mkdir()
    shutil.move(extra, moved / extra.name)
    shutil.move(extra_caption, moved / extra_caption.name)
    config, family, store = demo_clips(tiny_k5, data, tmp_path)
    first = encode_latents(config, family, model_source(config), store)
    shutil.move(moved / extra.name, extra)
    shutil.move(moved / extra_caption.name, extra_caption)
    clips = build_clips(config, family, model_source(config), store)
    assert clips.computed == 1  # only the returned video is decoded
    second = encode_latents(config, family, model_source(config), store)
    assert (second.computed, second.reused) == (1, first.computed)


def test_captions_are_encoded_once_per_distinct_text(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config, family, store = demo_clips(tiny_k5, demo_data, tmp_path)
    clip = store.read_manifest("clips")[0]
    captions = ["a red circle", "a blue square", "a red circle"]
    store.write_manifest("clips", [{**clip, "key": f"k{i}", "captions": [captions[i % 3]]} for i in range(100)])
    report = encode_texts(config, family, model_source(config), store)
    texts = [row["text"] for row in store.read_manifest("text_embeds")]
    # 2 distinct captions + the empty prompt + the negative prompt + the validation prompt
    assert sorted(texts) == sorted({"a red circle", "a blue square", "", family.default_negative_prompt,
                                    config.validation_prompt})
    assert report.computed == len(texts) == len(store.keys("text_embeds"))


def test_a_changed_text_encoder_re_encodes_texts_but_not_latents(tiny_k5: Path, demo_data: Path,
                                                                 tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_k5, model)
    config, family, store = demo_clips(model, demo_data, tmp_path)
    encode_latents(config, family, model_source(config), store)
    encode_texts(config, family, model_source(config), store)
    weights = next((model / "text_encoder_2").glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new checkpoint file in place
    assert encode_texts(config, family, model_source(config), store).computed > 0
    assert encode_latents(config, family, model_source(config), store).computed == 0
    assert encode_texts(config, family, model_source(config), store).computed == 0


KILLABLE = """
import sys
from loraflow.config import load_config
from loraflow.stages.latents.latents import encode_latents
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
config = load_config(sys.argv[1])
encode_latents(config, get_family(config), model_source(config), Store(config.cache_dir), shard_clips=1)
"""


def test_killed_latent_run_resumes_without_corrupt_or_duplicate_keys(tiny_k5: Path, demo_data: Path,
                                                                     tmp_path: Path) -> None:
    config, family, store = demo_clips(tiny_k5, demo_data, tmp_path)
    shards = Path(config.cache_dir) / "latents" / "shards"
    worker = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tmp_path / "config.yaml")], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not list(shards.glob("*.parquet")) and time.time() < deadline and worker.poll() is None:
        time.sleep(0.05)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    committed = store.keys("latents")
    total = len(store.read_manifest("clips"))
    assert 1 <= len(committed) < total, "the kill should land after the first shard and before the last"
    report = encode_latents(config, family, model_source(config), store)
    assert report.computed == total - len(committed)
    keys = [row["key"] for row in store.read_manifest("latents")]
    assert len(keys) == len(set(keys)) == len(store.keys("latents")) == total
    in_shards = [key for shard in store.shard_paths("latents")
                 for key in pq.read_table(shard, columns=["key"])["key"].to_pylist()]
    assert sorted(in_shards) == sorted(keys)  # each latent committed once: the resumed run wrote only the rest
    reference = uninterrupted_latents(tiny_k5, demo_data, tmp_path / "reference", keys)
    for key, row in store.get("latents", keys).items():
        assert np.array_equal(row["latent"], reference[key]), key
