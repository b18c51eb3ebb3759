"""The musubi-tuner LoRA file: musubi's names for exactly the adapted modules, at every released transformer's size,
and merged as musubi merges it on the tiny real transformers, peft's own merge bit for bit.

musubi-tuner is not installed here; tests/pipelines/musubi_reference.py writes down its names and models from its
code (kohya-ss/musubi-tuner at musubi_reference.COMMIT) and `musubi_merge` plays its loaders: for every weight
`<path>.weight` of musubi's model, `lora_unet_<path, . as _>` with `.lora_down.weight` / `.lora_up.weight` in the
file is merged as W += multiplier * (up @ down) * alpha / r (utils/lora_utils.py `load_safetensors_with_lora_and_fp8`
for HunyuanVideo 1.5; networks/lora.py `LoRAInfModule.merge_to` for Kandinsky 5, whose modules
`create_network_from_weights` makes for the file's `lora_down` names found in the model). A file naming no module of
musubi's model merges nothing, with no error: "create LoRA for U-Net/DiT: 0 modules".

Bit for bit as in tests/pipelines/test_comfyui.py (its docstring): dyadic adapter entries, scale 2, every delta exact
in fp32 whatever a matmul kernel's order.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from loraflow.config import parse_config
from loraflow.demo.tiny import build_tiny
from loraflow.estimates.fake_tensors import released_model
from loraflow.pipelines import load_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
from loraflow.pipelines.musubi import MUSUBI_LORA_FILE, to_musubi
from loraflow.pipelines.released import released_config
from loraflow.training.checkpoints import LORA_FILE, LoraExport, adapter_config, export_lora, lora_state, writes_musubi
from tests.pipelines.musubi_reference import MODULES, MusubiModule, lora_name
from tests.pipelines.test_comfyui import ALPHA, RANK, adapted

# one flavour per distinct released transformer config musubi loads (loraflow/pipelines/released/)
RELEASED = [("kandinsky5-video", "t2v-lite-sft-5s"), ("kandinsky5-video", "t2v-lite-sft-10s"),
            ("kandinsky5-video", "t2v-pro-sft-5s-hd"), ("kandinsky5-video", "t2v-pro-sft-10s-hd"),
            ("kandinsky5-image", "t2i-lite-sft"), ("kandinsky5-image", "i2i-lite-sft"),
            ("hunyuanvideo-1.5", "t2v-720p"), ("hunyuanvideo-1.5", "i2v-480p")]


def expected_keys(modules: dict[str, MusubiModule], include_ffn: bool, rank: int) -> dict[str, tuple[int, ...]]:
    """musubi's tensor names and shapes for the modules loraflow adapts."""
    keys = {}
    for path, module in modules.items():
        if module.ffn and not include_ffn:
            continue
        out, inp = module.shape
        name = lora_name(path)
        keys |= {f"{name}.lora_down.weight": (rank, inp), f"{name}.lora_up.weight": (out, rank), f"{name}.alpha": ()}
    return keys


@pytest.mark.parametrize(("family_name", "flavour"), RELEASED)
@pytest.mark.parametrize("include_ffn", [True, False])
def test_the_file_has_musubis_names_for_every_adapted_module(family_name: str, flavour: str,
                                                             include_ffn: bool) -> None:
    """The released transformer (the real diffusers class on the meta device) with loraflow's adapter: the musubi
    file's keys are exactly musubi's names for the adapted modules, shapes (r, in) / (out, r), alpha peft's."""
    family = load_family(family_name, flavour)
    with torch.device("meta"):
        transformer = released_model(flavour, "transformer")
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=family.lora_targets(include_ffn)))
    state = {k: torch.zeros(v.shape) for k, v in get_peft_model_state_dict(transformer).items()}
    tensors = to_musubi(state, adapter_config(transformer), family.musubi_names)
    modules = MODULES[family_name](released_config(flavour, "transformer"))
    expected = expected_keys(modules, include_ffn, RANK)
    assert sorted(tensors) == sorted(expected)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    alphas = {tensors[k].item() for k in tensors if k.endswith(".alpha")}
    assert alphas == {ALPHA} and all(v.dtype == torch.float32 for v in tensors.values())


