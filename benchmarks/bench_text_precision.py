"""CPU benchmark of `text_encoder_1_precision`: weight bytes, speed and drift of a real-size Qwen2.5-VL-7B layer.

One decoder layer of the language model at Qwen2.5-VL-7B's sizes (hidden 3584, MLP 18944, 28 heads, 4 KV heads;
random weights, seed 0) is built in fp32, then cast to bf16, or cast to bf16 and quantized by the text_embeds
stage's own `quantize_int8` (torchao int8 weight-only). Measured for each: the bytes of its weights (int8: the
int8 values plus their per-channel scales), the median time of a forward over 256 tokens, and the cosine of its
output against fp32's. The 7B model has 28 such layers; the token embedding (152064 x 3584) is not linear and
stays bf16 under int8, so it is listed beside them, computed, not measured.

The CPU has no int8 matmul fast path here: the time column says what the CPU does, not what a GPU does.

    .venv/bin/python benchmarks/bench_text_precision.py   # writes benchmarks/results/text_precision_cpu.json
    .venv/bin/python benchmarks/bench_text_precision.py --quick   # 16 tokens, one forward: that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("text_precision_cpu.json")
QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4}
LAYERS, VOCAB = 28, 152064
# --quick: a layer at a quarter of the widths (the real one's random init takes most of a minute)
QUICK = {"hidden_size": 896, "intermediate_size": 4736, "num_attention_heads": 7, "num_key_value_heads": 1}


def layer_model(precision: str, sizes: dict[str, int]):
    import torch
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from loraflow.stages.text.text_embeds import quantize_int8

    config = Qwen2_5_VLTextConfig(**sizes, num_hidden_layers=1, vocab_size=16, max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                   "mrope_section": [16, 24, 24]},
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5_VLTextModel(config).eval()
    if precision != "fp32":
        model.to(torch.bfloat16)
    if precision == "int8-torchao":
        quantize_int8(model, "text_encoder_1_precision")
    return model.layers[0], model


def weight_bytes(module) -> int:
    total = 0
    for param in module.parameters():
        parts = [getattr(param, n) for n in getattr(param, "tensor_data_names", [])] or [param]
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def run(precision: str, hidden, repeats: int, sizes: dict[str, int]):
    import torch

    layer, model = layer_model(precision, sizes)
    x = hidden.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    position_ids = torch.arange(x.shape[1])[None].expand(3, 1, -1)
    with torch.no_grad():
        embeddings = model.rotary_emb(x, position_ids)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            out = layer(x, position_embeddings=embeddings, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            times.append(time.perf_counter() - began)
    return weight_bytes(layer), statistics.median(times), out.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a quarter-width layer, 16 tokens: that it runs")
    args = parser.parse_args()
    sizes = QUICK if args.quick else QWEN7B
    if args.quick:
        args.tokens, args.repeats = 16, 1
    import torch

    hidden = torch.randn(1, args.tokens, sizes["hidden_size"], generator=torch.Generator().manual_seed(1))
    rows, reference = [], None
    for precision in ("fp32", "bf16", "int8-torchao"):
        nbytes, seconds, out = run(precision, hidden, args.repeats, sizes)
        reference = out if reference is None else reference
        cosine = torch.nn.functional.cosine_similarity(out.flatten(1), reference.flatten(1)).item()
        rows.append({"precision": precision, "layer_weight_mb": round(nbytes / 1e6, 1),
                     "layers_x28_gb": round(LAYERS * nbytes / 1e9, 2), "forward_ms": round(seconds * 1000, 1),
                     "cosine_vs_fp32": round(cosine, 5)})
        print(rows[-1], flush=True)
    result = {
        "benchmark": "text_encoder_1_precision on one real-size Qwen2.5-VL-7B decoder layer (random weights), CPU",
        "layer": sizes, "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
        "int8_vs_bf16_bytes": round(rows[2]["layer_weight_mb"] / rows[1]["layer_weight_mb"], 3),
        "token_embedding_gb_bf16": round(VOCAB * QWEN7B["hidden_size"] * 2 / 1e9, 2),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    record.write(args.out, result, indent=1, quick=args.quick)
    print(json.dumps({k: result[k] for k in ("int8_vs_bf16_bytes", "token_embedding_gb_bf16")}))


if __name__ == "__main__":
    main()
