"""Kandinsky 6 trains its sound with its picture (`train_audio`), through the stages on its tiny checkpoint.

Everything real: H.264 videos with 16-bit PCM tracks muxed by PyAV (tests/media_factory.py `write_with_sound`) and one
without a track, the clips, latents, text and audio_latents stages, the tiny Kandinsky6Transformer3DModel and
MMAudioVAE loaded through `from_pretrained`, the lora stage's own loop and files. Clips are 17 frames at 24 fps: an
audio latent of ceil(17 / 24 x 44100 / 1024) = 31 frames beside 5 latent video frames.

Which LoRA weights only the sound can train: in the last fused block, the audio stream's text cross-attention and the
audio-from-video attention (`av_cross_attention`) feed the audio output alone (diffusers 0.42.1
transformer_kandinsky6.py `Kandinsky6FusedTransformerDecoderBlock.forward`: the video reads the audio before them,
`aud_pre_ca`), so a loss without the audio term leaves them untouched.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from loraflow.assets.runs.launch import launch_command
from loraflow.config import LoraflowConfig, load_config
from loraflow.contracts.audio_rows import read_audio_rows
from loraflow.contracts.clip_rows import read_clips
from loraflow.contracts.latent_rows import read_latent_rows
from loraflow.demo.tiny import build_tiny, tiny_dinov2
from loraflow.pipelines import get_family
from loraflow.pipelines.base import ModelFamily, load_component
from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
from loraflow.pipelines.sources import model_source
from loraflow.stages.audio.audio_latents import encode_audio
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.teacher.teacher_features import cache_teacher_features
from loraflow.stages.text.text_embeds import encode_texts
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.batches import BatchPlan, MicroBatch, build_samples, load_micro_batch, trains_as_i2v
from loraflow.training.checkpoints import LORA_FILE
from loraflow.training.model_setup import load_transformer
from loraflow.training.run import current_run_dir, run_dir, upstream_versions
from loraflow.training.step import FlowTerms, flow_terms
from tests.factory import cache_for, demo_dict, run_ranks, same_lora_file, write_config
from tests.media_factory import tone, write_h264, write_with_sound

RATE = 44_100
FRAMES = 17
LAST = "visual_transformer_blocks.1."
SOUND_ONLY = re.compile(re.escape(LAST) + r"(av_cross_attention|audio_dec_block\.cross_attention)\.")
AUDIO = re.compile(r"audio_|av_cross|va_cross")  # the audio stream and the two cross-modal attentions
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Kandinsky 6; two clips with a tone each and one without a track, every stage's cache filled."""
    root = tmp_path_factory.mktemp("k6-audio")
    build_tiny("kandinsky6", root / "k6")
    data = root / "data"
    data.mkdir()
    seconds = 1.0  # past the clip's 17 frames (0.71 s) and its audio latent's 31 x 1024 samples (0.72 s)
    write_with_sound(data / "low.mov", FRAMES, tone(seconds, RATE, 220)[None], RATE)
    write_with_sound(data / "high.mov", FRAMES, tone(seconds, RATE, 880)[None], RATE)
    write_h264(data / "silent.mp4", num_frames=FRAMES, width=64, height=64)
    for name, caption in (("low", "a low hum"), ("high", "a high whistle"), ("silent", "a silent square")):
        (data / f"{name}.txt").write_text(caption + "\n")
    config = make_config(root, "video_only")
    family, store, model = get_family(config), Store(config.cache_dir, config.manifest_names), model_source(config)
    for op in (build_clips, encode_latents, encode_texts):
        op(config, family, model, store)
    encode_audio(config, model, store)
    return root


