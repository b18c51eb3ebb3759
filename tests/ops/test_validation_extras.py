"""SimpleTuner's validation extras on the tiny real Kandinsky 5 Video, from the caches of test_train:
`validation_on_startup` (a render before the first step) and `validation_adapter_path` / `validation_adapter_config`
(the validation stage renders other adapters beside the trained one).

What is claimed: the startup render is the base model's (the validation stage's base frames) and changes no bit of
training; another adapter renders what that adapter renders (the trained file given as "another" adapter reproduces
the LoRA frames), its content is part of the validation key, and off leaves the key as it was.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loraflow.ops import progress_renders as PR
from loraflow.ops import train as T
from loraflow.ops import validate as V
from loraflow.ops.progress_renders import step_folder
from loraflow.pipelines import get_family
from loraflow.store import Store
from tests.ops.test_train import build_caches, make_config, same_lora_file, train

RENDERS = {"validation_resolution": "64x48", "validation_num_video_frames": 5, "validation_num_inference_steps": 2}


@pytest.fixture(scope="module")
def caches(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_caches(tiny_k5, demo_data, tmp_path_factory.mktemp("extras"))


def capture(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[np.ndarray]]:
    """The frames each module hands to write_media, in order (frames: mp4 bytes vary with libx264's threads)."""
    written: dict[str, list[np.ndarray]] = {"progress": [], "validation": []}
    for module, key in ((PR, "progress"), (V, "validation")):
        keep = module.write_media
        monkeypatch.setattr(module, "write_media",
                            lambda frames, stem, fps, keep=keep, key=key: written[key].append(frames)
                            or keep(frames, stem, fps))
    return written


def test_validation_on_startup_renders_the_base_at_step_0_and_trains_the_same_lora(
        caches: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = capture(monkeypatch)
    config = make_config(caches, tmp_path / "startup", validation_on_startup=True, max_train_steps=1, **RENDERS)
    plain = make_config(caches, tmp_path / "plain", max_train_steps=1, **RENDERS)
    report = train(config)
    assert report.run_dir.endswith(T.run_dir(plain, report.inputs).name)  # not part of the run
    run = Path(report.run_dir)
    assert sorted(p.name for p in (run / "validation").glob("step-*")) == ["step-0000000"]
    assert same_lora_file(run / T.LORA_FILE, Path(train(plain).lora_path))
    V.validate(config, get_family(config), Store(config.cache_dir), report.lora_path)
    (startup,), (base, lora) = written["progress"], written["validation"]
    # the new LoRA's B is zero: step 0 adds exactly 0 to every layer, what validation's scale-0 render adds
    assert np.array_equal(startup, base)
    assert not np.array_equal(startup, lora)  # one step moved the LoRA: the comparison means something
    assert (step_folder(run / "validation", 0) / PR.RESULT).is_file()
    assert PR.progress_sheet_path(run) is not None  # the lora asset's metadata shows it (step 0 on top)
