import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from loraflow.atomic import write_atomic
from loraflow.keys import content_key, data_version
from loraflow.store import Store


@pytest.fixture(params=["local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> Store:
    if request.param == "s3":  # moto's S3 server on loopback, through s3fs (tests/servers.py)
        from tests.servers import make_bucket

        return Store(make_bucket(request.getfixturevalue("s3_env"), f"store-{uuid.uuid4().hex[:12]}") + "/cache")
    return Store(str(tmp_path / "cache") if request.param == "local" else f"memory://{tmp_path.name}")


def test_round_trip_fixed_and_ragged_tensors(store: Store) -> None:
    rows = [
        {"key": "a", "latent": np.arange(6, dtype=np.float32).reshape(2, 3), "emb": np.ones((4, 2), np.float32),
         "n": 4},
        {"key": "b", "latent": np.zeros((2, 3), np.float32), "emb": np.full((5, 2), 7, np.float32), "n": 5},
    ]
    store.put("stage", rows)
    assert store.keys("stage") == {"a", "b"}
    got = store.get("stage", ["a", "b"])
    np.testing.assert_array_equal(got["a"]["latent"], rows[0]["latent"])
    np.testing.assert_array_equal(got["b"]["emb"], rows[1]["emb"])
    assert got["b"]["n"] == 5


@pytest.mark.parametrize("ragged", [False, True])
def test_a_batch_reads_only_the_row_groups_holding_its_keys(store: Store, monkeypatch, ragged: bool) -> None:
    import pyarrow.parquet as pq

    import loraflow.store

    monkeypatch.setattr(loraflow.store, "ROW_GROUP_BYTES", 1100)  # two ~500-byte rows per group
    rows = [{"key": f"k{i}", "latent": np.full((2 + ragged * i, 60), i, np.float32), "n": i} for i in range(9)]
    shard = store.put("stage", rows)
    with store.fs.open(shard, "rb") as f:
        assert pq.ParquetFile(f).num_row_groups == (9 if ragged else 5)
    read: list[list[int]] = []
    original = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: read.append(groups) or original(self, groups, **kw))
    got = store.get("stage", ["k8", "k3", "k0"])
    assert read == [[0, 3, 8] if ragged else [0, 1, 4]]
    for i in (0, 3, 8):
        np.testing.assert_array_equal(got[f"k{i}"]["latent"], rows[i]["latent"])
        assert got[f"k{i}"]["n"] == i
    assert store.get("stage", ["k5"], columns=["n"]) == {"k5": {"key": "k5", "n": 5}}


def test_same_shapes_are_raw_bytes_cells_floats_uncompressed(tmp_path) -> None:
    import pyarrow.parquet as pq

    store = Store(str(tmp_path))
    frames = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    shard = store.put("stage", [{"key": str(i), "latent": np.full((16, 5, 8, 12), i, np.float32), "frames": frames}
                                for i in range(3)])
    schema = pq.read_schema(shard)
    assert schema.field("latent").type == pa.large_binary()
    assert schema.field("latent").metadata[b"loraflow.tensor"] == b'{"dtype": "<f4", "shape": [16, 5, 8, 12]}'
    columns = pq.ParquetFile(shard).metadata.row_group(0)
    assert [columns.column(i).compression for i in range(3)] == ["ZSTD", "UNCOMPRESSED", "ZSTD"]  # key, latent, frames
    got = store.get("stage", ["2"])["2"]
    np.testing.assert_array_equal(got["latent"], np.full((16, 5, 8, 12), 2, np.float32))
    np.testing.assert_array_equal(got["frames"], frames)


def old_tensor_shard(path: Path, rows: list[dict]) -> None:
    """A shard as the store wrote it before raw-bytes cells: Arrow fixed-shape tensor columns, all zstd."""
    import pyarrow.parquet as pq

    columns = {"key": pa.array([r["key"] for r in rows])}
    for name in [n for n in rows[0] if n != "key"]:
        arrays = [r[name] for r in rows]
        flat = pa.array(np.stack(arrays).reshape(-1))
        storage = pa.FixedSizeListArray.from_arrays(flat, arrays[0].size)
        columns[name] = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, arrays[0].shape), storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, compression="zstd", use_dictionary=["key"])