def make_config(root: Path, clips_without_audio: str, steps: int = 6, name: str = "",
                **overrides: object) -> LoraflowConfig:
    """train_audio on the tiny Kandinsky 6 (lite-t2v unless `model_flavour` says), batch 1, two repeats: 6 samples,
    one epoch in 6 steps; written as root/<name or clips_without_audio>.yaml (what a launched process reads)."""
    data = demo_dict(root / "k6", root / "data", root, model_family="kandinsky6", train_audio=True,
                     clips_without_audio=clips_without_audio, max_train_steps=steps, checkpointing_steps=100,
                     **overrides)
    if "model_flavour" not in overrides:  # the suite's base names a Kandinsky 5 flavour: Kandinsky 6's default
        data.pop("model_flavour")
    return load_config(write_config(root / f"{name or clips_without_audio}.yaml", data))


def sources(store: Store) -> dict[str, str]:
    """clip key -> its file's name."""
    return {c.key: c.source for c in read_clips(store)}


def one_call(transformer: torch.nn.Module, family: ModelFamily, batch: MicroBatch) -> tuple[FlowTerms, dict, tuple]:
    """A micro-batch's `flow_terms` (no gradient) and the one transformer call they made: (terms, its keyword
    arguments, its output)."""
    calls = []
    hook = transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    try:
        with torch.no_grad():
            terms = flow_terms(transformer, family, batch, CPU, autocast=False)
    finally:
        hook.remove()
    ((call, out),) = calls
    return terms, call, out


@pytest.fixture(scope="module")
def trained(root: Path) -> tuple[LoraflowConfig, Path]:
    """One epoch of joint training with `clips_without_audio: video_only`: the run's folder."""
    config = make_config(root, "video_only")
    report = T.train_lora(config, get_family(config), model_source(config), Store(config.cache_dir))
    assert report.computed == config.max_train_steps
    return config, Path(report.run_dir)


def test_the_stages_cached_two_sounds_and_a_reason(root: Path) -> None:
    store = Store(make_config(root, "video_only").cache_dir)
    names = sources(store)
    assert {names[k]: r.status for k, r in read_audio_rows(store).items()} == {
        "low.mov": "ok", "high.mov": "ok", "silent.mp4": "no_audio"}


def test_joint_training_trains_the_sound(trained: tuple[LoraflowConfig, Path]) -> None:
    """Each step of a batch with sound logs a finite, positive audio term; a step of the silent clip (video_only) logs
    none (0): its video trained alone. The weights only the audio term reaches are trained (lora_B starts at zero)."""
    config, run = trained
    store = Store(config.cache_dir, config.manifest_names)
    plan = BatchPlan(build_samples(config, store), config.train_batch_size, config.seed)
    lora = load_file(str(run / LORA_FILE))
    sound_only = {k: v for k, v in lora.items() if SOUND_ONLY.search(k) and "lora_B" in k}
    assert len(sound_only) == 8  # four projections of two attentions
    assert all(v.abs().max() > 0 for v in sound_only.values())
    audio_b = [v for k, v in lora.items() if AUDIO.search(k) and "lora_B" in k]
    assert audio_b and all(v.abs().max() > 0 for v in audio_b)
    history = json.loads((run / "history.json").read_text())
    heard = [bool(plan(step)[0].audio_key) for step in range(config.max_train_steps)]
    assert sorted(heard) == [False] * 2 + [True] * 4  # the epoch: the silent clip's two samples, four with sound
    for row, sound in zip(history, heard):
        assert math.isfinite(row["audio_loss"]) and (row["audio_loss"] > 0) == sound
        assert row["loss"] > row["audio_loss"]  # the flow loss holds the video term too


