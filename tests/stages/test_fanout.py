"""One dataset cached by 4 worker processes at once (stages/shard_worker.py): real processes, one of them SIGKILLed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loraflow.config import load_config
from loraflow.keys import Shard
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import SHARD_CLIPS, latent_rows
from loraflow.store import Store
from tests.factory import REPO, demo_dict, many_clips, write_config

WORKERS, COPIES = 4, 12  # 12 copies of the 7 demo files: 84 clips, about 21 per worker, so 3 store shards each


def worker(config: Path, shard: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loraflow.cli", "cache", str(config), "--dataset", "demo-videos",
                             "--shard", shard], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def committed_by_shard(shards: Path, owner: dict[str, int]) -> dict[int, list[str]]:
    """Every committed latent key, by the shard that owns its clip (a key in two store shards is listed twice)."""
    keys = [k for path in shards.glob("*.parquet") for k in pq.read_table(path, columns=["key"])["key"].to_pylist()]
    assert set(keys) <= owner.keys(), "a worker wrote a latent of no clip of the dataset"
    return {i: [k for k in keys if owner[k] == i] for i in range(WORKERS)}


def test_four_workers_cache_one_dataset_and_a_killed_one_resumes_its_share_only(
    tiny_k5: Path, demo_data: Path, tmp_path: Path
) -> None:
    data = many_clips(demo_data, tmp_path / "data", COPIES)
    config_path = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, data, tmp_path))
    config = load_config(config_path)
    store = Store(config.cache_dir, config.manifest_names)
    build_clips(config, get_family(config), model_source(config), store, datasets=["demo-videos"])
    rows = latent_rows(config, get_family(config), model_source(config), store, ["demo-videos"])
    owner = {r.key: next(i for i in range(WORKERS) if Shard(i, WORKERS).owns(r.clip_key)) for r in rows}
    share = {i: sum(1 for o in owner.values() if o == i) for i in range(WORKERS)}
    assert len(rows) == 7 * COPIES and min(share.values()) > SHARD_CLIPS, share  # every worker commits 2+ times

    # 1. four workers at once; worker 2 is killed once its first store shard is committed
    shards = Path(config.cache_dir) / "latents" / "shards"
    workers = {i: worker(config_path, f"{i}/{WORKERS}") for i in range(WORKERS)}
    deadline = time.time() + 600
    while not (shards.is_dir() and committed_by_shard(shards, owner)[2]) and time.time() < deadline:
        assert workers[2].poll() is None, "worker 2 ended before it could be killed"
        time.sleep(0.05)
    os.kill(workers[2].pid, signal.SIGKILL)
    assert [workers[i].wait(timeout=600) for i in range(WORKERS)] == [0, 0, -signal.SIGKILL, 0]
    before = committed_by_shard(shards, owner)
    assert all(len(before[i]) == share[i] for i in (0, 1, 3)), "a worker that finished committed other than its share"
    assert 1 <= len(before[2]) < share[2], "the kill should land after worker 2's first commit, before its last"
    assert not store.manifest_parts("latents"), "a worker wrote a manifest"

    # 2. `loraflow cache --workers 4`: clips reused, workers 0, 1, 3 find nothing to do, worker 2 does the rest
    run = subprocess.run([sys.executable, "-m", "loraflow.cli", "cache", str(config_path), "--dataset", "demo-videos",
                          "--workers", str(WORKERS)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    computed = {int(m[1]): int(m[2]) for m in re.finditer(r"latents shard (\d)/4 of 'demo-videos': computed (\d+)",
                                                           run.stdout)}
    assert computed == {0: 0, 1: 0, 2: share[2] - len(before[2]), 3: 0}, run.stdout
    assert "clips computed 0" in run.stdout

    # 3. no missing, duplicate or torn rows; the manifest lists exactly the dataset's clips
    after = committed_by_shard(shards, owner)
    assert all(sorted(after[i]) == sorted(set(after[i])) and len(after[i]) == share[i] for i in range(WORKERS))
    assert {r["key"] for r in Store(config.cache_dir).read_manifest("latents", parts=["demo-videos"])} == set(owner)
    for key, row in Store(config.cache_dir, config.manifest_names).get("latents", list(owner)).items():
        assert row["latent"].shape[0] == 16 and np.isfinite(row["latent"]).all(), key


def test_shards_split_keys_stably_and_name_a_bad_spec() -> None:
    keys = [f"clip{i}" for i in range(1000)]
    owners = [[i for i in range(WORKERS) if Shard(i, WORKERS).owns(k)] for k in keys]
    assert all(len(o) == 1 for o in owners)  # every key in exactly one shard
    assert 200 < sum(o == [0] for o in owners) < 300  # and evenly spread (1000 / 4, within ~4 sigma)
    assert Shard.parse("2/4") == Shard(2, 4) and str(Shard(2, 4)) == "2/4"
    with pytest.raises(ValueError, match="index in 0..count-1"):
        Shard.parse("4/4")
    with pytest.raises(ValueError, match="write INDEX/COUNT"):
        Shard.parse("two")
