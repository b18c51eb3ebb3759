"""int8 base models on the CPU: the tiny Kandinsky 5 transformer loaded in bf16 as training loads it, quantized by
torchao; bytes measured, one layer checked against its fp32 weights, and a peft LoRA that attaches and trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from loraflow.kernels.quantize import quantize_base_int8
from loraflow.pipelines.base import load_component
from tests.numerics import U32, gamma

BF16_U = 2.0**-8  # bf16's unit roundoff: 8 significant bits


@pytest.fixture
def int8_k5(tiny_k5: Path) -> torch.nn.Module:
    transformer = load_component(tiny_k5, "transformer", torch.bfloat16)
    quantize_base_int8(transformer)
    return transformer


def int8_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m.weight).__name__ == "Int8Tensor"}


def test_weights_take_about_half_the_bf16_bytes(int8_k5: torch.nn.Module) -> None:
    """Per layer: out x in int8 values, one fp32 scale and one int8 zero point per row, measured on the tensors;
    the modules Kandinsky 5 keeps in fp32 (modulation, time embeddings) stay fp32 linear layers."""
    layers = int8_layers(int8_k5)
    assert len(layers) == 30  # of 36 linear layers; the other 6 are time-embedding and modulation layers
    int8_bytes = sum(t.nbytes for m in layers.values() for t in (m.weight.qdata, m.weight.scale, m.weight.zero_point))
    bf16_bytes = sum(m.weight.qdata.numel() * 2 for m in layers.values())
    assert int8_bytes == sum(o * i + 5 * o for o, i in (m.weight.shape for m in layers.values()))
    assert int8_bytes < 0.6 * bf16_bytes  # 1 byte + 5 / in_features per weight (32 or 64 wide: 0.58 or 0.54 of bf16)
    kept = [n for n, m in int8_k5.named_modules() if isinstance(m, torch.nn.Linear) and n not in layers]
    assert len(kept) == 6 and all("modulation" in n or "time_embeddings" in n for n in kept)
    assert all(type(dict(int8_k5.named_modules())[n].weight) is torch.nn.Parameter for n in kept)
    assert all(dict(int8_k5.named_modules())[n].weight.dtype == torch.float32 for n in kept)


def test_a_layer_is_its_fp32_weights_within_half_a_scale(int8_k5: torch.nn.Module, tiny_k5: Path) -> None:
    """to_query of visual block 0 against the checkpoint's fp32 weights, in float64. Rounding w / s to an int8 moves a
    weight by at most s / 2 = max |row| / 255 (s = max |row| / 127.5), loading it in bf16 first by 2^-8 |w|; the layer
    computes with those int8 values (bf16 matmul, then the scale and the bias), and its output is the fp32 layer's
    within that weight error plus one 2^-8 rounding of each of those three steps (fp32 accumulation)."""
    name = "visual_transformer_blocks.0.self_attention.to_query"
    layer = dict(int8_k5.named_modules())[name]
    fp32 = load_file(str(tiny_k5 / "transformer" / "diffusion_pytorch_model.safetensors"))
    w, b = fp32[f"{name}.weight"].double(), fp32[f"{name}.bias"].double()
    q, scale = layer.weight.qdata, layer.weight.scale
    row_max = w.abs().amax(dim=1, keepdim=True)
    error = (q.double() * scale.double() - w).abs()
    assert (error <= row_max / 255 + BF16_U * w.abs()).all()
    assert (error > row_max / 1024).any()  # it is int8: beyond what bf16 alone moves a weight (2^-8 |w| <= max / 256)

    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(y, x @ q.T.bfloat16() * scale.bfloat16().flatten() + layer.bias)
    exact = x.double() @ w.T + b
    weights = ((row_max / 255 + BF16_U * w.abs()) @ x.double().abs().T).T
    magnitude = (w.abs() @ x.double().abs().T).T + b.abs()
    rounding = (3 * BF16_U + gamma(w.shape[1], U32)) * (1 + 2**-7) * magnitude
    assert ((y.double() - exact).abs() <= weights + rounding).all()


def test_lora_attaches_in_fp32_and_trains(int8_k5: torch.nn.Module) -> None:
    transformer = int8_k5
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_query", "to_key", "to_value"]))
    wrapped = dict(transformer.named_modules())["visual_transformer_blocks.0.self_attention.to_query"]
    assert type(wrapped).__name__ == "TorchaoLoraLinear"
    lora = {n: p for n, p in transformer.named_parameters() if "lora_" in n}
    for p in lora.values():
        p.data = p.data.float()
        p.requires_grad_(True)
    assert len(int8_layers(transformer)) == 30  # the base layers are still int8
    optimizer = torch.optim.AdamW(lora.values(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in lora.items()}
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 2, 4, 6, 33, generator=g).bfloat16()  # inputs in the compute dtype, as `denoise` casts
    inputs = dict(encoder_hidden_states=torch.randn(1, 5, transformer.config.in_text_dim, generator=g).bfloat16(),
                  pooled_projections=torch.randn(1, transformer.config.in_text_dim2, generator=g).bfloat16(),
                  timestep=torch.tensor([500.0]).bfloat16(),
                  visual_rope_pos=[torch.arange(2), torch.arange(2), torch.arange(3)],
                  text_rope_pos=torch.arange(5), scale_factor=(1, 1, 1), sparse_params=None, return_dict=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = transformer(hidden_states=hidden, **inputs).float().square().mean()
    loss.backward()
    grads = [p.grad for n, p in lora.items() if "lora_B" in n]
    assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)  # lora_B starts at 0: only A's grad is 0
    optimizer.step()
    assert all(p.dtype == torch.float32 for p in lora.values())
    assert any(not torch.equal(before[n], p) for n, p in lora.items())


@pytest.mark.parametrize("kept", ["bf16", "fp8"])
def test_kept_modules_are_stored_small_and_compute_in_fp32(tiny_k5: Path, kept: str) -> None:
    """`fp32_modules_storage`: Kandinsky 5's time embeddings and modulations stored in bf16 / fp8 under a bf16 base;
    the model still reads as bf16 (`dtype`, what its pipelines cast their inputs to), and the kept layers compute
    in fp32 (their fp32 inputs would not meet a bf16 weight)."""
    from loraflow.config import parse_config
    from loraflow.kernels.quantize import KEPT_STORAGE, store_frozen
    from loraflow.pipelines import get_family

    transformer = load_component(tiny_k5, "transformer", torch.bfloat16)
    store_frozen(transformer, "bf16", kept)
    keep = set(type(transformer)._keep_in_fp32_modules)
    stored = {n: p.dtype for n, p in transformer.named_parameters() if keep & set(n.split(".")) and "weight" in n}
    assert stored and set(stored.values()) == {KEPT_STORAGE[kept]}
    assert transformer.dtype == torch.bfloat16
    family = get_family(parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": "m",
                                      "datasets": [{"id": "d", "instance_data_dir": "x"}]}))
    text = {k: torch.ones(1, *v.shape) for k, v in family.example_text_row(transformer.config, 4).items()}
    with torch.no_grad():
        velocity = family.velocity(transformer, torch.ones(1, 16, 2, 4, 4), torch.full((1,), 0.5), text)
    assert velocity.isfinite().all() and set(stored.values()) == {KEPT_STORAGE[kept]}  # stored small again after