def test_the_exported_lora_loads_into_the_transformer_with_its_audio_keys(
        trained: tuple[LoraflowConfig, Path], root: Path) -> None:
    """diffusers' `load_lora_adapter` on the tiny transformer takes every tensor of the file (the audio stream's,
    the cross-modal attentions'), and the adapter changes the sound the transformer predicts; the ComfyUI file names
    the audio stream as the original node does (`audioT`)."""
    _, run = trained
    lora = {k.removeprefix("transformer."): v for k, v in load_file(str(run / LORA_FILE)).items()}
    audio_keys = {k for k in lora if AUDIO.search(k)}
    for part in ("audio_text_transformer_blocks.0.attn.", "audio_dec_block.self_attention.",
                 "audio_dec_block.cross_attention.", "va_cross_attention.", "av_cross_attention."):
        assert any(part in k for k in audio_keys), part
    transformer = load_component(root / "k6", "transformer")
    base = load_component(root / "k6", "transformer")
    transformer.load_lora_adapter(str(run), weight_name=LORA_FILE, adapter_name="lora")
    loaded = get_peft_model_state_dict(transformer, adapter_name="lora")
    assert loaded.keys() == lora.keys()
    assert all(torch.equal(loaded[k], lora[k]) for k in lora)
    family = get_family(make_config(root, "video_only"))
    generator = torch.Generator().manual_seed(0)
    noisy, sound = torch.randn(1, 16, 5, 8, 8, generator=generator), torch.randn(1, 8, 31, generator=generator)
    text = {"text_embeds": torch.randn(1, 6, 32, generator=generator), "pooled_embeds": torch.randn(1, 32)}
    with torch.no_grad():
        _, with_lora = family.velocity(transformer, noisy, torch.tensor([0.5]), text, audio=sound)
        _, without = family.velocity(base, noisy, torch.tensor([0.5]), text, audio=sound)
    assert (with_lora - without).abs().max() > 1e-4
    comfy = load_file(str(run / COMFYUI_LORA_FILE))
    assert any(".audioT.cross_attention." in k for k in comfy) and any(".av_cross_attention." in k for k in comfy)
    assert len([k for k in comfy if not k.endswith(".alpha")]) == len(lora)  # every module, with its alpha


def test_a_clip_without_sound_trains_its_picture_alone_or_is_left_out(root: Path) -> None:
    """video_only: the silent clip's samples name no audio latent and batch apart; its micro-batch has no sound, so
    its step has no audio term and never runs the audio stream (no audio LoRA weight gets a gradient), while a clip
    with sound gets a finite, positive audio term that reaches the sound-only weights. leave_out: the silent clip
    has no sample, and the run trains on the other two."""
    config = make_config(root, "video_only")
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    names = sources(store)
    clip_of = {r.key: r.clip_key for r in read_latent_rows(store)}
    samples = build_samples(config, store)
    by_file = {names[clip_of[s.latent_key]]: s for s in samples}
    assert by_file["silent.mp4"].audio_key == "" and by_file["silent.mp4"].group[2] == ""
    assert all(by_file[f].audio_key and by_file[f].group[2] == "demo-videos" for f in ("low.mov", "high.mov"))

    transformer, params = load_transformer(config, family, model_source(config), CPU)
    names_of = {id(p): n for n, p in transformer.named_parameters()}
    for source, sound in (("silent.mp4", False), ("low.mov", True)):
        transformer.zero_grad(set_to_none=True)
        batch = load_micro_batch(config, family, store, [by_file[source]], 0)
        assert (batch.audio is not None) == sound
        terms = flow_terms(transformer, family, batch, CPU, autocast=False)
        assert (terms.audio is not None) == sound
        terms.flow.backward()
        audio_grads = {names_of[id(p)]: p.grad for p in params if AUDIO.search(names_of[id(p)])}
        sound_only = {n: g for n, g in audio_grads.items() if SOUND_ONLY.search(n) and "lora_B" in n}
        assert audio_grads and sound_only, "no audio LoRA weight is trained: the checks below would hold vacuously"
        if sound:
            assert math.isfinite(terms.audio.item()) and terms.audio.item() > 0
            assert torch.equal(terms.flow, terms.video + terms.audio)
            assert all(g is not None and g.abs().max() > 0 for g in sound_only.values())
        else:
            assert all(g is None for g in audio_grads.values())
            assert any(p.grad is not None and p.grad.abs().max() > 0 for p in params)  # the video trained

    left_out = make_config(root, "leave_out", steps=2)
    kept = {names[clip_of[s.latent_key]] for s in build_samples(left_out, store)}
    assert kept == {"low.mov", "high.mov"}
    report = T.train_lora(left_out, get_family(left_out), model_source(left_out), store)
    assert report.computed == 2 and all(step.audio_loss > 0 for step in report.history)


