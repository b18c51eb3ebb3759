"""Kandinsky 6 against its diffusers pipeline, on the tiny real-architecture checkpoints (`kandinsky6.tiny`).

Text rows == the pipeline's `_get_prompt_embeds` (its crop constant set to the tiny tokenizer's, as
tests/pipelines/test_families.py sets Kandinsky 5's); `velocity` == each transformer call the pipeline's own loop
makes (seen by a forward hook: t2v, i2v's tail frame, the π-Flow head, and with sound both predictions), bit for bit;
a padded batch == each text alone; the LoRA file loads where validation loads it and ComfyUI's names are the original
node's; every LoRA target learns. Kandinsky 5's caches serve Kandinsky 6 where the computation is the same
(tests/stages/test_kandinsky6_stages.py runs the stages; tests/stages/test_kandinsky6_audio.py trains the sound).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import Kandinsky6TI2VAPipeline
from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as k6_pipeline
from peft import LoraConfig, get_peft_model_state_dict
from PIL import Image

from loraflow.contracts.audio_rows import audio_latent_length
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines.base import load_component
from loraflow.pipelines.comfyui import comfyui_name
from loraflow.pipelines.kandinsky5.common import template_crop
from loraflow.pipelines.kandinsky6 import family as kandinsky6
from loraflow.pipelines.kandinsky6.tiny import AUDIO_CHANNELS
from loraflow.training.checkpoints import adapter_config
from tests.numerics import assert_float64_close

PROMPTS = ["a cat walks on the grass", "a dog"]
LATENTS = (1, 16, 3, 4, 6)  # (B, C, T, h, w): 9 frames at 32x48


@pytest.fixture(scope="module")
def tiny_k6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("kandinsky6", tmp_path_factory.mktemp("k6") / "flow")


@pytest.fixture(scope="module")
def tiny_k6_distilled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("kandinsky6", tmp_path_factory.mktemp("k6") / "piflow", flavour="lite-distill-t2v")


@pytest.fixture(scope="module")
def text(tiny_k6: Path) -> dict[str, Any]:
    family = kandinsky6.make_family(None)
    return {name: load_component(tiny_k6, name) for name in family.text_components}


def pipeline(path: Path) -> Kandinsky6TI2VAPipeline:
    pipe = Kandinsky6TI2VAPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_template_is_the_pipelines() -> None:
    assert kandinsky6.make_family(None).prompt_template == k6_pipeline._PROMPT_TEMPLATE


def test_text_rows_equal_the_pipelines(tiny_k6: Path, text: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline pads to max_sequence_length (1024) with a mask; a row keeps the valid tokens, which a causal Qwen
    computes alike (float64: padding changes how the kernels block their sums). As given: the text is not cleaned."""
    family = kandinsky6.make_family(None)
    monkeypatch.setattr(k6_pipeline, "_QWEN_CROP_START", template_crop(text["tokenizer"], family.prompt_template))
    prompts = [*PROMPTS, "  Tom &amp; Jerry\n run  "]
    rows = family.encode_text(text, prompts)
    as64 = {n: c.double() if isinstance(c, torch.nn.Module) else c for n, c in text.items()}
    with torch.no_grad():
        embeds, pooled, mask = Kandinsky6TI2VAPipeline._get_prompt_embeds(
            prompts, as64["tokenizer"], as64["text_encoder"], as64["tokenizer_2"], as64["text_encoder_2"], 1024, "cpu")
    mine = family.collate_text(family.encode_text(as64, prompts), torch.device("cpu"))
    length = mine["text_embeds"].shape[1]
    assert not mask[:, length:].any() and torch.equal(mine["text_mask"], mask[:, :length])
    valid = mine["text_mask"]
    assert_float64_close(mine["text_embeds"][valid], embeds[:, :length][valid], float32_roundings=1)
    assert_float64_close(mine["pooled_embeds"], pooled, float32_roundings=1)
    assert [len(r["text_embeds"]) for r in rows] == mask.sum(1).tolist()
    # as given: the entity and the spaces are tokens of the third row (cleaned, its caption would be 13 bytes shorter)
    assert len(rows[2]["text_embeds"]) == len(rows[0]["text_embeds"]) - len(PROMPTS[0]) + len(prompts[2])