def musubi_merge(lora: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                 multiplier: float = 1.0) -> tuple[dict[str, torch.Tensor], set[str]]:
    """musubi's merge (module docstring) of `lora` into its model's `weights`: (merged weights, the LoRA names
    merged)."""
    merged, used = dict(weights), set()
    for key, weight in weights.items():
        if not key.endswith(".weight"):
            continue
        name = lora_name(key.removesuffix(".weight"))
        down, up = lora.get(f"{name}.lora_down.weight"), lora.get(f"{name}.lora_up.weight")
        if down is None or up is None:
            continue
        alpha = lora.get(f"{name}.alpha", down.shape[0])
        merged[key] = weight + multiplier * (up @ down) * (alpha / down.shape[0])
        used.add(name)
    return merged, used


def musubi_weights(base: dict[str, torch.Tensor], modules: dict[str, MusubiModule]) -> dict[str, torch.Tensor]:
    """The musubi model's weights of the reference's modules (musubi path -> the diffusers weight)."""
    return {f"{path}.weight": base[f"{module.diffusers}.weight"] for path, module in modules.items()}


class TinyExport(NamedTuple):
    name: str
    folder: Path  # what export_lora wrote
    base: dict[str, torch.Tensor]  # the tiny transformer's weights
    deltas: dict[str, torch.Tensor]  # peft's B @ A * scale per adapted module
    modules: dict[str, MusubiModule]  # musubi's modules of the tiny transformer
    path: Path  # the tiny checkpoint
    transformer: torch.nn.Module  # with the adapter