def test_tread_routes_the_picture_and_the_sound_still_trains(trained: tuple[LoraflowConfig, Path], root: Path) -> None:
    """TREAD routes visual tokens only (Kandinsky 6's TokenLayout: the fused block's first input and output); the
    audio stream goes through each block whole. A route at ratio 0 trains the same LoRA, bit for bit, as no route,
    the audio weights included (the routing wrapper hands the block's audio output on as it came); at ratio 0.5 the
    picture's loss moves and every step with sound still has a finite, positive audio term."""
    config, run = trained
    route = {"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": 1}  # the tiny transformer's last block
    zero = make_config(root, "video_only", name="tread-0", tread_config={"routes": [route]})
    report = T.train_lora(zero, get_family(zero), model_source(zero), Store(zero.cache_dir, zero.manifest_names))
    plain, routed = load_file(str(run / LORA_FILE)), load_file(str(Path(report.run_dir) / LORA_FILE))
    assert Path(report.run_dir) != run and plain.keys() == routed.keys()
    assert all(torch.equal(plain[k], routed[k]) for k in plain)
    halfway = {"routes": [{**route, "selection_ratio": 0.5}]}
    half = make_config(root, "video_only", name="tread-half", tread_config=halfway)
    history = T.train_lora(half, get_family(half), model_source(half), Store(half.cache_dir)).history
    before = json.loads((run / "history.json").read_text())
    assert [step.loss for step in history] != [row["loss"] for row in before]
    assert [step.audio_loss > 0 for step in history] == [row["audio_loss"] > 0 for row in before]
    assert all(math.isfinite(step.audio_loss) for step in history)


def test_crepa_aligns_the_picture_and_the_sound_still_trains(trained: tuple[LoraflowConfig, Path], root: Path) -> None:
    """CREPA reads the fused block's visual output (Kandinsky 6's TokenLayout: output 0); the audio output goes on as
    the block returned it. At crepa_lambda 0 a run trains as without CREPA: each step's flow loss, audio term and
    gradient norm (over every LoRA weight, the audio stream's included) bit for bit; at 0.5 every step logs a finite,
    non-zero CREPA term, the first step's flow and audio terms are the plain run's (the hook changes no forward) and
    every step with sound keeps its audio term. Three steps: two with sound, one without."""
    config, run = trained
    teacher = {"crepa_enabled": True, "crepa_block_index": 1, "crepa_encoder_image_size": 16,
               "crepa_encoder_path": str(tiny_dinov2(root / "dinov2"))}  # tests/assets/test_guide_features.py's
    before = json.loads((run / "history.json").read_text())[:3]
    assert [row["audio_loss"] > 0 for row in before] == [True, True, False]
    zero = make_config(root, "video_only", steps=3, name="crepa-0", crepa_lambda=0.0, **teacher)
    store = Store(zero.cache_dir, zero.manifest_names)
    cache_teacher_features(zero, get_family(zero), store)
    history = T.train_lora(zero, get_family(zero), model_source(zero), store).history
    assert [(s.loss, s.audio_loss, s.grad_norm) for s in history] == [
        (r["loss"], r["audio_loss"], r["grad_norm"]) for r in before]
    weighted = make_config(root, "video_only", steps=3, name="crepa-half", crepa_lambda=0.5, **teacher)
    history = T.train_lora(weighted, get_family(weighted), model_source(weighted), store).history
    assert (history[0].loss, history[0].audio_loss) == (before[0]["loss"], before[0]["audio_loss"])
    assert all(math.isfinite(step.crepa_loss) and step.crepa_loss != 0 for step in history)
    assert [step.audio_loss > 0 for step in history] == [True, True, False]


