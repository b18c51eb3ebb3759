"""Training on the tiny real Kandinsky 5 Video, from caches the real ops build from the demo config.

The dataset is two clips of the demo set, one of them also under a second name with a short caption, so one
bucket holds two text lengths (what K5 batching must never mix). Runs share the caches and differ only in their
output folders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from loraflow.config import load_config
from loraflow.contracts.text_set import text_lookup
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.text.text_embeds import encode_texts
from loraflow.store import Store
from loraflow.training import batches as D
from loraflow.training import loop as T
from loraflow.training import model_setup
from loraflow.training.model_setup import Trainable, load_transformer
from loraflow.training.run import current_run_dir, run_dir, upstream_versions
from loraflow.training.step import flow_terms, uses_autocast
from tests.factory import (
    REPO,
    SHORT_CAPTION,
    fixed_batch,
    loss_and_grads,
    make_config,
    reference_lora,
    same_lora_file,
    train,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def baseline(caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    config = make_config(caches, tmp_path_factory.mktemp("baseline") / "out")
    return config, train(config)


def test_two_steps_equal_a_hand_written_reference(baseline, caches: dict[str, Path]) -> None:
    """The transformer called directly, as Kandinsky5T2VPipeline's denoising loop calls it; AdamW by hand.

    Bit for bit, by construction: the same ops on the same shapes as training's step, in this process (the same
    kernels and thread count). x_t is the same formula, the transformer gets the same inputs, the loss squares the
    same differences and means them in the same memory order (training's F.mse_loss keeps the channels-last layout
    of the velocity it is given, which is this one's), and its gradient 2/N * d is this one's 2d * 1/N (the factor 2
    is exact)."""
    config, report = baseline
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    transformer, params, optimizer = reference_lora(caches["model"], config)
    plan = D.BatchPlan(D.build_samples(config, store), 1, config.seed)
    for step, logged in enumerate(report.history):
        (sample,) = plan(step)
        x0 = torch.from_numpy(np.array(store.get("latents", [sample.latent_key])[sample.latent_key]["latent"]))[None]
        draws = D.step_draws(config, family, step, tuple(x0.shape))
        assert not draws.drop_caption
        text = store.get("text_embeds", [sample.text_key])[sample.text_key]
        qwen, clip = (torch.from_numpy(np.array(text[k]))[None] for k in ("text_embeds", "pooled_embeds"))
        s = draws.sigma.view(-1, 1, 1, 1, 1)
        x_t = ((1 - s) * x0 + s * draws.noise).permute(0, 2, 3, 4, 1)  # (B, T, h, w, 16): the pipeline's layout
        latents = torch.cat([x_t, torch.zeros_like(x_t), torch.zeros_like(x_t[..., :1])], -1)  # t2v visual_cond
        _, frames, h, w, _ = x_t.shape
        height, width = h * 8, w * 8
        velocity = transformer(
            hidden_states=latents, encoder_hidden_states=qwen, pooled_projections=clip, timestep=draws.sigma * 1000,
            visual_rope_pos=[torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
            text_rope_pos=torch.arange(qwen.shape[1]),
            scale_factor=(1, 2, 2) if 480 <= height <= 854 and 480 <= width <= 854 else (1, 3.16, 3.16),
            sparse_params=None, return_dict=True,
        ).sample
        loss = ((velocity - (draws.noise - x0).permute(0, 2, 3, 4, 1)) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        assert (loss.item(), norm) == (logged.loss, logged.grad_norm)
    trained = load_file(report.lora_path)
    expected = get_peft_model_state_dict(transformer)
    assert sorted(trained) == sorted(f"transformer.{k}" for k in expected)
    assert len(expected) == 40  # A and B of 20 adapted linears (1 text + 2 visual blocks)
    assert all(torch.equal(trained[f"transformer.{k}"], v) for k, v in expected.items())
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # it did train


def test_every_step_counts_its_flops_and_the_run_names_its_attention_kernel(baseline) -> None:
    """training/flops.py: each history row has the step's model TFLOP/s (no MFU on the CPU: no peak), the report
    their median and the kernel the run's attention ran (attention.json; on the CPU `auto` is torch's SDPA)."""
    config, report = baseline
    rates = sorted(row.tflops for row in report.history)
    assert len(rates) == 2 and rates[0] > 0 and all(row.mfu is None for row in report.history)
    assert report.tflops == (rates[0] + rates[1]) / 2 and report.mfu is None
    assert report.attention_backend == "sdpa" and "tflops" in report.summary() and "mfu" not in report.summary()


def test_overfitting_one_fixed_batch_lowers_the_loss(caches: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(caches, tmp_path / "out", lora_rank=8, lora_include_ffn=True)
    family = get_family(config)
    batch = fixed_batch(config)
    transformer, params = load_transformer(config, family, model_source(config), CPU)
    trainable = Trainable(transformer, params, CPU)
    optimizer = torch.optim.AdamW(params, lr=3e-2)
    losses = []
    for _ in range(30):
        loss = flow_terms(transformer, family, batch, CPU, autocast=False).flow
        loss.backward()
        trainable.collect()
        trainable.step(optimizer, 1.0)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_killed_run_resumes_to_the_same_bits(caches: dict[str, Path], tmp_path: Path) -> None:
    settings = {"max_train_steps": 24, "checkpointing_steps": 2, "checkpoints_total_limit": 1, "lora_dropout": 0.1}
    killed = make_config(caches, tmp_path / "killed", **settings)
    run = current_run_dir(killed, get_family(killed), Store(killed.cache_dir, killed.manifest_names))
    code = ("import sys; from loraflow.config import load_config; from loraflow.training.loop import train_lora; "
            "from loraflow.pipelines import get_family; from loraflow.pipelines.sources import model_source; "
            "from loraflow.store import Store; "
            "c = load_config(sys.argv[1]); train_lora(c, get_family(c), model_source(c), Store(c.cache_dir))")
    process = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "killed.yaml")], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob("step-???????")) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    stderr = process.communicate()[1].decode()
    assert process.returncode == -signal.SIGKILL, stderr[-2000:]
    assert not (run / T.LORA_FILE).exists()  # it really was interrupted
    resumed = train(killed)
    assert 2 <= resumed.resumed_at_step < 24 and resumed.computed == 24 - resumed.resumed_at_step
    whole = train(make_config(caches, tmp_path / "whole", **settings))
    assert whole.resumed_at_step == 0
    assert same_lora_file(run / T.LORA_FILE, Path(whole.lora_path))
    assert [r.loss for r in resumed.history] == [r.loss for r in whole.history]
    assert len(list((run / "checkpoints").glob("step-*"))) == 1  # checkpoints_total_limit


def test_a_config_change_starts_a_new_run_and_a_rerun_computes_nothing(baseline, caches: dict[str, Path]) -> None:
    config, first = baseline
    again = train(config)
    assert again.computed == 0 and again.reused == 1 and again.data_version == first.data_version
    runtime_only = make_config(caches, Path(config.output_dir), checkpointing_steps=1, gradient_checkpointing=True)
    assert train(runtime_only).computed == 0  # how a run computes is not what it computes
    changed = make_config(caches, Path(config.output_dir), lora_rank=2, lora_alpha=8, checkpointing_steps=1)
    report = train(changed)
    assert report.computed == 2 and report.run_dir != first.run_dir
    saved = load_file(report.lora_path)
    assert {v.shape[0] for k, v in saved.items() if "lora_A" in k} == {2}
    with safe_open(report.lora_path, "pt") as f:  # unit scale: 8/2 is in lora_B, the header says alpha = rank
        header = json.loads(f.metadata()["lora_adapter_metadata"])
    assert header["transformer.r"] == 2 and header["transformer.lora_alpha"] == 2
    # on the tensors: a checkpoint holds the adapter as trained (at alpha / r = 4) beside the file written from it,
    # whose lora_B is it times 4 (exact: a power of two) and lora_A the trained one
    [checkpoint] = Path(report.run_dir, "checkpoints").glob("step-*")
    trained, saved = load_file(checkpoint / "lora.safetensors"), load_file(checkpoint / T.LORA_FILE)
    assert len(trained) == len(saved) > 0 and any(".lora_B." in key for key in saved)
    for key, tensor in saved.items():
        [twin] = [k for k in trained if k.endswith(key.removeprefix("transformer."))]
        assert torch.equal(tensor, trained[twin] * 4 if ".lora_B." in key else trained[twin]), key


def test_a_finished_run_without_its_comfyui_file_gets_it_on_reuse(baseline, caches: dict[str, Path]) -> None:
    """A run finished before the ComfyUI and musubi-tuner files were written by default (or under `lora_format:
    diffusers`): reused with the default, they are converted from the diffusers file, nothing retrained."""
    from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
    from loraflow.pipelines.musubi import MUSUBI_LORA_FILE

    config, first = baseline
    run = Path(first.run_dir)
    assert config.lora_format is None and first.comfyui_lora_path == str(run / COMFYUI_LORA_FILE)
    assert first.musubi_lora_path == str(run / MUSUBI_LORA_FILE)  # and musubi-tuner's (Kandinsky 5: it loads it)
    musubi = load_file(run / MUSUBI_LORA_FILE)
    (run / COMFYUI_LORA_FILE).unlink()
    (run / MUSUBI_LORA_FILE).unlink()
    one_file = train(make_config(caches, Path(config.output_dir), lora_format="diffusers"))  # the opt-out
    assert one_file.computed == 0 and one_file.comfyui_lora_path is None and one_file.musubi_lora_path is None
    again = train(config)
    assert again.computed == 0 and again.run_dir == str(run)
    converted = load_file(again.musubi_lora_path)
    assert converted.keys() == musubi.keys() and all(torch.equal(converted[k], musubi[k]) for k in musubi)
    comfy = load_file(again.comfyui_lora_path)
    ranks = {v.shape[0] for k, v in comfy.items() if k.endswith("lora_down.weight")}
    alphas = {float(v) for k, v in comfy.items() if k.endswith(".alpha")}
    assert ranks == {config.lora_rank} and alphas == {float(config.lora_rank)}  # unit scale
    diffusers = load_file(first.lora_path)
    assert len(comfy) == 3 * len(diffusers) // 2  # down, up, alpha per adapted module


def test_caption_dropout_trains_on_the_cached_empty_prompt(caches: dict[str, Path], tmp_path: Path) -> None:
    store = Store(make_config(caches, tmp_path / "a").cache_dir)
    empty_key = text_lookup(store)["", ""]
    empty = store.get("text_embeds", [empty_key])[empty_key]
    dropped = fixed_batch(make_config(caches, tmp_path / "b", caption_dropout_probability=1.0))
    kept = fixed_batch(make_config(caches, tmp_path / "c", caption_dropout_probability=0.0))
    for name in ("text_embeds", "pooled_embeds"):
        assert torch.equal(dropped.text[name][0], torch.from_numpy(np.array(empty[name])))
    assert dropped.text["text_embeds"].shape[1] != kept.text["text_embeds"].shape[1]
    half = make_config(caches, tmp_path / "d", caption_dropout_probability=0.5)
    rate = np.mean([D.step_draws(half, get_family(half), k, (1, 16, 1, 2, 2)).drop_caption for k in range(400)])
    assert 0.4 < rate < 0.6


def test_batches_of_two_never_mix_text_lengths(caches: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(caches, tmp_path / "out", train_batch_size=2, max_train_steps=2)
    store = Store(config.cache_dir, config.manifest_names)
    samples = D.build_samples(config, store)
    short = next(r["key"] for r in store.read_manifest("text_embeds") if r["text"] == SHORT_CAPTION)
    bucket = next(s.group[0] for s in samples if s.text_key == short)
    assert len({s.group[1] for s in samples if s.group[0] == bucket}) == 2  # the data does mix lengths
    plan = D.BatchPlan(samples, 2, config.seed)
    batches = [plan(k) for k in range(3 * plan.per_epoch)]
    assert all(len({s.group for s in b}) == 1 for b in batches)
    assert sum(len(b) == 2 for b in batches) >= plan.per_epoch  # real batches of two, not singletons
    assert train(config).computed == 2  # collate_text raises on mixed lengths: it never does


def test_tread_with_ratio_zero_trains_exactly_like_no_tread(baseline, caches: dict[str, Path], tmp_path: Path) -> None:
    config, plain = baseline
    route = {"selection_ratio": 0.0, "start_layer_idx": 0, "end_layer_idx": -1}
    routed = train(make_config(caches, tmp_path / "out", tread_config={"routes": [route]}))
    assert [r.loss for r in routed.history] == [r.loss for r in plain.history]
    half = train(make_config(caches, tmp_path / "half", tread_config={"routes": [{**route, "selection_ratio": 0.5}]}))
    assert [r.loss for r in half.history] != [r.loss for r in plain.history]
    with pytest.raises(ValueError, match=r"tread_config.routes\[0\]"):
        train(make_config(caches, tmp_path / "bad", tread_config={"routes": [{**route, "start_layer_idx": 5}]}))


@pytest.mark.parametrize("memory", [
    {"gradient_checkpointing": True},
    {"enable_group_offload": True, "group_offload_type": "block_level"},
    {"enable_group_offload": True, "group_offload_type": "leaf_level", "gradient_checkpointing": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2, "gradient_checkpointing_cpu_offload": True},
    {"blocks_to_swap": 1, "gradient_checkpointing": True},
], ids=["checkpointing", "block-offload", "leaf-offload+checkpointing", "interval+activation-offload", "block-swap"])
def test_memory_features_change_no_number(caches: dict[str, Path], tmp_path: Path, memory: dict) -> None:
    """Bit for bit, by construction: checkpointing recomputes each block's forward with the same ops on the same
    shapes, and backward still visits the blocks in reverse order, so every gradient adds the same terms in the same
    order; group offloading on the CPU moves weights from the CPU to the CPU; interval checkpointing runs the blocks
    it does not checkpoint as without checkpointing, and activation offload's CPU copies are exact (kernels/
    checkpointing.py; tests/kernels/test_checkpointing.py shows what each does)."""
    plain = make_config(caches, tmp_path / "plain")
    batch = fixed_batch(plain)
    loss, grads = loss_and_grads(plain, batch)
    other_loss, other_grads = loss_and_grads(make_config(caches, tmp_path / "other", **memory), batch)
    assert (grads != 0).float().mean() > 0.5  # a comparison of zeros would prove nothing
    assert loss == other_loss and torch.equal(grads, other_grads)


def test_streams_need_cuda_and_fp8_keeps_lora_fp32(caches: dict[str, Path], tmp_path: Path) -> None:
    streams = make_config(caches, tmp_path / "s", enable_group_offload=True, group_offload_use_stream=True)
    with pytest.raises(ValueError, match="group_offload_use_stream` needs a CUDA device"):
        train(streams)
    config = make_config(caches, tmp_path / "fp8", base_model_precision="fp8-layerwise")
    transformer, params = load_transformer(config, get_family(config), model_source(config), CPU)
    dtypes = {p.dtype for n, p in transformer.named_parameters() if "lora_" not in n}
    assert torch.float8_e4m3fn in dtypes and {p.dtype for p in params} == {torch.float32}
    assert uses_autocast(config, CPU)
    report = train(config)
    assert report.computed == 2 and np.isfinite(report.history[-1].loss)


@pytest.mark.parametrize("precision", ["fp8-layerwise", "int8-torchao"])
def test_a_one_byte_base_is_cast_on_the_cpu_before_it_moves_to_the_accelerator(
        caches: dict[str, Path], tmp_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40's H200 run: Kandinsky 5 Pro fp8 loaded in bf16 onto the GPU peaked at 40.4 GiB while loading and
    held 20.7 after. The bf16 load happens on the CPU and the model moves once stored in one byte: here the
    accelerator is the meta device, which the real loader records (`load_component`, called through)."""
    loads = []

    def recorded(model: Any, name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
        loads.append((name, dtype, str(device)))
        return load_component(model, name, dtype, device)

    from loraflow.pipelines.base import load_component
    monkeypatch.setattr(model_setup, "load_component", recorded)
    config = make_config(caches, tmp_path / precision, base_model_precision=precision)
    transformer, params = load_transformer(config, get_family(config), model_source(config), torch.device("meta"))
    assert loads == [("transformer", torch.bfloat16, "cpu")]
    assert {p.device.type for p in (*transformer.parameters(), *transformer.buffers())} == {"meta"}
    assert params and {(p.device.type, p.dtype) for p in params} == {("meta", torch.float32)}


def test_a_new_validation_prompt_encodes_one_text_and_retrains_nothing(baseline, caches: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    config, first = baseline
    shutil.copytree(caches["root"] / "cache", tmp_path / "cache")
    moved = {"cache_dir": str(tmp_path / "cache")}
    store = Store(tmp_path / "cache")
    family = get_family(config)
    assert upstream_versions(store, config, family) == upstream_versions(Store(config.cache_dir), config, family)
    prompted = make_config(caches, Path(config.output_dir), validation_prompt="a red ball rolls", **moved)
    # the new prompt, nothing else
    assert encode_texts(prompted, get_family(prompted), model_source(prompted), store).computed == 1
    again = train(prompted)
    assert again.computed == 0 and again.run_dir == first.run_dir


def test_distribution_latents_draw_fresh_samples_and_comfyui_is_exported_too(baseline, caches: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE

    config, first = baseline
    shutil.copytree(caches["root"] / "cache", tmp_path / "cache")
    sampled = make_config(caches, tmp_path / "out", cache_dir=str(tmp_path / "cache"),
                          latent_sampling="distribution", lora_format="comfyui")
    assert encode_latents(sampled, get_family(sampled), model_source(sampled), Store(sampled.cache_dir)).computed == 3
    report = train(sampled)
    run = Path(report.run_dir)
    assert (run / T.LORA_FILE).is_file() and (run / COMFYUI_LORA_FILE).is_file()
    # same seed, same noise and sigma: only the drawn x0 differs from the mode run
    assert [r.loss for r in report.history] != [r.loss for r in first.history]
    assert train(sampled).computed == 0


def test_a_config_field_added_later_keeps_the_run_keys_of_before() -> None:
    # stop 11's key for the demo config (now tests/demo_t2v.yaml, unchanged; the demo became i2v in issue 21):
    # `conditioning_data` (i2i, stop 12) left every other run where it was
    config = load_config(REPO / "tests" / "demo_t2v.yaml")
    assert run_dir(config, {"latents": "l", "text_embeds": "t"}).name == "6d960b4921c5061b9fa65689cc87413d"


# issue 32 B: the loss type and the peers' optimizers through train_lora (tests/training/test_training_options.py: the
# rest); off, the run key and so the LoRA are today's (tests/test_keys_pinned.py, the hand-written reference above)
@pytest.mark.parametrize("option", [
    {"optimizer": "muon", "loraplus_lr_ratio": 4.0},
    {"optimizer": "prodigy", "learning_rate": 1.0},
    {"optimizer": "adamw_schedulefree", "loraplus_lr_ratio": 4.0, "loss_type": "huber", "huber_c": 0.05},
], ids=["muon+loraplus", "prodigy", "schedulefree+loraplus+huber"])
def test_optimizers_change_the_lora_and_resume_bit_for_bit(baseline, caches: dict[str, Path], tmp_path: Path,
                                                           option: dict) -> None:
    """2 steps with a checkpoint at step 1; the adapter deleted, the run resumes from step 1 and ends with the
    same bits as before (Prodigy's d and step count, schedule-free's z and weight sums come back; schedule-free's
    checkpoints hold its training point y, its export the average x). The Huber loss rides along (one run fewer):
    step 1's loss, before any update, is the baseline's residuals under it, below their l2."""
    plain = baseline[1]
    config = make_config(caches, tmp_path / "out", checkpointing_steps=1, **option)
    first = train(config)
    run = Path(first.run_dir)
    assert not same_lora_file(run / T.LORA_FILE, Path(plain.lora_path)) and first.data_version != plain.data_version
    huber = option.get("loss_type") == "huber"  # else the optimizer alone: step 1's loss is the baseline's
    assert first.history[0].loss < plain.history[0].loss if huber else first.history[0].loss == plain.history[0].loss
    whole = tmp_path / "whole.safetensors"
    (run / T.LORA_FILE).rename(whole)
    resumed = train(config)
    assert resumed.resumed_at_step == 1 and resumed.computed == 1
    assert same_lora_file(run / T.LORA_FILE, whole)
    assert [r.loss for r in resumed.history] == [r.loss for r in first.history]
