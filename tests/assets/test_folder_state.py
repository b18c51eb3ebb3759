"""The sensor's folder fingerprint: the same hash as the rglob formula it replaced, so cursors stay valid."""

from __future__ import annotations

import os
from pathlib import Path

from loraflow.assets.sensors import MISSING, folder_state
from loraflow.keys import content_key, file_identity


def rglob_state(root: Path) -> dict:
    """The formula before scandir (what cursors already stored were computed with)."""
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    return {"hash": content_key(files=[file_identity(p, root) for p in files]), "files": len(files)}


def test_same_hash_as_rglob_on_links_hidden_files_and_part_order(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "a" / "deeper").mkdir(parents=True)
    (root / "a" / "b.mp4").write_bytes(b"1")
    (root / "a-b.mp4").write_bytes(b"22")  # sorts before a/ as a string, after it part by part
    (root / "a" / "deeper" / "c.txt").write_text("caption")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.mp4").write_bytes(b"3")
    (root / "a" / ".swp").write_bytes(b"4")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.mp4").write_bytes(b"5")
    os.symlink(tmp_path / "outside", root / "linked_folder")  # not entered
    os.symlink(root / "a" / "b.mp4", root / "linked.mp4")  # followed: a file
    os.symlink(root / "gone.mp4", root / "broken.mp4")
    state = folder_state(root)
    assert state == rglob_state(root) and state["files"] == 4
    (root / "a" / "b.mp4").write_bytes(b"changed")
    assert folder_state(root) == rglob_state(root) != state
    assert folder_state(tmp_path / "nowhere") == {"hash": MISSING, "files": 0}