def test_a_store_written_before_raw_bytes_cells_reads_as_written(tmp_path) -> None:
    latent = np.random.default_rng(0).standard_normal((2, 16, 3, 4, 6), dtype=np.float32)
    old_tensor_shard(tmp_path / "latents" / "shards" / f"{0:032x}.parquet",
                     [{"key": f"old{i}", "latent": latent[i], "latent_logvar": -latent[i]} for i in range(2)])
    store = Store(str(tmp_path))
    store.put("latents", [{"key": "new", "latent": latent[0] + 1, "latent_logvar": latent[1]}])
    assert store.keys("latents") == {"old0", "old1", "new"}
    got = store.get("latents", ["old1", "new", "old0"])
    for i in range(2):
        np.testing.assert_array_equal(got[f"old{i}"]["latent"], latent[i])
        np.testing.assert_array_equal(got[f"old{i}"]["latent_logvar"], -latent[i])
    np.testing.assert_array_equal(got["new"]["latent"], latent[0] + 1)
    only = store.get("latents", ["old0"], columns=["latent"])["old0"]
    assert only.keys() == {"key", "latent"} and only["latent"].shape == (16, 3, 4, 6)


def test_a_cell_of_another_length_than_its_shape_raises(tmp_path) -> None:
    import pyarrow.parquet as pq

    from loraflow.store import rows_to_table

    table = rows_to_table([{"key": "a", "latent": np.zeros((2, 3), np.float32)}])
    field = table.schema.field("latent").with_metadata({b"loraflow.tensor": b'{"dtype": "<f4", "shape": [2, 2]}'})
    (tmp_path / "stage" / "shards").mkdir(parents=True)
    pq.write_table(table.cast(table.schema.set(1, field)), tmp_path / "stage" / "shards" / f"{0:032x}.parquet")
    with pytest.raises(ValueError, match="a cell of 24 bytes, but float32 \\(2, 2\\) is 16"):
        Store(str(tmp_path)).get("stage", ["a"])


def test_missing_key_raises_naming_the_stage(store: Store) -> None:
    store.put("stage", [{"key": "a", "x": 1}])
    with pytest.raises(KeyError, match="stage: 1 key"):
        store.get("stage", ["a", "zzz"])


def test_temporary_files_are_never_read(tmp_path) -> None:
    store = Store(str(tmp_path))
    store.put("stage", [{"key": "a", "x": 1}])
    # A writer killed mid-shard leaves only a temporary name behind; it must not count as committed.
    (tmp_path / "stage" / "shards" / "dead.parquet.tmp-123").write_bytes(b"PAR1 half a shard")
    assert store.keys("stage") == {"a"}


def test_manifest_round_trip_and_clean(tmp_path) -> None:
    store = Store(str(tmp_path))
    store.put("stage", [{"key": "old", "x": 1}])
    store.put("stage", [{"key": "new", "x": 2}])
    store.write_manifest("stage", [{"key": "new", "bucket": "96x64@17"}])
    assert store.read_manifest("stage") == [{"key": "new", "bucket": "96x64@17"}]
    assert store.clean("stage", keep={"new"}) == 1
    assert store.keys("stage") == {"new"}


def test_keys_change_exactly_with_content() -> None:
    base = content_key(path="a.mp4", size=10, indices=[0, 1])
    assert base == content_key(indices=[0, 1], size=10, path="a.mp4")  # order of fields is irrelevant
    assert base != content_key(path="a.png", size=10, indices=[0, 1])  # a.mp4 and a.png never collide
    assert base != content_key(path="a.mp4", size=10, indices=[0, 2])
    assert data_version(["b", "a"]) == data_version(["a", "b"])


def test_empty_tensors_round_trip(store: Store) -> None:
    store.put("stage", [{"key": "a", "emb": np.zeros((0, 4), np.float32)},
                        {"key": "b", "emb": np.zeros((0, 4), np.float32)}])
    assert store.get("stage", ["a"])["a"]["emb"].shape == (0, 4)


