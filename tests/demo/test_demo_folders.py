"""`loraflow demo` writes its dataset only into folders it owns (issue 62 item 1): `--config` on a user's config
overwrote the user's clip_00.mp4 and captions, which share the demo's file names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraflow.cli import main, prepare_demo
from loraflow.demo.dataset import DEMO_MARKER, FolderNotTheDemos, make_demo_dataset, make_demo_edits
from tests.factory import demo_dict, write_config


def _user_folder(folder: Path, demo_data: Path) -> dict[str, bytes]:
    """A user's dataset whose names are the demo's: a real video and the user's own captions."""
    folder.mkdir(parents=True)
    shutil.copyfile(demo_data / "clip_03.mp4", folder / "clip_00.mp4")  # a real clip, other than the demo's clip_00
    (folder / "clip_00.txt").write_text("MY OWN CAPTION\n")
    (folder / "still_00.txt").write_text("MY OWN CAPTION of a still\n")
    return _contents(folder)


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_demo_refuses_a_folder_of_user_files_and_writes_nothing(
        demo_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    user = tmp_path / "my videos"
    before = _user_folder(user, demo_data)
    model = tmp_path / "model"
    settings = demo_dict(model, user, tmp_path, base="configs/demo.yaml", max_train_steps=1, checkpointing_steps=100,
                         validation_num_inference_steps=1)
    config = write_config(tmp_path / "mine.yaml", settings)
    assert main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"dataset 'demo-videos' of {config}: {user} holds files the demo did not write" in err, err
    assert "clip_00.mp4, clip_00.txt, still_00.txt" in err and "new folder" in err and "Traceback" not in err
    assert _contents(user) == before  # not one byte changed, nothing added (no marker either)
    assert not model.exists() and not (tmp_path / "cache").exists()  # refused before anything was built


def test_demo_writes_into_a_new_folder_and_again_into_its_own(
        tiny_world: Path, demo_data: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh" / "data"
    config = write_config(tmp_path / "demo.yaml", demo_dict(tiny_world, fresh, tmp_path, base="configs/demo.yaml"))
    prepare_demo(str(config))
    assert (fresh / DEMO_MARKER).is_file() and (fresh / "clip_00.txt").read_text().startswith("a red circle")
    stamps = {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()}
    prepare_demo(str(config))  # its own folder: taken again, nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()} == stamps

    older = tmp_path / "older"  # a set an older demo wrote (its manifest, no mark): still the demo's
    shutil.copytree(demo_data, older)
    (older / DEMO_MARKER).unlink()
    assert make_demo_dataset(older) == older and (older / DEMO_MARKER).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_demo_dataset(empty) / "clip_00.mp4").is_file()


def test_demo_edits_refuse_a_sources_folder_of_user_files(demo_data: Path, tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    before = _user_folder(sources, demo_data)
    with pytest.raises(FolderNotTheDemos, match=f"{sources} holds files the demo did not write"):
        make_demo_edits(tmp_path / "targets", sources)
    assert _contents(sources) == before and not (tmp_path / "targets").exists()  # neither folder written
    targets, sources = make_demo_edits(tmp_path / "targets", tmp_path / "new sources")
    assert (targets / DEMO_MARKER).is_file() and (sources / "edit_00.png").is_file()
