"""Buckets a NABLA checkpoint can train (loraflow/pipelines/__init__.py: bucket_multiple), planned before caching.

The tiny Kandinsky 5 Video checkpoint with its transformer config switched to `attention_type: nabla` (the weights do
not depend on it; tests/pipelines/test_nabla.py does the same), and the demo videos at `resolution: 128`. The plan's
sizes are then given to the real transformer (no-grad: torch's flex attention has no backward on the CPU): the
planned bucket runs through NABLA, the size the family's own multiple would give fails in NABLA's block reshape.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from loraflow.cli import check
from loraflow.config import ConfigError, load_config
from loraflow.stages.clips.bucket_plan import plan_buckets
from loraflow.pipelines import get_family, plan_family
from tests.conftest import demo_dict, write_config
from tests.pipelines.test_nabla import rows


def sizes(model: Path, demo_data: Path, root: Path) -> tuple[Path, set[tuple[int, int]]]:
    """The config file and the planned (height, width) of every bucket of the demo videos at resolution 128."""
    data = demo_dict(model, demo_data, root, validation_resolution="256x128")
    data["datasets"][0].update(resolution=128, minimum_image_size=0)
    path = write_config(root / f"{model.name}.yaml", data)
    config = load_config(path)
    plan = plan_buckets(config, plan_family(config), None, progress=False)
    labels = [re.fullmatch(r"(\d+)x(\d+)@\d+", b.bucket).groups() for b in plan.buckets]
    return path, {(int(h), int(w)) for w, h in labels}


def test_nabla_buckets_are_the_sizes_nabla_runs_at(nabla_k5: Path, tiny_k5: Path, demo_data: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config_path, nabla = sizes(nabla_k5, demo_data, tmp_path)
    _, plain = sizes(tiny_k5, demo_data, tmp_path)
    assert nabla and all(h % 128 == 0 and w % 128 == 0 for h, w in nabla), nabla
    off = sorted(s for s in plain if s[0] % 128 or s[1] % 128)
    assert off, plain  # the family's own multiple (16) gives sizes NABLA cannot take

    family = get_family(load_config(config_path))
    transformer = family.load_renderer(str(nabla_k5), None, torch.device("cpu")).transformer
    text = family.collate_text([rows()[0]], "cpu")

    def velocity(height: int, width: int) -> torch.Tensor:
        latent = torch.zeros(1, 16, 2, height // 8, width // 8)
        with torch.no_grad():
            return family.velocity(transformer, latent, torch.tensor([0.5]), text)

    for height, width in sorted(nabla):
        assert velocity(height, width).shape[-2:] == (height // 8, width // 8)
    with pytest.raises(RuntimeError, match="shape"):  # NABLA's 8x8-patch block reshape
        velocity(*off[0])

    with pytest.raises(ConfigError, match=r"`validation_resolution` 96x64: kandinsky5-video needs multiples of 128 "
                                          r"\(VAE x patch x NABLA's 8-patch blocks\); use 128x128"):
        load_config(write_config(tmp_path / "val.yaml", {**yaml.safe_load(config_path.read_text()),
                                                         "validation_resolution": "96x64"}))
    assert check(str(config_path), estimate=False) == 0
    assert "bucket sides are multiples of 128 px, 16 (VAE x patch) x 8" in capsys.readouterr().out
