"""The ComfyUI export, load-tested numerically on the tiny real transformers.

ComfyUI is not installed here, so the test plays its part from its source (comfyanonymous/ComfyUI): the model's
weights under ComfyUI's module names (for HunyuanVideo 1.5, Flux's DoubleStreamBlock: q, k, v concatenated into
`img_attn.qkv` / `txt_attn.qkv`, comfy/ldm/flux/layers.py), every LoRA key resolved to one of those weights or the
test fails (comfy/lora.py only logs unknown keys), and the patch W += (alpha / rank) * up @ down with
rank = down.shape[0] (comfy/weight_adapter/lora.py). The patched weights, mapped back to diffusers names, must give
the transformer output of the peft adapter they came from, merged (W + scale * B @ A, peft's `get_delta_weight`).

Bit for bit, by construction on any CPU: the adapter's entries are multiples of 1/64 below 1 in magnitude, so every
product of an A and a B entry is a multiple of 2^-12 below 1, every sum of up to 12 of them (HunyuanVideo 1.5 fuses
3 parts of rank 4) needs at most 16 significant bits, and the scale is 2: every delta is exact in fp32, whatever
order a matmul kernel sums in. Adding it to the base weight is one IEEE rounding, the same everywhere. (With full
random fp32 entries ComfyUI's `up @ down` and peft's `B @ A` round differently, and the tiny transformers amplify a
last-bit weight difference up to 6e-5 in the output with MKL's AVX2 kernels: AMD CPUs, or
MKL_ENABLE_INSTRUCTIONS=AVX2.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from loraflow.config import ConfigError, parse_config
from loraflow.pipelines import load_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE, ComfyRule, comfyui_name, save_comfyui_lora, to_comfyui
from loraflow.demo.tiny import build_tiny

RANK, ALPHA = 4, 8.0  # scale 2: a file whose alpha were ignored would render at half strength

Layout = dict[str, list[str]]  # ComfyUI module -> the diffusers linears it concatenates along dim 0


def k5_layout(transformer: torch.nn.Module) -> Layout:
    """ComfyUI's Kandinsky5 (comfy/ldm/kandinsky5/model.py) has the diffusers module names, one linear each."""
    return {name: [name] for name, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and "_transformer_blocks." in name}