def test_manifest_parts_are_written_apart_and_read_as_one(store: Store) -> None:
    store.write_manifest("stage", [{"key": "b1", "dataset": "b"}], part="b")
    store.write_manifest("stage", [{"key": "a1", "dataset": "a"}, {"key": "a2", "dataset": "a"}], part="a")
    assert store.manifest_parts("stage") == ["a", "b"]
    assert [r["key"] for r in store.read_manifest("stage")] == ["a1", "a2", "b1"]  # every part, in part order
    assert [r["key"] for r in store.read_manifest("stage", parts=["b"])] == ["b1"]
    store.write_manifest("stage", [{"key": "a3", "dataset": "a"}], part="a")  # replacing a leaves b alone
    assert [r["key"] for r in store.read_manifest("stage")] == ["a3", "b1"]
    with pytest.raises(FileNotFoundError, match="no manifest for c"):
        store.read_manifest("stage", parts=["a", "c"])
    assert [r["key"] for r in store.only_parts(["a"]).read_manifest("stage")] == ["a3"]


def test_a_whole_manifest_and_parts_replace_each_other(store: Store) -> None:
    store.write_manifest("stage", [{"key": "whole"}])
    store.write_manifest("stage", [{"key": "a1"}], part="a")
    assert store.read_manifest("stage") == [{"key": "a1"}]  # the whole file went with the first part
    store.write_manifest("stage", [{"key": "whole"}])
    assert store.manifest_parts("stage") == [] and store.read_manifest("stage") == [{"key": "whole"}]
    with pytest.raises(FileNotFoundError, match="has no manifest"):
        store.read_manifest("other")


def test_odd_part_names_and_empty_parts_round_trip(store: Store) -> None:
    store.write_manifest("stage", [], part="my videos/2024")
    store.write_manifest("stage", [{"key": "x"}], part="x")
    assert store.manifest_parts("stage") == ["my videos/2024", "x"]
    assert store.read_manifest("stage", parts=["my videos/2024"]) == []
    assert store.read_manifest("stage") == [{"key": "x"}]


def test_clean_keeps_what_any_part_of_any_source_lists(store: Store) -> None:
    for key in ("a1", "b1", "theirs", "gone"):
        store.put("stage", [{"key": key, "x": 1}])
    Store(store.url, {"a": "my-source"}).write_manifest("stage", [{"key": "a1"}], part="a")
    Store(store.url, {"a": "their-source"}).write_manifest("stage", [{"key": "theirs"}], part="a")
    store.write_manifest("stage", [{"key": "b1"}], part="b")
    assert store.only_parts(["b"]).clean("stage") == 1  # a view's restriction does not narrow what clean keeps
    assert store.keys("stage") == {"a1", "b1", "theirs"}  # nor do the sources: another config's part keeps its rows


def test_a_store_with_sources_reads_and_lists_its_own_datasets_parts_only(store: Store) -> None:
    mine, theirs = Store(store.url, {"a": "folder-1"}), Store(store.url, {"a": "folder-2", "b": "folder-3"})
    mine.write_manifest("stage", [{"key": "mine"}], part="a")
    theirs.write_manifest("stage", [{"key": "theirs"}], part="a")  # one id, another source: beside it, not over it
    theirs.write_manifest("stage", [{"key": "b1"}], part="b")
    assert mine.manifest_parts("stage") == ["a"] and mine.read_manifest("stage") == [{"key": "mine"}]
    assert theirs.read_manifest("stage") == [{"key": "theirs"}, {"key": "b1"}]
    with pytest.raises(ValueError, match="holds 2 manifests of dataset 'a'"):
        store.read_manifest("stage", parts=["a"])  # a store without sources does not pick one
    assert store.read_manifest("stage", parts=["b"]) == [{"key": "b1"}]  # the one source of b: no doubt
    store.write_manifest("stage", [{"key": "b2"}], part="b")  # into the file it reads
    assert theirs.read_manifest("stage", parts=["b"]) == [{"key": "b2"}]
    assert store.manifest_parts("stage") == ["a", "b"]


