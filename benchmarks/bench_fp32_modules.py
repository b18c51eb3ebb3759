"""What storing Kandinsky 5's fp32-kept modules (`_keep_in_fp32_modules`: time embeddings and modulations) in bf16 or
fp8 changes, and what it saves (`fp32_modules_storage`, kernels/quantize.py `store_kept`).

Numbers: the tiny Kandinsky 5 Video transformer (loraflow/pipelines/kandinsky5/tiny_parts.py: its modulations
re-randomised, since diffusers initialises them to zero) with a bf16 base, its velocity on a fixed batch at three
sigmas for each storage of the kept modules, against the same call of the fp32 model (base and kept modules fp32):
relative L2 error ||v - v_fp32|| / ||v_fp32||. The bf16 base with fp32-kept modules is the reference error: what
`base_model_precision: bf16` itself costs. Also the kept weights' magnitudes (fp8 e4m3 keeps 3 mantissa bits above 2^-6
and fewer below). Bytes: the released transformers' kept modules (loraflow/pipelines/released/, meta models: no weights
read).

    python benchmarks/bench_fp32_modules.py      # writes benchmarks/results/fp32_modules_cpu.json
    python benchmarks/bench_fp32_modules.py --quick   # Kandinsky 5 Lite's kept bytes only: that it runs
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("fp32_modules_cpu.json")
SIGMAS = (0.9, 0.5, 0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Kandinsky 5 Lite's kept bytes only: that it runs")
    quick = parser.parse_args().quick
    import torch

    from loraflow.config import parse_config
    from loraflow.demo.tiny import build_tiny
    from loraflow.estimates.fake_tensors import meta_model
    from loraflow.kernels.quantize import store_frozen
    from loraflow.pipelines import get_family
    from loraflow.pipelines.base import load_component
    from loraflow.pipelines.released import released_config

    with tempfile.TemporaryDirectory() as folder:
        tiny = build_tiny("kandinsky5-video", Path(folder) / "k5")
        config = parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tiny),
                               "datasets": [{"id": "d", "instance_data_dir": folder}]})
        family = get_family(config)
        fp32 = load_component(tiny, "transformer")
        bf16 = load_component(tiny, "transformer", torch.bfloat16)
    keep = set(type(fp32)._keep_in_fp32_modules)
    kept = torch.cat([p.detach().flatten().abs() for n, p in fp32.named_parameters() if keep & set(n.split("."))])
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 16, 3, 6, 8, generator=generator)
    row = family.example_text_row(fp32.config, 12)
    text = {k: torch.randn(1, *v.shape, generator=generator) for k, v in row.items()}

    def velocities(model: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [family.velocity(model, noisy, torch.full((1,), s), text) for s in SIGMAS]

    reference = velocities(fp32)
    rows = {}
    for storage in ("fp32", "bf16", "fp8"):
        model = copy.deepcopy(bf16)
        store_frozen(model, "bf16", storage)
        errors = [((v - r).norm() / r.norm()).item() for v, r in zip(velocities(model), reference)]
        rows[storage] = {"relative_error_vs_fp32_model": [round(e, 6) for e in errors]}
        print(storage, rows[storage], flush=True)
    released = {}
    for flavour in ("t2v-lite-sft-5s",) if quick else ("t2v-lite-sft-5s", "t2v-pro-sft-5s-hd"):
        model = meta_model(released_config(flavour, "transformer"), torch.bfloat16)
        count = sum(p.numel() for n, p in model.named_parameters() if keep & set(n.split(".")))
        released[flavour] = {"kept_parameters": count, **{f"{s}_gib": round(count * b / 2**30, 2)
                                                          for s, b in (("fp32", 4), ("bf16", 2), ("fp8", 1))}}
        print(flavour, released[flavour], flush=True)
    magnitudes = {"median": kept.median().item(), "below_fp8_normal_2^-6": (kept < 2**-6).float().mean().item()}
    model = "tiny Kandinsky 5 Video (loraflow/pipelines/kandinsky5/tiny_parts.py)"
    result = {"device": "CPU", "model": model, "base_model_precision": "bf16", "sigmas": SIGMAS, "storage": rows,
              "tiny_kept_weight_magnitudes": magnitudes, "released": released}
    record.write(RESULTS, result, indent=1, quick=quick)


if __name__ == "__main__":
    main()