def hooked_calls(pipe: Kandinsky6TI2VAPipeline, sample_audio: bool = False,
                 **call: Any) -> list[tuple[dict, tuple[torch.Tensor, ...]]]:
    """Every transformer call of one pipeline run: its keyword arguments and its outputs (video[, audio])."""
    calls: list[tuple[dict, tuple[torch.Tensor, ...]]] = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    try:
        pipe(**call, height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=1.0,
             sample_audio=sample_audio, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    return calls


@pytest.mark.parametrize(("flavour", "image"), [("lite-t2v", False), ("lite-i2v", True),
                                                ("lite-distill-t2v", False)])
def test_velocity_equals_the_pipelines_transformer_calls(flavour: str, image: bool, tiny_k6: Path,
                                                        tiny_k6_distilled: Path, text: dict[str, Any]) -> None:
    """Each call of the pipeline's loop (K6:889-900) against `velocity` on the same latents, sigma and text: t2v
    (zero condition, no token types), i2v (the image latent the pipeline encoded, as the tail frame) and the π-Flow
    head (n_grid velocities per channel). The timestep is the scheduler's sigma * 1000, as the scheduler computes it."""
    family = kandinsky6.make_family(flavour)
    pipe = pipeline(tiny_k6_distilled if "distill" in flavour else tiny_k6)
    row = family.collate_text(family.encode_text(text, PROMPTS[:1]), torch.device("cpu"))
    latents = torch.randn(LATENTS, generator=torch.Generator().manual_seed(1))
    picture = {"image": Image.fromarray(np.full((32, 48, 3), 120, np.uint8))} if image else {}
    calls = hooked_calls(pipe, prompt_embeds=row["text_embeds"], pooled_prompt_embeds=row["pooled_embeds"],
                         latents=latents, **picture)
    assert len(calls) == 2
    for step, (kwargs, out) in enumerate(calls):
        hidden = kwargs["hidden_states"]  # (B, T [+1], h, w, 33)
        frames = LATENTS[2]
        given = dict(row)
        if image:
            given["image_latent"] = hidden[:, -1:, ..., :16].permute(0, 4, 1, 2, 3)
            assert hidden[:, -1, ..., -1].eq(1).all() and not hidden[:, :-1, ..., -1].any()  # the tail's mask
        noisy = hidden[:, :frames, ..., :16].permute(0, 4, 1, 2, 3)
        with torch.no_grad():
            mine = family.velocity(pipe.transformer, noisy, pipe.scheduler.sigmas[step].reshape(1), given)
        assert torch.equal(mine, out[0][:, :frames].permute(0, 4, 1, 2, 3))
        assert mine.shape[1] == pipe.transformer.config.out_visual_dim  # 16, or 16 x n_grid (π-Flow)


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "i2v"])
def test_joint_velocity_equals_the_pipelines_calls_with_sound(image: bool, tiny_k6: Path,
                                                              text: dict[str, Any]) -> None:
    """With sound (`sample_audio`, K6:835-846): each call of the loop gets the audio latents beside the video's
    at the one timestep both are stepped with (K6:889-899, 920-921); `velocity(..., audio=)` on the same latents in
    the pipeline's own (B, C_a, L) layout returns both of that call's predictions, bit for bit. The audio is as long
    as the audio_latents stage caches it beside that many frames (`audio_latent_length`)."""
    family = kandinsky6.make_family("lite-i2v" if image else "lite-t2v")
    pipe = pipeline(tiny_k6)
    row = family.collate_text(family.encode_text(text, PROMPTS[:1]), torch.device("cpu"))
    latents = torch.randn(LATENTS, generator=torch.Generator().manual_seed(1))
    picture = {"image": Image.fromarray(np.full((32, 48, 3), 120, np.uint8))} if image else {}
    calls = hooked_calls(pipe, sample_audio=True, prompt_embeds=row["text_embeds"],
                         pooled_prompt_embeds=row["pooled_embeds"], latents=latents, **picture)
    assert len(calls) == 2
    frames = LATENTS[2]
    for step, (kwargs, out) in enumerate(calls):
        hidden, heard = kwargs["hidden_states"], kwargs["audio_hidden_states"]  # (B, L, C_a)
        assert heard.shape == (1, audio_latent_length(9, 24.0, 44_100, 1024), AUDIO_CHANNELS)
        given = dict(row)
        if image:
            given["image_latent"] = hidden[:, -1:, ..., :16].permute(0, 4, 1, 2, 3)
        noisy = hidden[:, :frames, ..., :16].permute(0, 4, 1, 2, 3)
        with torch.no_grad():
            video, audio = family.velocity(pipe.transformer, noisy, pipe.scheduler.sigmas[step].reshape(1), given,
                                           audio=heard.permute(0, 2, 1))
        assert torch.equal(video, out[0][:, :frames].permute(0, 4, 1, 2, 3))
        assert torch.equal(audio, out[1].permute(0, 2, 1))
        assert audio.shape == (1, AUDIO_CHANNELS, heard.shape[1])