def test_a_part_written_before_parts_were_named_is_not_a_configs_and_its_named_one_replaces_it(store: Store) -> None:
    """Which config wrote an unnamed part is unknown (every config sharing the cache read it before): a config's
    store does not read it, and says what to run; its named list, made anew from the shards, replaces it."""
    store.write_manifest("stage", [{"key": "old"}], part="a")  # unnamed: what loraflow wrote before names
    keyed = Store(store.url, {"a": "folder-1"})
    assert keyed.manifest_parts("stage") == []
    with pytest.raises(FileNotFoundError, match="has no manifest made with this config's settings .*loraflow cache"):
        keyed.read_manifest("stage")
    keyed.write_manifest("stage", [{"key": "new"}], part="a")
    assert keyed.read_manifest("stage") == store.read_manifest("stage") == [{"key": "new"}]  # the old one is gone


def test_a_cache_dir_with_glob_characters_in_its_name_resumes(tmp_path: Path) -> None:
    root = tmp_path / "runs [v2]*"  # globbed, this matched nothing: every run re-did everything
    Store(str(root)).put("clips", [{"key": "a"}])
    Store(str(root)).write_manifest("clips", [{"key": "a"}], part="d0")
    again = Store(str(root))
    assert again.keys("clips") == {"a"} and again.manifest_parts("clips") == ["d0"]
    assert len(again.shard_paths("clips")) == 1


def test_one_key_gets_list_the_shards_once_and_again_only_for_a_new_key(store: Store, monkeypatch) -> None:
    for i in range(20):
        store.put("stage", [{"key": f"k{i}", "x": i}])
    listed: list[str] = []
    original = store.fs.ls
    monkeypatch.setattr(store.fs, "ls", lambda path, **kw: listed.append(path) or original(path, **kw))
    assert [store.get("stage", [f"k{i}"])[f"k{i}"]["x"] for i in range(20)] == list(range(20))
    assert len(listed) == 1  # listing per get made a loop over N keys cost N listings of N shards
    store.put("stage", [{"key": "new", "x": 99}])  # committed after the listing: found by listing again
    assert store.get("stage", ["new"])["new"]["x"] == 99 and len(listed) == 2
    with pytest.raises(KeyError):
        store.get("stage", ["never"])
    assert store.clean("stage", keep={"k3", "new"}) == 19
    assert store.get("stage", ["k3", "new"]).keys() == {"k3", "new"}
    with pytest.raises(KeyError):
        store.get("stage", ["k4"])  # its shard is gone, and so is its place in the index


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path: Path) -> None:
    """The one atomic write (JSON, mp4, png, safetensors, the CLI's imported config): a writer dying half way leaves
    the old bytes under the name and no temporary file beside it."""
    path = write_atomic(tmp_path / "result.json", lambda tmp: tmp.write_text("old"))

    def dies(tmp: Path) -> None:
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, dies)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