def test_the_distilled_sound_head_trains_each_grid_velocity_as_piflow_reads_it(root: Path) -> None:
    """π-Flow (a distilled flavour): the audio head gives n_grid velocities per audio channel, (B, L, C_a n_grid) as
    the pipeline hands them to its audio scheduler (K6:920-921, a PiflowScheduler copy), whose `_to_grid` reads them
    grid-major and whose `DXPolicy` turns each into an x0 at the same x_t (x0_g = x_t - sigma v_g). The audio term
    is the mean over the grid of ((x0_g - x0) / sigma)^2, read through those two: every velocity is held to the
    clip's sound, as each of the picture's is to its frames (`flow_mse`)."""
    from diffusers import PiflowScheduler
    from diffusers.schedulers.scheduling_piflow import DXPolicy

    distilled = build_tiny("kandinsky6", root / "k6-distill", flavour="lite-distill-t2v")
    family = get_family(make_config(root, "video_only", name="distill", model_flavour="lite-distill-t2v",
                                    pretrained_model_name_or_path=str(distilled)))
    config = make_config(root, "video_only")  # the caches: the distilled checkpoint's VAE and encoders are the same
    store = Store(config.cache_dir, config.manifest_names)
    sample = next(s for s in build_samples(config, store) if s.audio_key)
    batch = load_micro_batch(config, family, store, [sample, sample], 3)
    transformer = load_component(distilled, "transformer")
    terms, call, out = one_call(transformer, family, batch)
    scheduler = PiflowScheduler.from_pretrained(distilled, subfolder="scheduler")
    x_t, sigma = call["audio_hidden_states"], batch.draws.sigma  # (B, L, C_a), the sample's sigma
    grid = scheduler._to_grid(out[1], x_t)  # (B, n_grid, L, C_a)
    assert grid.shape == (2, scheduler.config.n_grid, 31, 8) and scheduler.config.n_grid > 1
    x0_g = DXPolicy(grid, x_t, sigma).denoising_output_x_0
    x0 = batch.audio.x0.permute(0, 2, 1)[:, None]
    expected = (((x0_g - x0) / sigma.view(-1, 1, 1, 1)) ** 2).mean()
    # fp32: every value is below 8 in size and sigma above 0.5 (checked), so each element's residual, v_g - (noise -
    # x0) in flow_mse and (x0_g - x0) / sigma here, is a few roundings of 2^-24 x 16 / 0.5 apart (< 1e-5) and their
    # squares (residuals below 16) < 2 x 16 x 1e-5 apart: so are the means
    assert sigma.min() > 0.5 and max(t.abs().max() for t in (x_t, out[1], x0, batch.audio.noise)) < 8
    torch.testing.assert_close(terms.audio, expected, rtol=0, atol=3.2e-4)


@pytest.fixture(scope="module")
def i2v_cache(root: Path) -> Path:
    """The module's caches, copied, with the i2v flavour's latents (each clip's first frame encoded alone beside its
    latent, `image_latent`): the other tests' runs read the t2v latents' manifest in root/cache."""
    cache = root / "cache-i2v"
    shutil.copytree(root / "cache", cache)
    config = make_config(root, "video_only", name="i2v", model_flavour="lite-i2v", cache_dir=str(cache))
    cache_for(config)
    return cache


