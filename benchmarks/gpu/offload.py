"""`offload_during_startup`: what the caching stages hold on the accelerator, and when.

Runs `encode_latents` then `encode_texts` (what the `latents` and `text_embeds` assets call, in the order the
`gpu` pool runs them) in one process, from an empty cache, with `offload_during_startup` off and on, on the tiny
demo model and data, and records per stage: torch.cuda.max_memory_allocated during the stage, memory_allocated
before and after it (after the latents stage it must be back at the baseline: the VAE was freed before any text
encoder loads), and the stage's wall time. With offload on, the text encoders stay on the CPU and visit the GPU
only while a batch encodes, so the text stage's peak is one batch's working set plus the encoders, never
encoders + VAE. `--smoke` (run.py): the same stages on the CPU, seconds only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from loraflow.pipelines.sources import model_source

ROOT = Path(__file__).resolve().parents[2]


def demo_config(root: Path) -> Path:
    """The demo config on a tiny model and demo data built under root (what `make demo` uses)."""
    import yaml

    from loraflow.demo.dataset import make_demo_dataset
    from loraflow.demo.tiny import build_tiny

    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    model = build_tiny(config["model_family"], root / "model")
    make_demo_dataset(root / "data")
    config.update(pretrained_model_name_or_path=str(model), output_dir=str(root / "output"))
    config["datasets"][0]["instance_data_dir"] = str(root / "data")
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def stage(name: str, run, cuda: bool) -> dict:
    import torch

    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    report = run()
    row = {"stage": name, "computed": report.computed}
    if cuda:
        torch.cuda.synchronize()
        gib = 2**30
        row.update(allocated_before_gib=round(before / gib, 3),
                   peak_gib=round(torch.cuda.max_memory_allocated() / gib, 3),
                   allocated_after_gib=round(torch.cuda.memory_allocated() / gib, 3))
    return {**row, "seconds": round(time.perf_counter() - began, 2)}


def stages(config_path: Path, offload: bool, cache: Path, cuda: bool) -> list[dict]:
    from loraflow.config import load_config, parse_config
    from loraflow.pipelines import get_family
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.store import Store

    base = load_config(config_path).model_dump(mode="json", exclude_none=True)
    config = parse_config({**base, "offload_during_startup": offload, "cache_dir": str(cache)})
    family, store = get_family(config), Store(config.cache_dir)
    build_clips(config, family, model_source(config), store)  # CPU only: not measured
    return [stage("latents", lambda: encode_latents(config, family, model_source(config), store), cuda),
            stage("text_embeds", lambda: encode_texts(config, family, model_source(config), store), cuda)]


def measure(work: Path, smoke: bool) -> dict[str, Any]:
    import torch

    root = work / "demo"
    config = demo_config(root) if not (root / "config.yaml").is_file() else root / "config.yaml"
    cuda = torch.cuda.is_available() and not smoke
    return {"config": "tiny demo",
            "runs": {f"offload_{on}": stages(config, on, work / f"offload-cache-{on}", cuda) for on in (False, True)}}