@pytest.fixture(scope="module", params=sorted(MODULES))
def tiny_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyExport:
    name = request.param
    family = load_family(name)
    path = build_tiny(name, tmp_path_factory.mktemp("models") / name)
    transformer = adapted(path, family)  # every targeted linear (ffn too), dyadic entries, lora_alpha 8 on rank 4
    folder = tmp_path_factory.mktemp("lora")
    export_lora(folder, lora_state(transformer), LoraExport(adapter_config(transformer), family, True, True))
    base = load_component(path, "transformer").state_dict()
    with torch.no_grad():
        deltas = {n: m.get_delta_weight("default") for n, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    modules = MODULES[name](load_component(path, "transformer").config)
    return TinyExport(name, folder, base, deltas, modules, path, transformer)


@torch.no_grad()
def test_musubi_merges_every_module_as_peft_does(tiny_export) -> None:
    """Written as training writes it (at unit scale, then converted): musubi's merge takes every module of the file
    and gives peft's W + scale * B @ A on every adapted linear, bit for bit; mapped back to diffusers names, they are
    the weights the diffusers file gives."""
    name, folder, base, deltas, modules, *_ = tiny_export
    lora = load_file(folder / MUSUBI_LORA_FILE)
    merged, used = musubi_merge(lora, musubi_weights(base, modules))
    assert {k.split(".", 1)[0] for k in lora} == used == {lora_name(p) for p in modules}
    assert sorted(deltas) == sorted(m.diffusers for m in modules.values())
    changed = 0
    for path, module in modules.items():
        peft_merged = base[f"{module.diffusers}.weight"] + deltas[module.diffusers]
        assert torch.equal(merged[f"{path}.weight"], peft_merged), path
        changed += not torch.equal(peft_merged, base[f"{module.diffusers}.weight"])
    assert changed == len(modules)  # the adapter moves every weight: a file merged at 0 or half strength fails


@torch.no_grad()
def test_the_diffusers_and_comfyui_files_merge_nothing_in_musubi(tiny_export) -> None:
    """Why the musubi file exists: musubi's loaders find no module of theirs in loraflow's other two files (the
    silent "0 modules")."""
    name, folder, base, _, modules, *_ = tiny_export
    for file in (LORA_FILE, COMFYUI_LORA_FILE):
        _, used = musubi_merge(load_file(folder / file), musubi_weights(base, modules))
        assert not used, (file, sorted(used)[:2])


def test_musubi_file_by_default_where_musubi_loads_the_family_and_kind() -> None:
    """`lora_format` unset: the musubi file for a plain LoRA of Kandinsky 5 and HunyuanVideo 1.5; none for Kandinsky
    6 (no musubi model), DoRA or LoKr/LoHa; `musubi` asked where it cannot be is an error before training;
    `diffusers` and `comfyui` leave it out."""
    from tests.factory import demo

    k5, image, hv15, k6 = (load_family(n) for n in ("kandinsky5-video", "kandinsky5-image", "hunyuanvideo-1.5",
                                                    "kandinsky6"))
    lycoris = {"lora_type": "lycoris", "lycoris_config": {"algo": "lokr", "linear_dim": 4, "linear_alpha": 1}}
    assert all(writes_musubi(parse_config(demo()), family) for family in (k5, image, hv15))
    assert writes_musubi(parse_config(demo() | {"lora_format": "musubi"}), hv15)
    assert not writes_musubi(parse_config(demo()), k6)
    assert not writes_musubi(parse_config(demo() | {"use_dora": True}), k5)
    assert not writes_musubi(parse_config(demo() | lycoris), hv15)
    for other in ("diffusers", "comfyui"):
        assert not writes_musubi(parse_config(demo() | {"lora_format": other}), k5)
    with pytest.raises(ValueError, match="lora_format: musubi.*no loader for this family.*use lora_format diffusers"):
        writes_musubi(parse_config(demo() | {"lora_format": "musubi"}), k6)
    with pytest.raises(ValueError, match="lora_format: musubi.*DoRA"):
        writes_musubi(parse_config(demo() | {"use_dora": True, "lora_format": "musubi"}), k5)


def test_a_finished_run_gets_its_musubi_file_on_reuse(tiny_export, tmp_path: Path) -> None:
    """A run folder written before the musubi file (its diffusers file only): `export_twins` converts it, the same
    tensors as the training-time export."""
    from loraflow.training.checkpoints import export_twins

    name, folder, *_ = tiny_export
    (tmp_path / LORA_FILE).write_bytes((folder / LORA_FILE).read_bytes())
    export_twins(tmp_path / LORA_FILE, LoraExport({}, load_family(name), False, True))
    again, first = load_file(tmp_path / MUSUBI_LORA_FILE), load_file(folder / MUSUBI_LORA_FILE)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert not (tmp_path / COMFYUI_LORA_FILE).exists()



def test_the_musubi_file_reads_back_as_the_adapter_bit_for_bit(tiny_export) -> None:
    """`init_lora` of the musubi file (training/options/adapters.py): musubi's names mapped back to diffusers', the
    file's alpha / r (1) against the adapter's scale (2) moved into lora_B: the tensors peft trained, bit for bit."""
    from loraflow.training.options.adapters import load_init_lora

    name, folder, *_ = tiny_export
    family = load_family(name)
    trained = tiny_export.transformer
    fresh = load_component(tiny_export.path, "transformer")
    fresh.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=family.lora_targets(True)))
    load_init_lora(str(folder / MUSUBI_LORA_FILE), fresh, family)
    want, got = lora_state(trained), lora_state(fresh)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_musubi_file_for_a_family_musubi_lacks_is_refused(tiny_export, tmp_path: Path) -> None:
    from loraflow.training.options.adapters import load_init_lora

    name, folder, *_ = tiny_export
    k6 = load_family("kandinsky6")
    with pytest.raises(ValueError, match="musubi-tuner has no model of kandinsky6"):
        load_init_lora(str(folder / MUSUBI_LORA_FILE), tiny_export.transformer, k6)