def test_i2v_gives_the_first_frame_and_the_sound_in_one_call_or_trains_as_t2v(i2v_cache: Path, root: Path) -> None:
    """lite-i2v with `i2v_prob` 0.3 (seed 42 draws micro-step 0 as t2v, 1 as i2v): both calls get the sample's sound
    noised at its sigma; the i2v call appends the clip's first frame encoded alone as one clean tail frame (mask 1,
    token type 1, the rotary position of frame 0: K6:848-867), the t2v call has none (zero mask, no types), and
    each has a finite, positive audio term beside its picture's."""
    from loraflow.kernels.flow_matching import noisy_sample

    config = make_config(root, "video_only", name="i2v-mixed", model_flavour="lite-i2v", i2v_prob=0.3,
                         cache_dir=str(i2v_cache))
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    assert [trains_as_i2v(config, k) for k in (0, 1)] == [False, True]
    sample = next(s for s in build_samples(config, store) if s.audio_key)
    image = torch.from_numpy(np.asarray(store.get("latents", {sample.latent_key})[sample.latent_key]["image_latent"]))
    transformer = load_component(root / "k6", "transformer")
    for micro_step, as_i2v in ((0, False), (1, True)):
        batch = load_micro_batch(config, family, store, [sample], micro_step)
        terms, call, _ = one_call(transformer, family, batch)
        expected = noisy_sample(batch.audio.x0, batch.audio.noise, batch.draws.sigma).permute(0, 2, 1)
        assert torch.equal(call["audio_hidden_states"], expected)
        assert math.isfinite(terms.audio.item()) and terms.audio.item() > 0 and terms.video.item() > 0
        hidden, frames = call["hidden_states"], batch.x0.shape[2]  # (B, T(+1), h, w, 16 latent + 16 cond + mask)
        assert hidden.shape[1] == frames + as_i2v
        assert torch.equal(hidden[0, :frames, ..., -1], torch.zeros_like(hidden[0, :frames, ..., -1]))
        if as_i2v:
            assert torch.equal(hidden[0, -1, ..., :16], image[:, 0].permute(1, 2, 0))
            assert bool((hidden[0, -1, ..., -1] == 1).all())
            assert call["visual_token_type_ids"].tolist() == [[0] * frames + [1]]
            assert call["visual_rope_pos"][0].tolist() == [*range(frames), 0]
        else:
            assert call["visual_token_type_ids"] is None and call["visual_rope_pos"] is None


def test_i2v_prob_0_trains_as_the_t2v_run_with_its_sound(i2v_cache: Path, trained: tuple[LoraflowConfig, Path],
                                                       root: Path) -> None:
    """lite-i2v with `i2v_prob` 0 trains every micro-batch as t2v, sound included: its steps are the t2v run's
    (the same checkpoint, clips and draws), flow loss, audio term and gradient norm bit for bit."""
    _, run = trained
    config = make_config(root, "video_only", steps=3, name="i2v-as-t2v", model_flavour="lite-i2v", i2v_prob=0.0,
                         cache_dir=str(i2v_cache))
    history = T.train_lora(config, get_family(config), model_source(config), Store(config.cache_dir)).history
    before = json.loads((run / "history.json").read_text())[:3]
    assert [(s.loss, s.audio_loss, s.grad_norm) for s in history] == [
        (r["loss"], r["audio_loss"], r["grad_norm"]) for r in before]
    assert [s.audio_loss > 0 for s in history] == [True, True, False]  # both kinds of step: the plan's first three


def test_both_streams_are_noised_at_the_samples_one_sigma(root: Path) -> None:
    """What the transformer gets for a batch of two with sound (a clip's two repeats: one group): each stored audio
    latent noised at its own sample's sigma, the one its video has, (1 - sigma) x0 + sigma noise in the (B, L, C)
    layout, beside the one timestep sigma x 1000 per sample."""
    from loraflow.kernels.flow_matching import noisy_sample

    config = make_config(root, "video_only")
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    sample = next(s for s in build_samples(config, store) if s.audio_key)
    batch = load_micro_batch(config, family, store, [sample, sample], 3)
    stored = store.get("audio_latents", {sample.audio_key})[sample.audio_key]["audio_latent"]
    assert torch.equal(batch.audio.x0[1], torch.from_numpy(np.asarray(stored))) and batch.audio.x0.shape == (2, 8, 31)
    assert batch.draws.sigma[0] != batch.draws.sigma[1]
    transformer = load_component(root / "k6", "transformer")
    _, call, _ = one_call(transformer, family, batch)
    sigma = batch.draws.sigma
    assert torch.equal(call["timestep"], sigma * 1000)
    expected = noisy_sample(batch.audio.x0, batch.audio.noise, sigma).permute(0, 2, 1)
    assert torch.equal(call["audio_hidden_states"], expected)