# Runs inside its own mount namespace, on a 1 MiB tmpfs mounted there (argv[1]): a real full disk, ENOSPC from the
# kernel, nothing mounted outside. Prints what each writer raised and what it left on the disk.
DISK_FULL = r'''
import json, os, signal, subprocess, sys
from pathlib import Path
import numpy as np, torch
from loraflow.store import Store
from loraflow.atomic import write_atomic
from loraflow.training.checkpoints import save_checkpoint

root = Path(sys.argv[1])
big = np.zeros(2 << 18, np.float32)  # 2 MiB: more than the disk holds
report = {}

def attempt(name, write):
    try:
        write()
        report[name] = None
    except OSError as exc:
        report[name] = [type(exc).__name__, str(exc)]
    report[name + " left"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if "tmp" in p.name)

store = Store(str(root / "cache"))
store.put("latents", [{"key": "small", "x": np.zeros(4, np.float32)}])
killed = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom loraflow.atomic import tmp_name\n"
                           "open(f'{sys.argv[1]}.{tmp_name()}', 'wb').write(b'half a shard')\nprint(flush=True)\n"
                           "time.sleep(60)\n", str(root / "cache" / "latents" / "shards" / "killed.parquet")],
                          stdout=subprocess.PIPE)
killed.stdout.readline()
killed.send_signal(signal.SIGKILL)
killed.wait()
report["killed writer left"] = sorted(p.name for p in (root / "cache" / "latents" / "shards").iterdir()
                                      if "tmp" in p.name)
attempt("shard", lambda: Store(str(root / "cache")).put("latents", [{"key": "big", "x": big}]))
attempt("small shard after", lambda: Store(str(root / "cache")).put("latents", [{"key": "b", "x": big[:4]}]))
attempt("file", lambda: write_atomic(root / "out" / "history.json", lambda tmp: tmp.write_bytes(big.tobytes()))
        if (root / "out").mkdir() is None else None)
(root / "run" / "checkpoints" / "step-0000001.tmp").mkdir(parents=True)  # a save a kill interrupted
attempt("checkpoint", lambda: save_checkpoint(root / "run", 2, {"a": torch.from_numpy(big)}, ({}, {}), [], 2))
attempt("small checkpoint after", lambda: save_checkpoint(root / "run", 3, {"a": torch.zeros(4)}, ({}, {}), [], 2))
print(json.dumps(report))
'''