def test_a_padded_batch_equals_each_text_alone(tiny_k6: Path, text: dict[str, Any]) -> None:
    """The mask makes padding invisible: a batch of a long and a short text predicts, row by row, what each text
    predicts alone (unpadded, no mask). float64: padding changes how the kernels block their sums."""
    family = kandinsky6.make_family(None)
    transformer = load_component(tiny_k6, "transformer").double()
    rows = family.encode_text(text, PROMPTS)
    batch = family.collate_text(rows, torch.device("cpu"))
    assert batch["text_mask"].sum(1).tolist() == [len(r["text_embeds"]) for r in rows]
    latents = torch.randn(2, *LATENTS[1:], generator=torch.Generator().manual_seed(2)).double()
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        together = family.velocity(transformer, latents, sigma, batch)
        for i, row in enumerate(rows):
            alone = family.collate_text([row], torch.device("cpu"))
            assert "text_mask" not in alone
            assert_float64_close(together[i:i + 1].double(),
                                 family.velocity(transformer, latents[i:i + 1], sigma[i:i + 1], alone).double(),
                                 float32_roundings=1)


def randomised_lora(path: Path, targets: str) -> torch.nn.Module:
    transformer = load_component(path, "transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return transformer


def test_saved_lora_loads_where_validation_loads_it(tiny_k6: Path, text: dict[str, Any], tmp_path: Path) -> None:
    """lora_alpha 4 x rank: a loader that lost the alpha renders a weaker LoRA."""
    family = kandinsky6.make_family(None)
    trained = randomised_lora(tiny_k6, family.lora_targets(True))
    family.save_lora(get_peft_model_state_dict(trained), tmp_path, adapter_config(trained))
    lora_file = tmp_path / "pytorch_lora_weights.safetensors"
    row = family.collate_text(family.encode_text(text, PROMPTS[:1]), torch.device("cpu"))
    latents = torch.randn(LATENTS, generator=torch.Generator().manual_seed(4))

    def probe(transformer: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return family.velocity(transformer, latents, torch.tensor([0.6]), row)

    renderer = family.load_renderer(str(tiny_k6), str(lora_file), torch.device("cpu"))
    assert torch.equal(probe(renderer.transformer), probe(trained))
    assert (probe(trained) - probe(load_component(tiny_k6, "transformer"))).abs().max() > 1e-3


@pytest.mark.parametrize("audio", [False, True])
def test_every_lora_target_learns(audio: bool, tiny_k6: Path, text: dict[str, Any]) -> None:
    """Video alone: every target gets a gradient from a video step, and none of the audio stream is a target (a
    video-only step leaves the audio stream unrun). With audio: the audio stream and the cross-modal attention too,
    each getting a gradient from a joint step (the family `train_audio` makes: `trains_audio`)."""
    family = kandinsky6.make_family(None)
    transformer = load_component(tiny_k6, "transformer")
    targets = kandinsky6.lora_pattern(True, audio=audio)
    names = [n for n, _ in transformer.named_modules() if re.fullmatch(targets, n)]
    per_text_block, per_fused_block = 4 + 2, 8 + 2  # attention (+ cross-attention) projections, feed-forward
    text_blocks, blocks = transformer.config.num_text_blocks, transformer.config.num_visual_blocks
    streams = 2 if audio else 1
    cross_modal = 8 * blocks if audio else 0  # va_ and av_cross_attention
    assert len(names) == streams * (per_text_block * text_blocks + per_fused_block * blocks) + cross_modal
    assert audio or not any(re.search(r"audio|va_cross|av_cross", n) for n in names)
    assert replace(family, trains_audio=audio).lora_targets(True) == targets
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    transformer.train()
    row = family.collate_text(family.encode_text(text, PROMPTS[:1]), torch.device("cpu"))
    latents = torch.randn(LATENTS, generator=torch.Generator().manual_seed(5))
    if audio:  # a joint step: both predictions in the loss (the lora stage's is tests/stages/test_kandinsky6_audio.py)
        sound = torch.randn(1, AUDIO_CHANNELS, 17, generator=torch.Generator().manual_seed(6))
        video, heard = family.velocity(transformer, latents, torch.tensor([0.6]), row, audio=sound)
        (video.square().mean() + heard.square().mean()).backward()
    else:
        family.velocity(transformer, latents, torch.tensor([0.6]), row).square().mean().backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if "lora_B" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_comfyui_names_are_the_original_nodes() -> None:
    """Every target maps; the names the node's detector requires (kandinskylab/kandinsky-6 register.py
    `_K6_REQUIRED_KEYS`, less `.weight`) come out as they are written there."""
    rules = kandinsky6.KANDINSKY6_COMFYUI_NAMES
    fused, text = "visual_transformer_blocks.", "_text_transformer_blocks."
    required = {
        f"{fused}0.va_cross_attention.to_key": "visual_blocks.0.va_cross_attention.to_key",
        f"{fused}0.video_dec_block.feed_forward.net.0.proj": "visual_blocks.0.videoT.feed_forward.in_layer",
        f"{fused}0.audio_dec_block.feed_forward.net.0.proj": "visual_blocks.0.audioT.feed_forward.in_layer",
        f"{fused}3.video_dec_block.self_attention.to_query": "visual_blocks.3.videoT.self_attention.to_query",
        f"audio{text}1.attn.out_layer": f"audio{text}1.self_attention.out_layer",
        f"video{text}0.feed_forward.net.2": f"video{text}0.feed_forward.out_layer",
    }
    assert {name: comfyui_name(rules, name)[0] for name in required} == required


def test_a_distilled_flavour_renders_with_piflow_and_no_guidance(tiny_k6_distilled: Path,
                                                                 text: dict[str, Any]) -> None:
    """The π-Flow checkpoint renders through its own PiflowScheduler, one transformer call per step (guidance 1.0:
    no negative pass), i2v from a first frame, its sound sampled with the picture even when only the picture is
    asked for (the original's rule: `Flavour.sound_required`); another guidance is refused before the pipeline runs,
    naming the key."""
    from diffusers import PiflowScheduler

    from loraflow.pipelines.base import RenderSettings

    family = kandinsky6.make_family("lite-distill-i2v")
    pipe = family.load_renderer(str(tiny_k6_distilled), None, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    prompt, negative = family.encode_text(text, [PROMPTS[0], ""])
    settings = RenderSettings(height=32, width=48, num_frames=9, num_inference_steps=2, guidance=1.0, seed=0,
                              flow_shift=5.0)
    image = np.full((32, 48, 3), 120, np.uint8)
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw), with_kwargs=True)
    try:
        video = family.render(pipe, prompt, negative, settings, lora_scale=0, image=image)
    finally:
        hook.remove()
    assert isinstance(pipe.scheduler, PiflowScheduler) and pipe.scheduler.config.shift == 5.0
    assert video.shape == (9, 32, 48, 3) and video.dtype == np.uint8 and len(calls) == 2
    assert all(call["audio_hidden_states"] is not None for call in calls)  # both streams, every step
    with pytest.raises(ValueError, match="validation_guidance: 1.0"):
        family.render(pipe, prompt, negative, replace(settings, guidance=5.0), lora_scale=0, image=image)
    assert len(calls) == 2
