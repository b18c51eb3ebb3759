"""What `loraflow check` would estimate for the lora stage of released-size transformers, without their weights.

The transformers of benchmarks/gpu/train.py (Kandinsky 5 Video Lite's released config, 2.01B; HunyuanVideo 1.5's
diffusers default, the released 8.33B) at its sizes (512x768 and 480x848, 61 frames), batch 1, LoRA rank 16 on the
family's targets, the family's longest caption, through `loraflow.estimates.training_step` for the variants of
gpu/train.py that change memory; the seeds' folklore beside them. Estimates only, made on the CPU: gpu/train.py
measures the same variants on a GPU (a later issue compares the two). HunyuanVideo 1.5's rows hold the note that
says why it is not estimated yet (its forward reads tensor values, which fake tensors do not have).

    python benchmarks/estimates_released.py       # writes benchmarks/results/estimates_released.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "estimates_released.json"
FOLKLORE = {"kandinsky5-video": "~13 GB (the seed guide, Kandinsky 5 Lite)",
            "hunyuanvideo-1.5": "24-32 GB at 480p (the seed guide)"}
VARIANTS = {
    "bf16": {"base_model_precision": "bf16"},
    "bf16+checkpointing": {"base_model_precision": "bf16", "gradient_checkpointing": True},
    "fp8+checkpointing": {"base_model_precision": "fp8-layerwise", "gradient_checkpointing": True},
    "bf16+checkpointing+offload": {"base_model_precision": "bf16", "gradient_checkpointing": True,
                                   "enable_group_offload": True, "group_offload_use_stream": True},
}


def main() -> None:
    from benchmarks.gpu.train import MODELS
    from loraflow import estimates
    from loraflow.config import parse_config
    from loraflow.pipelines import get_family

    rows = []
    for family_name, model in MODELS.items():
        transformer_config = {"_class_name": model["class"], **model["config"]}
        (height, width), frames = model["size"], model["frames"]
        channels, spatial = model["vae"]
        latent = (channels, (frames - 1) // 4 + 1, height // spatial, width // spatial)
        for variant, settings in VARIANTS.items():
            config = parse_config({"model_family": family_name, "model_flavour": model["flavour"],
                                   "pretrained_model_name_or_path": str(ROOT),  # unused: configs are given
                                   "datasets": [{"id": "d", "instance_data_dir": str(ROOT / "configs")}],
                                   "lora_rank": 16, **settings})
            began = time.perf_counter()
            estimate = estimates.training_step(config, get_family(config), transformer_config, latent)
            row = {"family": family_name, "variant": variant, "size": f"{width}x{height}@{frames}",
                   "estimate_s": round(time.perf_counter() - began, 1), "folklore": FOLKLORE[family_name]}
            if not estimate.parts:  # HunyuanVideo 1.5: its forward reads tensor values (the note says which)
                rows.append({**row, "note": estimate.note})
                continue
            rows.append({**row, "peak_gib": round(estimate.peak_gib, 2), "step_tflop": round(estimate.tflop, 1),
                         "parts_gib": {k: round(v / 2**30, 3) for k, v in estimate.parts.items()}})
            print(rows[-1], flush=True)
    RESULTS.write_text(json.dumps({"device": "CPU (fake tensors)", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