def test_a_full_disk_is_one_message_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    """Each writer (a store shard, an atomic file, a checkpoint) on a full disk raises one message naming the folder
    and what to do, and leaves nothing half-written; what a killed writer left is removed by the next write there.
    Before: a raw OSError, and the shard's .tmp file stayed, filling the disk for every write after it."""
    import shutil
    import subprocess
    import sys

    from tests.factory import REPO, missing_input

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--mount", "--map-root-user", "true"]).returncode:
        missing_input("needs a mount namespace (unshare --mount --map-root-user) for a private tmpfs")  # CI: fails
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "full.py").write_text(DISK_FULL)
    done = subprocess.run([unshare, "--mount", "--map-root-user", "sh", "-c",
                           'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" "$3" "$1"', "sh", str(disk),
                           sys.executable, str(tmp_path / "full.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report["killed writer left"]) == 1  # the kill left its temporary shard
    kind, message = report["shard"]
    assert kind == "DiskFull" and f"the disk holding {disk}/cache/latents/shards is full" in message
    assert "set `cache_dir` to a folder on a disk with room" in message
    assert report["shard left"] == []  # its own partial file, and the killed writer's
    assert report["small shard after"] is None  # the space the failed write took is free again
    kind, message = report["file"]
    assert kind == "DiskFull" and f"the disk holding {disk}/out is full" in message and "`output_dir`" in message
    assert report["file left"] == []
    kind, message = report["checkpoint"]
    assert kind == "DiskFull" and f"{disk}/run/checkpoints is full" in message
    assert report["checkpoint left"] == []
    assert report["small checkpoint after"] is None and report["small checkpoint after left"] == []


# -- issue 62 item 3: cache files read only when they are the store's own --------------------------------------------

def stray(path: Path, rows: int) -> Path:
    """A Parquet file of `rows` rows (a `key` column of nulls: cheap to write, 10^7 rows in a few MB)."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"key": pa.nulls(rows, pa.string())}), path)
    return path


def test_a_stray_parquet_file_among_the_shards_is_not_read(tmp_path: Path) -> None:
    """A stray 10^7-row Parquet file in the cache was read whole (2 GB, 40 s). Another name than the store's is not
    read at all; the store's kind of name with more rows than the store writes is refused from its footer."""
    from loraflow.store import CacheFileRefused

    Store(str(tmp_path)).put("latents", [{"key": k, "x": np.zeros(4, np.float32)} for k in ("a", "b")])
    stray(tmp_path / "latents" / "shards" / "notes.parquet", 10**7)
    assert Store(str(tmp_path)).keys("latents") == {"a", "b"}
    posing = stray(tmp_path / "latents" / "shards" / f"{'f' * 32}.parquet", 10**7)
    with pytest.raises(CacheFileRefused) as caught:
        Store(str(tmp_path)).keys("latents")
    assert f"{posing} in the cache holds 10000000 rows, more than the 1000000" in str(caught.value)
    assert "delete it" in str(caught.value)


def spoil_cells(shard: Path) -> None:
    """Rewrite a shard's tensor column metadata to say another shape than its cells hold."""
    import pyarrow.parquet as pq

    from loraflow.store import TENSOR_META

    table = pq.read_table(shard)
    field = table.schema.field("x")
    meta = {**field.metadata, TENSOR_META: json.dumps({"dtype": "<f4", "shape": [8]}).encode()}
    pq.write_table(table.cast(table.schema.set(table.schema.get_field_index("x"), field.with_metadata(meta))), shard)


def other_schema(shard: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"name": ["a"], "x": [1.0]}), shard)


@pytest.mark.parametrize(("spoil", "words"), [
    (lambda shard: shard.write_bytes(shard.read_bytes()[:200]), "is not readable (ArrowInvalid"),
    (other_schema, "has no string `key` column: it is not a shard loraflow wrote"),
    (spoil_cells, "is not readable (ValueError: column 'x': a cell of 16 bytes, but float32 (8,) is 32"),
])
def test_a_tampered_shard_is_named_with_what_to_do(spoil: Any, words: str, tmp_path: Path) -> None:
    """Truncated shards and tensor metadata that does not fit its cells were raw pyarrow or ValueError text naming
    no file."""
    from loraflow.store import CacheFileRefused

    shard = Path(Store(str(tmp_path)).put("latents", [{"key": "a", "x": np.zeros(4, np.float32)}]))
    spoil(shard)
    with pytest.raises(CacheFileRefused) as caught:
        Store(str(tmp_path)).get("latents", ["a"])
    assert f"{shard} in the cache {words}" in str(caught.value) and "delete it" in str(caught.value)


def test_whole_manifests_of_configs_sharing_the_store_stand_beside_each_other(store: Store) -> None:
    """The text set is one manifest per config: keyed by the config's sources, so a config with another model or
    other settings (other sources) never reads or replaces another's list, and clean keeps what each lists."""
    for key in ("old", "mine", "theirs", "gone"):
        store.put("stage", [{"key": key, "x": 1}])
    store.write_manifest("stage", [{"key": "old"}])  # no sources: what loraflow wrote before whole files were keyed
    mine, theirs = Store(store.url, {"a": "settings-1"}), Store(store.url, {"a": "settings-2"})
    with pytest.raises(FileNotFoundError, match="made with this config's settings"):
        mine.read_manifest("stage")  # not a config's: which one wrote it is unknown
    mine.write_manifest("stage", [{"key": "mine"}])
    theirs.write_manifest("stage", [{"key": "theirs"}])
    assert mine.read_manifest("stage") == [{"key": "mine"}] and theirs.read_manifest("stage") == [{"key": "theirs"}]
    with pytest.raises(ValueError, match=r"holds 2 manifests \(configs sharing the store"):
        store.read_manifest("stage")  # a store without sources does not pick one
    assert store.clean("stage") == 2  # "old" (replaced) and "gone": neither config lists them
    assert store.keys("stage") == {"mine", "theirs"}


def test_a_configs_store_reads_every_dataset_of_the_config_or_raises_naming_the_missing(store: Store) -> None:
    """A config whose second dataset has no list of its names (its settings changed, not cached again) is refused,
    naming it: training on the first alone dropped the second without a word."""
    config = Store(store.url, {"a": "settings-1", "b": "settings-2"})
    config.write_manifest("stage", [{"key": "a1"}], part="a")
    with pytest.raises(FileNotFoundError, match=r"no manifest for b made with this config's settings .*cache them"):
        config.read_manifest("stage")
    assert config.read_manifest("stage", parts=["a"]) == [{"key": "a1"}]  # asked for a alone: a alone
    config.write_manifest("stage", [{"key": "b1"}], part="b")
    assert config.read_manifest("stage") == [{"key": "a1"}, {"key": "b1"}]
