"""Issue 32's adapter options on the tiny Kandinsky 5 Video through `train_lora`: EMA (training/options/ema.py) and
init_lora (training/options/adapters.py). The caches are test_train's (the same two-clip dataset); runs differ only in
their output folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from loraflow.cli import main
from loraflow.config.adapter_kinds import adapter_summary
from loraflow.pipelines import get_family
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.model_setup import load_transformer
from loraflow.training.options.adapters import start_adapter
from loraflow.training.options.ema import EMA_CHECKPOINT_FILE, EMA_LORA_FILE, trained_adapters
from loraflow.training.run import run_dir, upstream_versions
from tests.factory import make_config, same_lora_file, train
from tests.numerics import U32

CPU = torch.device("cpu")
DECAY, INTERVAL, STEPS = 0.75, 2, 4
EMA = {"use_ema": True, "ema_decay": DECAY, "ema_update_interval": INTERVAL}
EVERY_STEP = {"max_train_steps": STEPS, "checkpointing_steps": 1, "checkpoints_total_limit": None}


def peft_names(path: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("transformer."): v for k, v in load_file(path).items()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def closed_form(start: dict[str, torch.Tensor], updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """decay^n w_0 + sum_i (1 - decay) decay^(n - i) w_(t_i), in float64."""
    n = len(updates)
    return {k: DECAY ** n * w.double() + sum((1 - DECAY) * DECAY ** (n - i) * u[k].double()
                                            for i, u in enumerate(updates, 1)) for k, w in start.items()}


def assert_ema_is(ema: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                  updates: list[dict[str, torch.Tensor]]) -> None:
    """`ema` is the closed form of `updates` from `start` within fp32 rounding. torch's EMA is an fp32 lerp with
    weight w = 1 - decay < 0.5, ema + w (weights - ema): three roundings, of a difference below 2M (then times w),
    of a product below 2wM and of a sum below M (M: the largest |value| of start and updates; every EMA lies between
    them), at most u (2wM + 2wM + M) = 2 u M at w = 1/4; and it scales the error before it by decay < 1: after n
    updates at most n 2 u M (u = 2^-24)."""
    reference = closed_form(start, updates)
    assert sorted(ema) == sorted(reference)
    for key, value in ema.items():
        largest = max(w[key].abs().max().item() for w in [start, *updates])
        bound = len(updates) * 2 * U32 * largest
        assert (value.double() - reference[key]).abs().max().item() <= bound, key


@pytest.fixture(scope="module")
def ema_run(caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Through the Dagster `lora` asset: (config, run folder, the materialization's metadata)."""
    from dagster import DagsterInstance, materialize

    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.stages import lora

    output = tmp_path_factory.mktemp("ema") / "out"
    config = make_config(caches, output, lora_format="comfyui", **EMA, **EVERY_STEP)
    result = materialize([lora], instance=DagsterInstance.ephemeral(),
                         resources={"loraflow": LoraflowResource(config_path=f"{output}.yaml")})
    (event,) = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    return config, Path(metadata["lora_path"]).parent, metadata


