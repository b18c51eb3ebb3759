"""The teacher_features stage with a tiny real DINOv2 (from_pretrained from a local folder) over a real store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Dinov2Model

from loraflow.contracts.clip_rows import ClipRow
from loraflow.contracts.teacher_features import STAGE, Teacher, latent_frame_indices
from loraflow.demo.tiny import tiny_dinov2
from loraflow.stages.teacher.teacher_features import encode_teacher_features
from loraflow.store import Store
from tests.factory import clip_row


def clips_store(root: Path) -> tuple[Store, list[ClipRow]]:
    """Two stored clips of 9 frames (3 latent frames: features of frames 0, 4, 8) in two datasets, as the clips stage
    stores them: uint8 (F, H, W, 3)."""
    store = Store(str(root / "cache"))
    g = np.random.default_rng(0)
    frames = {k: g.integers(0, 256, (9, 24, 40, 3), dtype=np.uint8) for k in ("c1", "c2")}
    store.put("clips", [{"key": k, "frames": v} for k, v in frames.items()])
    return store, [clip_row("c1", "a", num_frames=9), clip_row("c2", "b", num_frames=9)]


def reference(teacher_dir: Path, frames: np.ndarray, size: int) -> torch.Tensor:
    """DINOv2 as SimpleTuner feeds it: [0, 1], resized, ImageNet-normalised; the patch tokens after the class token."""
    model = Dinov2Model.from_pretrained(teacher_dir).eval()
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255
    pixels = torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False,
                                             antialias=True)
    mean, std = (torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
                 torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
    with torch.no_grad():
        return model(pixel_values=(pixels - mean) / std).last_hidden_state[:, 1:]


def test_features_are_the_teachers_patch_tokens_and_cached(tmp_path: Path) -> None:
    store, clips = clips_store(tmp_path)
    teacher = Teacher(str(tiny_dinov2(tmp_path / "dinov2")), image_size=16)
    report = encode_teacher_features(clips, teacher, 4, store, ["a", "b"])
    assert (report.computed, report.reused) == (2, 0)
    manifest = {r["clip_key"]: r["key"] for r in store.read_manifest(STAGE)}
    assert [r["clip_key"] for r in store.read_manifest(STAGE, parts=["b"])] == ["c2"]
    stored = store.get(STAGE, manifest.values())
    frames = store.get("clips", ["c1"])["c1"]["frames"]
    features = np.array(stored[manifest["c1"]]["features"])  # a writable copy
    assert features.dtype == np.float16 and features.shape == (3, 16, 16)  # 3 latent frames, 4 x 4 patches, width 16
    assert torch.equal(torch.from_numpy(features), reference(tmp_path / "dinov2", frames[[0, 4, 8]], 16).half())

    again = encode_teacher_features(clips, teacher, 4, store, ["a", "b"])
    assert (again.computed, again.reused, again.data_version) == (0, 2, report.data_version)
    assert encode_teacher_features(clips, Teacher(teacher.path, 20), 4, store, ["a", "b"]).computed == 2
    key = store.read_manifest(STAGE, parts=["a"])[0]["key"]
    assert store.get(STAGE, [key])[key]["features"].shape == (3, 25, 16)  # 20 px: 5 x 5 patches
    tiny_dinov2(tmp_path / "dinov2", seed=1)  # other weights in the same folder: other features, other keys
    assert encode_teacher_features(clips, teacher, 4, store, ["a", "b"]).computed == 2


def test_bad_teacher_settings_say_what_to_do(tmp_path: Path) -> None:
    store, clips = clips_store(tmp_path)
    with pytest.raises(FileNotFoundError, match="crepa_encoder_path .*missing: not a transformers model folder"):
        encode_teacher_features(clips, Teacher(str(tmp_path / "missing"), 16), 4, store, ["a"])
    teacher = Teacher(str(tiny_dinov2(tmp_path / "dinov2")), image_size=18)
    with pytest.raises(ValueError, match="crepa_encoder_image_size 18 is not a multiple of the encoder's patch size "
                                         "4; use 16 or 20"):
        encode_teacher_features(clips, teacher, 4, store, ["a"])


def test_latent_frames_map_to_the_last_frame_of_their_group() -> None:
    assert latent_frame_indices(9, 4) == [0, 4, 8]
    assert latent_frame_indices(1, 4) == [0]
    with pytest.raises(ValueError, match="10 frames is not 1 \\+ 4 k"):
        latent_frame_indices(10, 4)


def test_features_that_are_not_finite_are_refused_by_name_and_the_others_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real tiny DINOv2, its final layer norm made NaN for the first clip (a forward hook on the real module): the
    stage stores the other clip's features and fails naming the refused clip, never caching NaN for CREPA to train
    toward."""
    import loraflow.stages.teacher.teacher_features as T

    store, clips = clips_store(tmp_path)
    teacher = Teacher(str(tiny_dinov2(tmp_path / "dinov2")), image_size=16)
    load, calls = T.load_teacher, []

    def overflowing(*args: object) -> torch.nn.Module:
        model = load(*args)
        model.layernorm.register_forward_hook(
            lambda _m, _i, out: out * torch.nan if not calls.append(1) and len(calls) == 1 else None)
        return model

    monkeypatch.setattr(T, "load_teacher", overflowing)
    with pytest.raises(ValueError, match=r"clip c1 \(dataset a\): the teacher, in float32, gave non-finite"):
        encode_teacher_features(clips, teacher, 4, store, ["a", "b"])
    stored = store.get(STAGE, store.keys(STAGE))
    assert [row["clip_key"] for row in stored.values()] == ["c2"]
    assert all(np.isfinite(row["features"]).all() for row in stored.values())