def test_two_processes_one_with_sound_one_without_equal_one_process(root: Path) -> None:
    """A step where one rank's clip has sound and the other's has none: the silent rank's audio-stream gradients are
    zeros, not missing (`Trainable.fill_missing`), so both ranks average one list, and the run equals one process
    accumulating the same two micro-steps, bit for bit (tests/training/test_distributed.py says why it can; the
    launcher gives each rank one thread, so the reference trains with one)."""
    two = make_config(root, "video_only", steps=3, name="two", num_processes=2)
    plan = BatchPlan(build_samples(two, Store(two.cache_dir, two.manifest_names)), 1, two.seed)
    heard = [bool(plan(k)[0].audio_key) for k in range(6)]  # rank 0 takes micro-steps 0, 2, 4; rank 1 1, 3, 5
    assert any(heard[2 * k] != heard[2 * k + 1] for k in range(3))
    run_ranks(launch_command(str(root / "two.yaml"), 2))
    one = make_config(root, "video_only", steps=3, name="one", gradient_accumulation_steps=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = T.train_lora(one, get_family(one), model_source(one), Store(one.cache_dir, one.manifest_names))
    finally:
        torch.set_num_threads(threads)
    launched = current_run_dir(two, get_family(two), Store(two.cache_dir, two.manifest_names))
    history = json.loads((launched / "history.json").read_text())
    assert [(r.loss, r.grad_norm, r.audio_loss) for r in report.history] == [
        (r["loss"], r["grad_norm"], r["audio_loss"]) for r in history]
    assert same_lora_file(Path(report.lora_path), launched / LORA_FILE)


def test_what_the_sound_decides_is_in_the_run_key(root: Path) -> None:
    """A run trains anew when how silent clips train changes (video_only vs leave_out, the same steps) or the audio
    rows it reads change; the picture's inputs alone keep the key of a run without sound apart too. Seen failing with
    `clips_without_audio` taken out of the run key (its setting's run_key "never")."""
    video_only, left_out = make_config(root, "video_only", steps=3, name="key-a"), make_config(
        root, "leave_out", steps=3, name="key-b")
    store = Store(video_only.cache_dir, video_only.manifest_names)
    upstream = upstream_versions(store, video_only, get_family(video_only))
    assert upstream["audio_latents"] and upstream == upstream_versions(store, left_out, get_family(left_out))
    assert run_dir(video_only, upstream) != run_dir(left_out, upstream)
    other_rows = {**upstream, "audio_latents": upstream["audio_latents"][::-1]}
    assert run_dir(video_only, other_rows) != run_dir(video_only, upstream)
    silent = video_only.model_copy(update={"train_audio": False})
    assert "audio_latents" not in upstream_versions(store, silent, get_family(silent))


def test_loraflow_cache_caches_the_sound_too(root: Path, tmp_path: Path) -> None:
    """`loraflow cache` (one dataset, outside Dagster) does what the cache_dataset run does: with train_audio the
    clips' sound too, or training would then stop for want of its rows. Seen failing before shard_worker's
    cache_dataset encoded the sound (no audio rows in the store)."""
    import subprocess
    import sys

    config = make_config(root, "video_only", name="cache-cli", cache_dir=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "loraflow.cli", "cache", str(root / "cache-cli.yaml"), "--dataset",
                           "demo-videos"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "audio latents computed 3, reused 0" in done.stdout
    rows = read_audio_rows(Store(config.cache_dir, config.manifest_names))
    assert sorted(r.status for r in rows.values()) == ["no_audio", "ok", "ok"]
