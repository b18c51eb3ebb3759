"""The LoRA files the lora stage writes, applied as ComfyUI applies them, numerically, on the tiny real transformers.

ComfyUI is not installed here, so the test plays its part from its source (Comfy-Org/ComfyUI, each file read at
the commit named; loraflow/pipelines/comfyui.py says the same in prose):
- comfy/sd.py `load_lora_for_models` (a125cd84): convert_lora, then the key map, then load_lora, then the patches;
  comfy/lora_convert.py `convert_lora` (2bffe2f4) renames none of loraflow's files (BFL control, Wan Fun, USO and
  fused `to_qkv` layouts only), so the test skips it.
- comfy/lora.py `model_lora_keys_unet` (ec93dcac), the key map (`comfyui_key_map`): for every model weight
  `diffusion_model.<w>.weight`, `diffusion_model.<w>` and `lora_unet_<w, dots as _>`; Kandinsky5 adds `<w>` and
  `transformer.<w>`; HunyuanVideo adds `transformer.<w'>` / `diffusion_model.<w'>`, w' in diffusion-pipe's spelling.
  The weights are the model's under ComfyUI's names (`Layout`; HunyuanVideo 1.5: Flux's DoubleStreamBlock, q, k, v
  concatenated into `img_attn.qkv` / `txt_attn.qkv`, comfy/ldm/flux/layers.py).
- comfy/lora.py `load_lora` with comfy/weight_adapter/lora.py `LoRAAdapter.load` (6f98b150), which tensors of a
  file are taken (`comfyui_load`): per mapped key x, `x.lora_up.weight` + `x.lora_down.weight`, else
  `x.lora_B.weight` + `x.lora_A.weight`; the alpha from `x.alpha` only; every other key is "lora key not loaded".
- `LoRAAdapter.calculate_weight`: W += (alpha / rank) * up @ down, rank = down.shape[0], factor 1 without alpha.
The patched weights, mapped back to diffusers names, must be the peft adapter's merge (W + scale * B @ A, peft's
`get_delta_weight`) on every adapted linear, with lora_alpha 8 on rank 4: a reader that missed the scale would
apply half the adapter.

Bit for bit, by construction on any CPU: the adapter's entries are multiples of 1/64 below 1 in magnitude, so every
product of an A and a B entry is a multiple of 2^-12 below 1, every sum of up to 12 of them (HunyuanVideo 1.5 fuses
3 parts of rank 4) needs at most 16 significant bits, and the scale is 2 (exact wherever it is multiplied in): every
delta is exact in fp32, whatever order a matmul kernel sums in. Adding it to the base weight is one IEEE rounding,
the same everywhere. (With full random fp32 entries ComfyUI's `up @ down` and peft's `B @ A` round differently, and
the tiny transformers amplify a last-bit weight difference up to 6e-5 in the output with MKL's AVX2 kernels: AMD
CPUs, or MKL_ENABLE_INSTRUCTIONS=AVX2.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from loraflow.config import ConfigError, parse_config
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import load_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE, ComfyRule, comfyui_name, to_comfyui
from loraflow.training.checkpoints import (
    LORA_FILE,
    LoraExport,
    adapter_config,
    export_lora,
    lora_state,
    writes_comfyui,
)

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


def kandinsky5_keys(name: str) -> list[str]:
    """comfy/lora.py `model_lora_keys_unet`, `isinstance(model, Kandinsky5)`: the module name, bare and prefixed."""
    return [name, f"transformer.{name}"]


def hunyuanvideo_keys(name: str) -> list[str]:
    """comfy/lora.py `model_lora_keys_unet`, `isinstance(model, HunyuanVideo)` (diffusion-pipe's spelling)."""
    spelled = f"diffusion_model.{name}.weight".replace("_mod.lin.", "_mod.linear.").replace(
        "_attn.qkv.", "_attn_qkv.").replace("_attn.proj.", "_attn_proj.").replace("mlp.0.", "mlp.fc1.").replace(
        "mlp.2.", "mlp.fc2.").replace(".modulation.lin.", ".modulation.linear.")
    spelled = spelled.removeprefix("diffusion_model.").removesuffix(".weight")
    return [f"transformer.{spelled}", f"diffusion_model.{spelled}"]


def comfyui_key_map(layout: Layout, family_keys: Callable[[str], list[str]]) -> dict[str, str]:
    """LoRA key -> ComfyUI module, as `model_lora_keys_unet` builds it for these weights: the generic keys of every
    model, then the family's own (a later entry wins, as in ComfyUI's dict)."""
    key_map = {}
    for name in layout:
        key_map[f"lora_unet_{name.replace('.', '_')}"] = name
        key_map[f"diffusion_model.{name}"] = name
    for name in layout:
        key_map |= {key: name for key in family_keys(name)}
    return key_map


@dataclass(frozen=True)
class Patch:
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None


def comfyui_load(lora: dict[str, torch.Tensor], key_map: dict[str, str]) -> tuple[dict[str, Patch], list[str]]:
    """comfy/lora.py `load_lora` with `LoRAAdapter.load`: {ComfyUI module: patch} and the keys it would log as
    "lora key not loaded"."""
    patches, loaded = {}, set()
    for x, name in key_map.items():
        for up, down in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            if x + up in lora:
                alpha = lora[x + ".alpha"].item() if x + ".alpha" in lora else None
                patches[name] = Patch(lora[x + up], lora[x + down], alpha)
                loaded |= {x + up, x + down} | ({x + ".alpha"} if alpha is not None else set())
                break
    return patches, sorted(set(lora) - loaded)


def comfyui_apply(path: Path, layout: Layout, patches: dict[str, Patch]) -> dict[str, torch.Tensor]:
    """`LoRAAdapter.calculate_weight` on the ComfyUI-named weights at strength 1, mapped back to diffusers names (the
    split is the inverse of the concatenation in `layout`)."""
    base = load_component(path, "transformer").state_dict()
    fused = {name: torch.cat([base[p + ".weight"] for p in parts]) for name, parts in layout.items()}
    for name, patch in patches.items():
        scale = 1.0 if patch.alpha is None else patch.alpha / patch.down.shape[0]
        fused[name] += scale * patch.up @ patch.down
    patched = dict(base)
    for name, parts in layout.items():
        for part, weight in zip(parts, fused[name].chunk(len(parts))):
            patched[part + ".weight"] = weight
    return patched


def k5_text(batch: int, tokens: int, dim: int) -> dict[str, torch.Tensor]:
    return {"text_embeds": torch.randn(batch, tokens, dim), "pooled_embeds": torch.randn(batch, dim)}


def hv15_text(batch: int, tokens: int, dim: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, tokens)
    mask[0, -2:] = 0  # some padding, as collate_text makes
    return {"text_embeds": torch.randn(batch, tokens, dim), "text_mask": mask,
            "byt5_embeds": torch.randn(batch, 3, dim), "byt5_mask": torch.ones(batch, 3)}


CASES = {  # family: (ComfyUI layout, ComfyUI's family keys, latent shape (C, T, h, w), text builder)
    "kandinsky5-video": (k5_layout, kandinsky5_keys, (16, 2, 4, 4), k5_text),
    "kandinsky5-image": (k5_layout, kandinsky5_keys, (16, 1, 4, 4), k5_text),
    "hunyuanvideo-1.5": (hv15_layout, hunyuanvideo_keys, (32, 2, 4, 4), hv15_text),
}


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


@dataclass(frozen=True)
class Exported:
    name: str
    path: Path  # the tiny checkpoint
    folder: Path  # what the lora stage's export wrote for the adapter
    transformer: torch.nn.Module  # with the peft adapter
    merged: dict[str, torch.Tensor]  # the base weights + peft's merge of the adapter


@pytest.fixture(scope="module")
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    name = request.param
    family = load_family(name)
    path = build_tiny(name, tmp_path_factory.mktemp("models") / name)
    transformer = adapted(path, family)
    folder = tmp_path_factory.mktemp("lora")
    export_lora(folder, lora_state(transformer), LoraExport(adapter_config(transformer), family, comfyui=True))
    base = load_component(path, "transformer").state_dict()
    with torch.no_grad():
        deltas = {n: m.get_delta_weight("default") for n, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    assert deltas
    merged = {key: base[key] + deltas[key.removesuffix(".weight")] if key.removesuffix(".weight") in deltas
              and key.endswith(".weight") else base[key] for key in base}
    return Exported(name, path, folder, transformer, merged)


def velocity_fn(family, latent_shape, text_builder, dim: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    generator = torch.random.fork_rng(devices=[])
    with generator:
        torch.manual_seed(1)
        noisy = torch.randn(2, *latent_shape)
        text = text_builder(2, 7, dim)
    sigma = torch.tensor([0.3, 0.8])
    return lambda transformer: family.velocity(transformer, noisy, sigma, text)


def loaded_by_comfyui(exported: Exported, file: str) -> tuple[dict[str, Patch], list[str], Layout]:
    layout_fn, family_keys, _, _ = CASES[exported.name]
    layout = layout_fn(load_component(exported.path, "transformer"))
    patches, not_loaded = comfyui_load(load_file(exported.folder / file), comfyui_key_map(layout, family_keys))
    return patches, not_loaded, layout


# every file ComfyUI reads: the ComfyUI file of each family, and the diffusers file where ComfyUI's key map has
# diffusers' names (Kandinsky 5); the HunyuanVideo 1.5 diffusers file is not for ComfyUI (the next test)
COMFYUI_READS = [(name, COMFYUI_LORA_FILE) for name in sorted(CASES)] + [
    ("kandinsky5-image", LORA_FILE), ("kandinsky5-video", LORA_FILE)]


@pytest.mark.parametrize(("exported", "file"), COMFYUI_READS, indirect=["exported"])
@torch.no_grad()
def test_comfyui_loads_every_key_at_peft_strength(exported: Exported, file: str) -> None:
    family = load_family(exported.name)
    patches, not_loaded, layout = loaded_by_comfyui(exported, file)
    assert not not_loaded, f"ComfyUI would log 'lora key not loaded' for {len(not_loaded)} keys, e.g. {not_loaded[:2]}"
    patched = comfyui_apply(exported.path, layout, patches)

    # 1. weights: ComfyUI's patch is peft's own merge on every adapted linear, and leaves the rest alone
    assert sorted(patched) == sorted(exported.merged)
    differ = [key for key in exported.merged if not torch.equal(patched[key], exported.merged[key])]
    assert not differ, f"{len(differ)} weights differ from W + scale * B @ A, e.g. {differ[0]}"

    # 2. output: the patched model renders what the merged peft adapter renders, and not what the base model renders
    _, _, latent_shape, text_builder = CASES[exported.name]
    transformer = exported.transformer
    dim = transformer.config.get("in_text_dim") or transformer.config.text_embed_dim
    velocity = velocity_fn(family, latent_shape, text_builder, dim)
    plain = load_component(exported.path, "transformer")
    base_out = velocity(plain)
    plain.load_state_dict(exported.merged)
    from_peft = velocity(plain)
    plain.load_state_dict(patched)
    from_comfyui = velocity(plain)
    assert (from_peft - base_out).abs().max() > 1e-2  # the adapter changes the output: the check can fail
    assert torch.equal(from_comfyui, from_peft)  # the same weights, the same kernels: the same bits
    # and the merged adapter is the adapter peft trains with (its unmerged forward, up to fp32 rounding; a file
    # at half strength would be off by about half the adapter's effect)
    effect = (from_peft - base_out).abs().max()
    assert (velocity(transformer) - from_peft).abs().max() < 1e-2 * effect


@pytest.mark.parametrize("exported", ["hunyuanvideo-1.5"], indirect=True)
def test_hunyuanvideo15_diffusers_file_is_not_for_comfyui(exported: Exported) -> None:
    """ComfyUI's key map for HunyuanVideo has ComfyUI's and diffusion-pipe's names only: it takes none of the diffusers
    file's keys, as README and docs/families.md say (the ComfyUI file beside it is the one for ComfyUI)."""
    patches, not_loaded, _ = loaded_by_comfyui(exported, LORA_FILE)
    assert not patches and len(not_loaded) == len(load_file(exported.folder / LORA_FILE))


@pytest.mark.parametrize("exported", ["kandinsky5-video"], indirect=True)
def test_diffusers_kandinsky5_loader_refuses_alpha_keys(exported: Exported, tmp_path: Path) -> None:
    """Why the diffusers file is written at unit scale instead of carrying ComfyUI's `<key>.alpha`: diffusers' Kandinsky
    5 `load_lora_weights`, the loader README gives users, refuses a file with any key not naming `lora`."""
    from diffusers import Kandinsky5T2VPipeline
    from safetensors.torch import save_file

    lora = load_file(exported.folder / LORA_FILE)
    alphas = {k.replace(".lora_A.weight", ".alpha"): torch.tensor(float(RANK)) for k in lora if "lora_A" in k}
    save_file(lora | alphas, tmp_path / LORA_FILE)
    pipe = Kandinsky5T2VPipeline.from_pretrained(exported.path, text_encoder=None, tokenizer=None,
                                                 text_encoder_2=None, tokenizer_2=None)
    with pytest.raises(ValueError, match="all LoRA param names contain `'lora'`"):
        pipe.load_lora_weights(str(tmp_path))
    pipe.load_lora_weights(str(exported.folder))  # the file as written loads


def test_the_default_writes_comfyuis_file_for_every_kind_comfyui_applies() -> None:
    """`lora_format` unset: the ComfyUI file for LoRA and LoKr/LoHa, none for DoRA (nor LoKr/LoHa where ComfyUI fuses
    q/k/v); `comfyui` asked where it cannot be is an error before training; `diffusers` opts out."""
    from tests.factory import demo

    k5, hv15 = load_family("kandinsky5-video"), load_family("hunyuanvideo-1.5")
    lycoris = {"lora_type": "lycoris", "lycoris_config": {"algo": "lokr", "linear_dim": 4, "linear_alpha": 1}}
    assert writes_comfyui(parse_config(demo()), k5) and writes_comfyui(parse_config(demo()), hv15)
    assert writes_comfyui(parse_config(demo() | lycoris), k5)
    assert not writes_comfyui(parse_config(demo() | lycoris), hv15)
    assert not writes_comfyui(parse_config(demo() | {"use_dora": True}), k5)
    assert not writes_comfyui(parse_config(demo() | {"lora_format": "diffusers"}), k5)
    with pytest.raises(ValueError, match="lora_format: comfyui.*q/k/v.*use lora_format diffusers"):
        writes_comfyui(parse_config(demo() | lycoris | {"lora_format": "comfyui"}), hv15)


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
    from tests.factory import demo

    data = demo()
    assert parse_config(data).lora_format is None  # unset: both files where ComfyUI can apply the adapter
    data["lora_format"] = "diffusers"
    assert parse_config(data).lora_format == "diffusers"
    data["lora_format"] = "comfyui"
    assert parse_config(data).lora_format == "comfyui"
    data["lora_format"] = "musubi"
    assert parse_config(data).lora_format == "musubi"
    data["lora_format"] = "kohya"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    (problem,) = info.value.problems
    assert problem.startswith("lora_format:") and "comfyui" in problem and "kohya" in problem