def hv15_layout(transformer: torch.nn.Module) -> Layout:
    """ComfyUI's double blocks, written out from comfy/ldm/flux/layers.py and diffusers'
    scripts/convert_hunyuan_video1_5_to_diffusers.py (Tencent img_attn_q -> attn.to_q, ...)."""
    layout = {}
    for i in range(len(transformer.transformer_blocks)):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        layout |= {
            d + "img_attn.qkv": [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"],
            d + "txt_attn.qkv": [b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"],
            d + "img_attn.proj": [b + "attn.to_out.0"],
            d + "txt_attn.proj": [b + "attn.to_add_out"],
            d + "img_mlp.0": [b + "ff.net.0.proj"],
            d + "img_mlp.2": [b + "ff.net.2"],
            d + "txt_mlp.0": [b + "ff_context.net.0.proj"],
            d + "txt_mlp.2": [b + "ff_context.net.2"],
        }
    return layout


def k5_text(batch: int, tokens: int, dim: int) -> dict[str, torch.Tensor]:
    return {"text_embeds": torch.randn(batch, tokens, dim), "pooled_embeds": torch.randn(batch, dim)}


def hv15_text(batch: int, tokens: int, dim: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, tokens)
    mask[0, -2:] = 0  # some padding, as collate_text makes
    return {"text_embeds": torch.randn(batch, tokens, dim), "text_mask": mask,
            "byt5_embeds": torch.randn(batch, 3, dim), "byt5_mask": torch.ones(batch, 3)}


CASES = {  # family: (ComfyUI layout, latent shape (C, T, h, w), text builder)
    "kandinsky5-video": (k5_layout, (16, 2, 4, 4), k5_text),
    "kandinsky5-image": (k5_layout, (16, 1, 4, 4), k5_text),
    "hunyuanvideo-1.5": (hv15_layout, (32, 2, 4, 4), hv15_text),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    family = load_family(name)
    path = build_tiny(name, tmp_path_factory.mktemp("models") / name)
    return name, family, path


def adapted(path: Path, family) -> torch.nn.Module:
    """The tiny transformer with a trained-looking adapter: every targeted linear, random non-zero A and B, each entry
    a multiple of 1/64 (module docstring: the deltas are exact)."""
    transformer = load_component(path, "transformer")
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=family.lora_targets(True)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.copy_(dyadic(torch.randn(param.shape, generator=generator) * 0.2))
    return transformer


def dyadic(values: torch.Tensor) -> torch.Tensor:
    """Rounded to multiples of 1/64, inside (-1, 1)."""
    return (values * 64).round().clamp(-63, 63) / 64


def comfyui_apply(path: Path, layout: Layout, lora_file: Path) -> dict[str, torch.Tensor]:
    """What ComfyUI's loader does to the base weights, mapped back to diffusers names (the split is the inverse of
    the concatenation in `layout`)."""
    base = load_component(path, "transformer").state_dict()
    fused = {name: torch.cat([base[p + ".weight"] for p in parts]) for name, parts in layout.items()}
    lora = load_file(lora_file)
    for key in [k for k in lora if k.endswith(".lora_up.weight")]:
        name = key.removeprefix("diffusion_model.").removesuffix(".lora_up.weight")
        assert name in fused, f"ComfyUI would not load {key}: no weight diffusion_model.{name}.weight"
        up, down = lora[key], lora[key.replace("lora_up", "lora_down")]
        alpha = lora[key.replace("lora_up.weight", "alpha")].item()
        fused[name] += (alpha / down.shape[0]) * up @ down
    patched = dict(base)
    for name, parts in layout.items():
        for part, weight in zip(parts, fused[name].chunk(len(parts))):
            patched[part + ".weight"] = weight
    return patched


def velocity_fn(family, latent_shape, text_builder, dim: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    generator = torch.random.fork_rng(devices=[])
    with generator:
        torch.manual_seed(1)
        noisy = torch.randn(2, *latent_shape)
        text = text_builder(2, 7, dim)
    sigma = torch.tensor([0.3, 0.8])
    return lambda transformer: family.velocity(transformer, noisy, sigma, text)


@torch.no_grad()
def test_comfyui_lora_reproduces_the_peft_adapter(case, tmp_path: Path) -> None:
    name, family, path = case
    layout_fn, latent_shape, text_builder = CASES[name]
    transformer = adapted(path, family)
    from loraflow.training.checkpoints import adapter_config, lora_state

    lora_file = save_comfyui_lora(lora_state(transformer), adapter_config(transformer), family.comfyui_names,
                                  tmp_path / COMFYUI_LORA_FILE)
    patched = comfyui_apply(path, layout_fn(load_component(path, "transformer")), lora_file)

    # 1. weights: ComfyUI's patch is peft's own merge on every adapted linear, and leaves the rest alone
    base = load_component(path, "transformer").state_dict()
    deltas = {n: m.get_delta_weight("default") for n, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    assert deltas
    merged = {key: base[key] + deltas[key.removesuffix(".weight")] if key.removesuffix(".weight") in deltas
              and key.endswith(".weight") else base[key] for key in base}
    assert sorted(patched) == sorted(merged)
    differ = [key for key in merged if not torch.equal(patched[key], merged[key])]
    assert not differ, f"{len(differ)} weights differ from W + scale * B @ A, e.g. {differ[0]}"

    # 2. output: the patched model renders what the merged peft adapter renders, and not what the base model renders
    dim = transformer.config.get("in_text_dim") or transformer.config.text_embed_dim
    velocity = velocity_fn(family, latent_shape, text_builder, dim)
    plain = load_component(path, "transformer")
    base_out = velocity(plain)
    plain.load_state_dict(merged)
    from_peft = velocity(plain)
    plain.load_state_dict(patched)
    from_comfyui = velocity(plain)
    assert (from_peft - base_out).abs().max() > 1e-2  # the adapter changes the output: the check can fail
    assert torch.equal(from_comfyui, from_peft)  # the same weights, the same kernels: the same bits
    # and the merged adapter is the adapter peft trains with (its unmerged forward, up to fp32 rounding; a file
    # at half strength would be off by about half the adapter's effect)
    effect = (from_peft - base_out).abs().max()
    assert (velocity(transformer) - from_peft).abs().max() < 1e-2 * effect


def test_hunyuanvideo15_names_follow_comfyui_double_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    family = load_family("hunyuanvideo-1.5")
    assert comfyui_name(family.comfyui_names, "transformer_blocks.53.attn.add_v_proj") == (
        "double_blocks.53.txt_attn.qkv", 2, 3)
    assert comfyui_name(family.comfyui_names, "transformer_blocks.7.ff_context.net.2") == (
        "double_blocks.7.txt_mlp.2", 0, 1)
    with pytest.raises(ValueError, match="no ComfyUI name"):  # the token refiner is never exported silently
        comfyui_name(family.comfyui_names, "context_embedder.token_refiner.refiner_blocks.0.attn.to_q")


def test_fused_parts_with_unequal_ranks_and_a_missing_part() -> None:
    """Block-diagonal fusion, checked against the definition: the fused update's row blocks are each part's
    scale * B @ A, zero for a part without an adapter (here k), whatever each part's rank."""
    rules = (ComfyRule(r"a\.q", "qkv", 0, 3), ComfyRule(r"a\.k", "qkv", 1, 3), ComfyRule(r"a\.v", "qkv", 2, 3))
    g = torch.Generator().manual_seed(0)
    parts = {"a.q": 2, "a.v": 5}  # ranks
    state = {}
    for module, rank in parts.items():
        state[f"{module}.lora_A.weight"] = torch.randn(rank, 6, generator=g)
        state[f"{module}.lora_B.weight"] = torch.randn(4, rank, generator=g)
    out = to_comfyui(state, {"lora_alpha": 3.0}, rules)
    up, down = out["diffusion_model.qkv.lora_up.weight"], out["diffusion_model.qkv.lora_down.weight"]
    fused = out["diffusion_model.qkv.alpha"].item() / down.shape[0] * up @ down  # ComfyUI's patch
    q, k, v = fused.chunk(3)
    for block, module in ((q, "a.q"), (v, "a.v")):
        scale = 3.0 / parts[module]
        torch.testing.assert_close(block, scale * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"])
    assert not k.any()


def test_unmapped_or_half_modules_fail_loudly() -> None:
    rules = (ComfyRule(r"x", "x"),)
    with pytest.raises(ValueError, match="only lora_A"):
        to_comfyui({"x.lora_A.weight": torch.ones(1, 2)}, None, rules)
    with pytest.raises(ValueError, match="not a peft LoRA key"):
        to_comfyui({"x.weight": torch.ones(1, 2)}, None, rules)


def test_lora_format_is_validated() -> None:
    from tests.test_config import demo

    data = demo()
    assert parse_config(data).lora_format == "diffusers"
    data["lora_format"] = "comfyui"
    assert parse_config(data).lora_format == "comfyui"
    data["lora_format"] = "kohya"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    (problem,) = info.value.problems
    assert problem.startswith("lora_format:") and "comfyui" in problem and "kohya" in problem
