"""Buckets a NABLA checkpoint can train (loraflow/pipelines/kandinsky5/nabla_buckets.py, the Kandinsky 5 specs'
`bucket_rule`; `pipelines.bucket_multiple` asks it), planned before caching, and
`loraflow check` of a Kandinsky 5 Pro HD config before its download: 128-px buckets and a NABLA estimate.

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
from loraflow.pipelines import get_family, plan_family
from loraflow.stages.clips.bucket_plan import plan_buckets
from tests.factory import demo_dict, text_rows, write_config


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
    text = family.collate_text([text_rows()[0]], "cpu")

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


@pytest.mark.released  # estimates the released 19B Pro transformer on fake tensors: minutes on 2 loaded cores
def test_check_of_a_pro_hd_config_before_download_plans_nabla(demo_data: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Kandinsky 5 Pro 5 s HD, not downloaded (an empty Hugging Face cache, offline): its mode is NABLA P 0.8, so the
    plan's buckets are multiples of 128 px and the estimates run NABLA's stand-in (dense attention + its measured
    block masks); its SD mode plans in 16s and estimates flash attention. Before issue 44 both planned in 16s and
    estimated flash."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    outputs = {}
    for mode in ("hd", "sd"):
        data = demo_dict(Path("unused"), demo_data, tmp_path, model_flavour=f"t2v-pro-sft-5s-{mode}",
                         pretrained_model_name_or_path="kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers",
                         validation_resolution="256x128", gradient_checkpointing=True)
        data["datasets"][0].update(resolution=144, minimum_image_size=0)
        data["datasets"][0]["video"].update(num_frames=9, min_frames=9)
        assert check(str(write_config(tmp_path / f"{mode}.yaml", data))) == 2  # the model is not in the cache
        outputs[mode] = capsys.readouterr().out
    hd, sd = outputs["hd"], outputs["sd"]
    assert "NABLA attention (the transformer as t2v-pro-sft-5s-hd runs it): bucket sides are multiples of 128 px" in hd
    buckets = {tuple(map(int, b)) for b in re.findall(r"(\d+)x(\d+)@9", hd.split("estimates")[0])}
    assert buckets and all(w % 128 == 0 and h % 128 == 0 for w, h in buckets), buckets
    table = hd.split("estimates (no model loads")[1].split("  fit: ")[1].splitlines()  # the table follows the legend
    rows = {line.split()[0]: line for line in table if line.split()[:1] in (["lora"], ["validation"])}
    assert "NABLA (P 0.8)" in rows["lora"] and "NABLA (P 0.8)" in rows["validation"], rows
    assert "NABLA" not in sd and any(w % 128 for w, _ in (tuple(map(int, b)) for b in re.findall(
        r"(\d+)x(\d+)@9", sd.split("estimates")[0])))
