"""GPU measurement of `offload_during_startup`: what the caching stages hold on the accelerator, and when.

Runs `encode_latents` then `encode_texts` (what the `latents` and `text_embeds` assets call, in the order the
`gpu` pool runs them) in one process, from an empty cache, with `offload_during_startup` off and on, and records
per stage: torch.cuda.max_memory_allocated during the stage, memory_allocated before and after it (after the
latents stage it must be back at the baseline: the VAE was freed before any text encoder loads), and the
stage's wall time. With offload on, the text encoders stay on the CPU and visit the GPU only while a batch
encodes, so the text stage's peak is one batch's working set plus the encoders, never encoders + VAE.

    python benchmarks/gpu_offload.py --config configs/mine.yaml   # real checkpoints -> results/offload_gpu.json
    python benchmarks/gpu_offload.py                               # the tiny demo model and data (a smoke run)

Needs CUDA; on a CPU-only machine it says so and exits 2 (the stages themselves are tested on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "offload_gpu.json"


def demo_config(root: Path) -> Path:
    """The demo config on a tiny model and demo data built under root (what `make demo` uses)."""
    import yaml

    from loraflow.ops.demo_data import make_demo_dataset
    from loraflow.pipelines.tiny import build_tiny

    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    model = build_tiny(config["model_family"], root / "model")
    make_demo_dataset(root / "data")
    config.update(pretrained_model_name_or_path=str(model), output_dir=str(root / "output"))
    config["datasets"][0]["instance_data_dir"] = str(root / "data")
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def stage(name: str, run) -> dict:
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    report = run()
    torch.cuda.synchronize()
    gib = 2**30
    return {"stage": name, "computed": report.computed, "seconds": round(time.perf_counter() - began, 2),
            "allocated_before_gib": round(before / gib, 3), "peak_gib": round(torch.cuda.max_memory_allocated() / gib, 3),
            "allocated_after_gib": round(torch.cuda.memory_allocated() / gib, 3)}


def measure(config_path: Path, offload: bool, cache: Path) -> list[dict]:
    from loraflow.config import load_config, parse_config
    from loraflow.ops.clips import build_clips
    from loraflow.ops.latents import encode_latents
    from loraflow.ops.text_embeds import encode_texts
    from loraflow.pipelines import get_family
    from loraflow.store import Store

    base = load_config(config_path).model_dump(mode="json", exclude_none=True)
    config = parse_config({**base, "offload_during_startup": offload, "cache_dir": str(cache)})
    family, store = get_family(config), Store(config.cache_dir)
    build_clips(config, family, store)  # CPU only: not measured
    return [stage("latents", lambda: encode_latents(config, family, store)),
            stage("text_embeds", lambda: encode_texts(config, family, store))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="a loraflow config with real checkpoints (default: tiny demo)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_offload.py measures accelerator memory: it needs CUDA", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        config = args.config or demo_config(Path(tmp))
        runs = {f"offload_{on}": measure(config, on, Path(tmp) / f"cache-{on}") for on in (False, True)}
    result = {"benchmark": "peak accelerator memory of the latents then text_embeds stages, offload off/on",
              "config": str(args.config or "tiny demo"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