def test_ema_equals_its_closed_form_leaves_the_lora_alone_and_resumes_exactly(
        ema_run, caches: dict[str, Path], tmp_path: Path) -> None:
    config, run, metadata = ema_run
    assert metadata["adapter"] == {"kind": "LoRA", "rank": 4, "alpha": 4, "init_lora": None,
                                   "ema": {"decay": DECAY, "update_interval": INTERVAL}}
    family = get_family(config)
    # step 0's adapter: the seeded peft init
    transformer, _ = load_transformer(config, family, model_source(config), CPU)
    start = {k: v.clone() for k, v in get_peft_model_state_dict(transformer).items()}
    steps = {s: load_file(run / "checkpoints" / f"step-{s:07d}" / "lora.safetensors") for s in range(1, STEPS)}
    steps[STEPS] = peft_names(run / T.LORA_FILE)
    ema = peft_names(run / EMA_LORA_FILE)
    assert_ema_is(ema, start, [steps[2], steps[4]])
    assert_ema_is(load_file(run / "checkpoints" / "step-0000002" / EMA_CHECKPOINT_FILE), start, [steps[2]])
    assert any(not torch.equal(ema[k], steps[STEPS][k]) for k in ema)  # an average, not a copy
    # the users' files: the EMA's ComfyUI twin, and each checkpoint's adapter as the run writes its own
    assert (run / "pytorch_lora_weights_ema_comfyui.safetensors").is_file()
    for step in range(1, STEPS):  # at lora_alpha = rank the unit scale changes no bit
        folder = run / "checkpoints" / f"step-{step:07d}"
        assert same_tensors(peft_names(folder / T.LORA_FILE), steps[step]) and (folder / COMFYUI_LORA_FILE).is_file()
    plain = train(make_config(caches, tmp_path / "plain", **EVERY_STEP))  # EMA off: the same LoRA, no EMA file
    assert plain.run_dir != str(run) and not (Path(plain.run_dir) / EMA_LORA_FILE).exists()
    assert same_lora_file(Path(plain.lora_path), run / T.LORA_FILE)
    # resume: the run as it stood after step 1 (its later files removed) finishes with the same EMA
    resumed_out = tmp_path / "resumed"
    shutil.copytree(Path(config.output_dir), resumed_out)
    copy = resumed_out / "runs" / run.name
    for path in [*copy.glob("*.safetensors"), copy / "history.json",
                 *(copy / "checkpoints" / f"step-{s:07d}" for s in (2, 3))]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    again = train(make_config(caches, resumed_out, **EMA, **EVERY_STEP))
    assert again.resumed_at_step == 1
    assert same_lora_file(copy / EMA_LORA_FILE, run / EMA_LORA_FILE)
    # musubi-tuner's post-hoc EMA over the saved LoRAs (step 0's adapter first): the same closed form
    save_file(start, tmp_path / "step0.safetensors")
    files = [tmp_path / "step0.safetensors"] + [run / "checkpoints" / f"step-{s:07d}" / "lora.safetensors"
                                                for s in (1, 3)]
    out = tmp_path / "posthoc.safetensors"
    assert main(["post-hoc-ema", *map(str, files), "--decay", str(DECAY), "-o", str(out)]) == 0
    averaged = load_file(out)
    assert_ema_is(averaged, start, [steps[1], steps[3]])


def test_init_lora_starts_from_the_file_exactly_and_keys_the_run_by_its_content(
        ema_run, caches: dict[str, Path], tmp_path: Path) -> None:
    _, run, _ = ema_run
    trained = peft_names(run / T.LORA_FILE)
    for source in (run / T.LORA_FILE, run / COMFYUI_LORA_FILE):  # diffusers and ComfyUI key names
        config = make_config(caches, tmp_path / "init", init_lora=str(source))
        family = get_family(config)
        transformer, _ = load_transformer(config, family, model_source(config), CPU)
        start_adapter(transformer, None, config.init_lora, family)  # what train_lora runs before step 1
        loaded = get_peft_model_state_dict(transformer)
        assert sorted(loaded) == sorted(trained)
        assert all(torch.equal(loaded[k], trained[k]) for k in trained), source.name
    # the file's scale (1 here: ComfyUI's alpha / rank, the diffusers header's lora_alpha / r) moves into lora_B
    # where this config's peft scale differs (8 / 4 = 2): the adapter starts with the file's update
    for source in (run / T.LORA_FILE, run / COMFYUI_LORA_FILE):
        doubled = make_config(caches, tmp_path / "init", init_lora=str(source), lora_alpha=8)
        transformer, _ = load_transformer(doubled, family, model_source(doubled), CPU)
        start_adapter(transformer, None, doubled.init_lora, family)
        loaded = get_peft_model_state_dict(transformer)
        assert all(torch.equal(loaded[k] * (2 if "lora_B" in k else 1), trained[k]) for k in trained), source.name
    store = Store(config.cache_dir, config.manifest_names)
    key = run_dir(config, upstream_versions(store, config, family))
    copied = tmp_path / "copy.safetensors"
    shutil.copy(run / T.LORA_FILE, copied)
    assert run_dir(make_config(caches, tmp_path / "init", init_lora=str(copied)),
                     upstream_versions(store, config, family)) == key  # the path is not the key: the content is
    save_file({k: v + (k.endswith("lora_B.weight")) for k, v in load_file(copied).items()}, copied)
    changed = make_config(caches, tmp_path / "init", init_lora=str(copied))
    assert run_dir(changed, upstream_versions(store, changed, family)) != key
    plain = make_config(caches, tmp_path / "init")
    assert run_dir(plain, upstream_versions(store, plain, family)) != key
    first = train(make_config(caches, tmp_path / "from_file", init_lora=str(run / T.LORA_FILE), max_train_steps=1))
    scratch = json.loads((run / "history.json").read_text())[0]  # the same first batch from peft's init
    assert first.history[0].loss != scratch["loss"]  # train_lora's step 1 ran from the file
    wrong_rank = make_config(caches, tmp_path / "init", init_lora=str(run / T.LORA_FILE), lora_rank=2)
    transformer, _ = load_transformer(wrong_rank, family, model_source(wrong_rank), CPU)
    with pytest.raises(ValueError, match=r"init_lora.*shape .*set lora_rank"):
        start_adapter(transformer, None, wrong_rank.init_lora, family)


