"""`type: huggingface` datasets: a Hub dataset's rows into clips, offline from the datasets cache, with the folder's
quarantine reasons and content keys.

The Hub is never reached: the test builds the dataset's cache as `load_dataset("loraflow-test/clips")` leaves it
online (HF_DATASETS_CACHE/loraflow-test___clips/default/0.0.0/<hash>/, Arrow files and dataset_info.json: the
datasets library's Parquet builder on a Parquet file written by `Dataset.to_parquet` with a `Video` feature, as a Hub
dataset's Parquet export is), then runs the clips stage in a fresh process under HF_HUB_OFFLINE=1 with the Hub's
endpoint a closed port, so that the datasets library reads that cache and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.config import ConfigError, parse_config
from tests.factory import REPO, clips_config, run_clips
from tests.media_factory import write_corrupt_header, write_h264

pytest.importorskip("datasets")

REPO_ID = "loraflow-test/clips"


def hub_cache(hf_home: Path, source: Path, rows: dict[str, list]) -> None:
    """The datasets cache of `REPO_ID` holding `rows` (columns video: {bytes, path}, caption) as its train split."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    features = datasets.Features({"video": datasets.Video(), "caption": datasets.Value("string")})
    source.mkdir(parents=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(source / "train-00000-of-00001.parquet"))
    cache = hf_home / "datasets"
    builder = Parquet(cache_dir=str(cache), dataset_name="clips", hash="0" * 16,
                      data_files=DataFilesDict.from_patterns({"train": [str(source / "*.parquet")]}))
    builder.download_and_prepare()
    # the Hub's repository names its cache folder `<namespace>___<name>` and its config `default`
    built = Path(builder.cache_dir).parent.parent  # cache/clips/<config id>
    (cache / "loraflow-test___clips").mkdir()
    shutil.move(built, cache / "loraflow-test___clips" / "default")


def offline_clips(config_path: Path, hf_home: Path) -> dict:
    """The clips stage in a new process, offline: {"manifest": [...], "quarantine": [...], "computed": n}."""
    script = (
        "import json, sys\n"
        "from loraflow.config import load_config\n"
        "from tests.factory import run_clips\n"
        "report, store = run_clips(load_config(sys.argv[1]))\n"
        "print(json.dumps({'manifest': store.read_manifest('clips'), 'computed': report.computed,\n"
        "                  'quarantine': [[q.file, q.reason, q.detail] for q in report.quarantined]}, default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script, str(config_path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hub")
    (root / "media").mkdir()
    good = write_h264(root / "media" / "good.mp4", num_frames=12)
    other = write_h264(root / "media" / "other.mp4", num_frames=12, width=64, height=64)
    corrupt = write_corrupt_header(root / "media" / "corrupt.mp4")
    rows = {"video": [{"bytes": p.read_bytes(), "path": p.name} for p in (good, corrupt, other, good)],
            "caption": ["a good clip", "a corrupt one", None, "the good clip again"]}
    hub_cache(root / "hf", root / "repo", rows)
    return {"root": root, "hf": root / "hf", "corrupt": corrupt}


def hub_entry(**keys: object) -> dict:
    return {"id": "hub", "type": "huggingface", "dataset_name": REPO_ID, "video_column": "video",
            "caption_column": "caption", **keys}


def test_a_hub_dataset_materializes_clips_offline_and_quarantines_its_bad_rows(hub: dict, tiny_k5: Path,
                                                                             tmp_path: Path) -> None:
    config = clips_config(tiny_k5, tmp_path, [hub_entry()])
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude_defaults=True)))
    first = offline_clips(path, hub["hf"])

    captions = {row["source"].split("-")[0]: row["captions"] for row in first["manifest"]}
    assert captions == {"000000": ["a good clip"], "000003": ["the good clip again"]}
    reasons = {Path(file).name: reason for file, reason, _ in first["quarantine"]}
    # the corrupt video: the reason the same bytes get in a local folder
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(hub["corrupt"], local / "corrupt.mp4")
    (local / "corrupt.txt").write_text("a corrupt one")
    report, _ = run_clips(clips_config(tiny_k5, tmp_path / "as-folder", [{"instance_data_dir": str(local)}]))
    (folder_reason,) = [q.reason for q in report.quarantined]
    corrupt_name = next(name for name in reasons if name.startswith("000001-"))
    assert reasons == {corrupt_name: folder_reason, "row 000002": "missing_caption"}
    assert "row 2 of 'loraflow-test/clips': no caption in column 'caption'" in \
        next(detail for file, _, detail in first["quarantine"] if file.endswith("row 000002"))
    # content-keyed: rows 0 and 3 hold the same bytes (their files differ by row only) ...
    keys = {row["source"]: row["key"] for row in first["manifest"]}
    assert len(set(keys.values())) == 2
    # ... and the folder written anew (deleted) gives the same keys: nothing is decoded again
    shutil.rmtree(Path(config.cache_dir) / "huggingface")
    again = offline_clips(path, hub["hf"])
    assert {row["source"]: row["key"] for row in again["manifest"]} == keys and again["computed"] == 0


def test_a_hub_dataset_not_in_the_cache_is_one_message(hub: dict, tiny_k5: Path, tmp_path: Path) -> None:
    config = clips_config(tiny_k5, tmp_path, [hub_entry(dataset_name="loraflow-test/absent")])
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude_defaults=True)))
    script = ("import sys\nfrom loraflow.config import load_config\nfrom tests.factory import run_clips\n"
              "try:\n    run_clips(load_config(sys.argv[1]))\nexcept FileNotFoundError as exc:\n    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hub["hf"]), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset 'hub': the Hugging Face dataset 'loraflow-test/absent'" in done.stdout
    assert "HF_HUB_OFFLINE is set" in done.stdout


@pytest.mark.parametrize(("keys", "problem"), [
    ({"dataset_name": None}, "needs `dataset_name`"),
    ({"caption_column": None}, "needs `caption_column`"),
    ({"caption_strategy": "textfile"}, "caption_strategy huggingface (its `caption_column`) or instanceprompt"),
    ({"image_column": "image"}, "`image_column` is not read by a dataset_type video dataset"),
    ({"dataset_type": "conditioning"}, "takes dataset_type video or image"),
])
def test_hub_keys_are_checked(tiny_k5: Path, tmp_path: Path, keys: dict, problem: str) -> None:
    entry = {k: v for k, v in {**hub_entry(), **keys}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        clips_config(tiny_k5, tmp_path, [entry])
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_hub_keys_on_a_local_dataset_are_refused(tiny_k5: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="`dataset_name` is for `type: huggingface` datasets"):
        clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(tmp_path), "dataset_name": REPO_ID}])
    data = {"model_family": "kandinsky5-video", "cache_dir": "s3://bucket/cache", "datasets": [hub_entry()]}
    config = parse_config(data)  # an object store holds the caches; the rows' files need a local folder
    with pytest.raises(ValueError, match="set `instance_data_dir` on the dataset"):
        config.dataset_folders  # noqa: B018