def test_an_init_lora_holding_nan_is_refused_naming_the_file_not_the_learning_rate(
        ema_run, caches: dict[str, Path], tmp_path: Path) -> None:
    """A broken file used to start training, whose first loss was NaN: "Lower learning_rate" blamed the wrong key."""
    _, run, _ = ema_run
    broken = tmp_path / "nan.safetensors"
    tensors = load_file(run / T.LORA_FILE)
    name = sorted(tensors)[0]
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, broken)
    with pytest.raises(ValueError) as info:
        train(make_config(caches, tmp_path / "nan", init_lora=str(broken), max_train_steps=1))
    message = str(info.value)
    assert f"`init_lora` {broken}: 1 tensor(s) hold NaN or infinite values" in message
    assert name.removeprefix("transformer.") in message and "learning_rate" not in message


def comfyui_delta(file: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """ComfyUI's weight change for the module it maps LoRA key `key` to (`diffusion_model.<name>` in the ComfyUI file,
    `transformer.<name>` in the diffusers file: Kandinsky5's key map), float64, as its readers compute it at
    strength 1: comfy/weight_adapter/lokr.py `LoKrAdapter.calculate_weight` (kron(w1, w2) * alpha / dim, dim the rank
    of a decomposed factor, 1 without one or without alpha) and comfy/weight_adapter/loha.py
    `LoHaAdapter.calculate_weight` ((w1_a @ w1_b) * (w2_a @ w2_b) * alpha / w1_b.shape[0], 1 without alpha)."""
    t = {k.removeprefix(f"{key}."): v.double() for k, v in file.items() if k.startswith(f"{key}.")}
    if "hada_w1_a" in t:
        hadamard = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        return hadamard * (t["alpha"] / t["hada_w1_b"].shape[0] if "alpha" in t else 1.0)
    dim = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        w1, dim = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
    w2 = t.get("lokr_w2")
    if w2 is None:
        w2, dim = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
    return torch.kron(w1, w2) * (t["alpha"] / dim if "alpha" in t and dim is not None else 1.0)


KINDS = {  # name: (config, the key names' prefix, peft's scale of every module)
    "lokr_whole": ({"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1, "factor": 4}, "lokr_", 1.0),
    "lokr_decomposed": ({"algo": "lokr", "linear_dim": 2, "linear_alpha": 1, "factor": 4}, "lokr_", 0.5),
    "loha": ({"algo": "loha", "linear_dim": 2, "linear_alpha": 4}, "hada_", 2.0),
}


def test_lycoris_adapters_train_and_load_in_peft_and_as_comfyuis_readers_compute(
        caches: dict[str, Path], tmp_path: Path) -> None:
    """LoKr (both factors whole: LyCORIS's scale 1 whatever linear_alpha; w2 decomposed: alpha / r) and LoHa, two
    steps each: the file is written at unit scale (the step-1 checkpoint's users' file is its raw state with the
    scale in the first factor), loads back through peft (validation's `load_lora_file`) tensor for tensor, and every
    module's weight change, as ComfyUI computes it from the ComfyUI file and from the diffusers file (Kandinsky 5's
    key map takes its names), equals the one peft applies."""
    from diffusers import Kandinsky5Transformer3DModel

    from loraflow.pipelines.base import LORA_ADAPTER, load_lora_file

    for name, (lycoris, prefix, scale) in KINDS.items():
        config = make_config(caches, tmp_path / name, lora_type="lycoris", lycoris_config=lycoris,
                             max_train_steps=2, checkpointing_steps=1)
        assert adapter_summary(config)["kind"] == {"lokr_": "LoKr", "hada_": "LoHa"}[prefix]  # the asset's metadata
        report = train(config)
        step1 = Path(report.run_dir) / "checkpoints" / "step-0000001"
        raw, users = load_file(step1 / "lora.safetensors"), peft_names(step1 / T.LORA_FILE)
        assert sorted(users) == sorted(raw) and (step1 / COMFYUI_LORA_FILE).is_file()
        for key, tensor in raw.items():  # the first factor carries peft's scale, exactly (a power of two)
            first = key.rsplit(".", 1)[-1] in ("lokr_w1", "lokr_w1_a", "hada_w1_a")
            assert torch.equal(users[key], tensor * scale if first else tensor), key
        trained = peft_names(Path(report.lora_path))
        assert all(k.rsplit(".", 1)[-1].startswith(prefix) for k in trained)
        transformer = Kandinsky5Transformer3DModel.from_pretrained(caches["model"] / "transformer")
        load_lora_file(transformer, report.lora_path)
        loaded = get_peft_model_state_dict(transformer, adapter_name=LORA_ADAPTER)
        assert sorted(loaded) == sorted(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)
        comfy, diffusers = load_file(report.comfyui_lora_path), load_file(report.lora_path)
        layers = {n: m for n, m in transformer.named_modules() if hasattr(m, "get_delta_weight")}
        assert len(layers) == 20 and len({k.rsplit(".", 1)[0] for k in comfy}) == 20
        assert {m.scaling[LORA_ADAPTER] for m in layers.values()} == {1.0}, name  # unit scale: no alpha needed
        for module, layer in layers.items():
            peft_delta = layer.get_delta_weight(LORA_ADAPTER).double()
            assert peft_delta.abs().max() > 0, module  # trained: not the zero init
            # float32 products summed over a rank (or a Kronecker entry): a few ulps of the largest entry
            bound = 8 * torch.finfo(torch.float32).eps * peft_delta.abs().max().item()
            for file, key in ((comfy, f"diffusion_model.{module}"), (diffusers, f"transformer.{module}")):
                assert (comfyui_delta(file, key) - peft_delta).abs().max().item() <= bound, (name, module, key)


def test_dora_trains_a_magnitude_loads_back_through_diffusers_and_resumes_exactly(
        caches: dict[str, Path], tmp_path: Path) -> None:
    """use_dora: peft's magnitude vectors are trained and saved; validation's loader (diffusers' load_lora_adapter,
    the header's use_dora) reads the file back tensor for tensor; a run resumed from its step-1 checkpoint ends
    with the same bits as the uninterrupted one."""
    from diffusers import Kandinsky5Transformer3DModel

    from loraflow.pipelines.base import LORA_ADAPTER, load_lora_file

    settings = {"use_dora": True, "max_train_steps": 2, "checkpointing_steps": 1}
    config = make_config(caches, tmp_path / "dora", **settings)
    report = train(config)
    trained = peft_names(Path(report.lora_path))
    magnitudes = [k for k in trained if k.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == 20
    transformer, _ = load_transformer(config, get_family(config), model_source(config), CPU)
    start = get_peft_model_state_dict(transformer)  # the init: magnitudes = the base rows' norms
    assert all(not torch.equal(trained[k], start[k]) for k in magnitudes)
    transformer = Kandinsky5Transformer3DModel.from_pretrained(caches["model"] / "transformer")
    load_lora_file(transformer, report.lora_path)
    loaded = get_peft_model_state_dict(transformer, adapter_name=LORA_ADAPTER)
    assert sorted(loaded) == sorted(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)
    run = Path(report.run_dir)
    resumed_out = tmp_path / "resumed"
    shutil.copytree(Path(config.output_dir), resumed_out)
    copy = resumed_out / "runs" / run.name
    for path in (copy / T.LORA_FILE, copy / "history.json"):
        path.unlink()
    again = train(make_config(caches, resumed_out, **settings))
    assert again.resumed_at_step == 1 and same_lora_file(copy / T.LORA_FILE, run / T.LORA_FILE)


def test_ema_validation_picks_the_adapters_validation_renders(ema_run, caches: dict[str, Path],
                                                             tmp_path: Path) -> None:
    config, run, _ = ema_run
    lora, ema = str(run / T.LORA_FILE), str(run / EMA_LORA_FILE)
    assert trained_adapters(config, lora) == {"lora": lora, "ema": ema}  # comparison, SimpleTuner's default
    only = make_config(caches, tmp_path / "o", **EMA, ema_validation="ema_only")
    none = make_config(caches, tmp_path / "n", **EMA, ema_validation="none")
    off = make_config(caches, tmp_path / "f", ema_validation="ema_only")  # without use_ema there is no EMA
    assert [trained_adapters(c, lora) for c in (only, none, off)] == [{"ema": ema}, {"lora": lora}, {"lora": lora}]
