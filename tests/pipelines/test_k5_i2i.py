"""Kandinsky 5 Image i2i's family numbers against `Kandinsky5I2IPipeline`, on the tiny i2i checkpoint.

Text rows == the pipeline's encode_prompt with the source image; the cached source latent == the pipeline VAE's
mode() * scaling; velocity == the transformer called on the pipeline's own prepared latents; a LoRA learns and loads;
a render at lora_scale 0 == the pipeline given the same image, prompt and seed. loraflow encodes with the original
Kandinsky 5 repo's i2i template and crop (`I2I_PROMPT_TEMPLATE`, 3 tokens past its prefix), not diffusers', so the
reference pipeline is given that template and that crop, computed for the tiny byte-level tokenizer (the pipeline's
hard-coded 54 is the real tokenizer's crop of diffusers' template). Borrowed from loraflow, then: the template and
the crop. Not borrowed: tests/pipelines/test_qwen_templates.py counts both templates under the real Qwen vocabulary
and pins the crop to the original repository's 55.

Every comparison is bit for bit, by construction (issue 15: the same verdict on any CPU): the family and the
pipeline run the same ops on the same shapes in this process, one prompt and one source image at a time, unpadded.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5I2IPipeline
from peft import LoraConfig, get_peft_model_state_dict
from PIL import Image

from loraflow.demo.tiny import build_tiny
from loraflow.pipelines.base import load_component
from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15
from loraflow.pipelines.kandinsky5.image import family as kandinsky5_image
from loraflow.pipelines.kandinsky5.image.family import (
    I2I_CROP_PAST_PREFIX,
    I2I_MAX_TEXT_TOKENS,
    I2I_PROMPT_TEMPLATE,
    Kandinsky5ImageI2I,
    i2i_template_crop,
)
from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_transformer
from loraflow.pipelines.kandinsky5.video import family as kandinsky5_video
from loraflow.training.checkpoints import adapter_config

I2I = "i2i-lite-sft"
PROMPTS = ["make the circle green", "  Tom &amp; Jerry\n run  ", ""]
LONG_PROMPT = "a long and winding road through the hills " * 30  # 1290 bytes: past the 1024-token budget
IMAGE_TOKENS = 4  # a 64 px source, halved by the pipeline, is 2 x 2 merged patches in the tiny processor
USER_TOKENS_CUT = I2I_CROP_PAST_PREFIX  # the crop takes the first user-turn tokens too (one a byte here)


@dataclass
class Loaded:
    path: Path
    family: Kandinsky5ImageI2I
    pipe: Kandinsky5I2IPipeline  # the reference: everything loaded by the pipeline itself
    text: dict[str, Any]  # the family's components, loaded as the text stage loads them


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = build_tiny("kandinsky5-image", tmp_path_factory.mktemp("tiny") / "k5-i2i", flavour=I2I)
    pipe = Kandinsky5I2IPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template = I2I_PROMPT_TEMPLATE  # the original repo's, as loraflow encodes
    pipe.prompt_template_encode_start_idx = i2i_template_crop(pipe.tokenizer)
    family = kandinsky5_image.make_family(I2I)
    return Loaded(path, family, pipe, {name: load_component(path, name) for name in family.text_components})


def source(seed: int, height: int = 64, width: int = 64) -> np.ndarray:
    """A random source image, uint8 (H, W, 3)."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def reference_text(loaded: Loaded, prompt: str, image: np.ndarray) -> tuple[torch.Tensor, ...]:
    """(qwen (1, L, D), clip (1, 768), cu_seqlens): the pipeline's own encode_prompt, max_sequence_length 1024."""
    with torch.no_grad():  # as inside the pipeline's __call__
        return loaded.pipe.encode_prompt(prompt, image=Image.fromarray(image), device="cpu")


def same(actual: Any, expected: torch.Tensor) -> None:
    """Bit for bit (the module docstring says why)."""
    actual = torch.as_tensor(actual)
    assert actual.shape == expected.shape and torch.equal(actual, expected), (actual - expected).abs().max()


# -- family and flavour ------------------------------------------------------------------------------------
def test_i2i_family_has_its_own_template_limit_and_condition() -> None:
    i2i, t2i = kandinsky5_image.make_family(I2I), kandinsky5_image.make_family("t2i-lite-sft")
    assert isinstance(i2i, Kandinsky5ImageI2I) and isinstance(kandinsky5_image.make_family("i2i-lite-pretrain"),
                                                              Kandinsky5ImageI2I)
    assert not isinstance(t2i, Kandinsky5ImageI2I)
    assert i2i.text_signature != t2i.text_signature  # no text key is shared between the two
    assert (i2i.max_text_tokens, t2i.max_text_tokens) == (1024, 512)
    assert (i2i.image_condition_name, t2i.image_condition_name) == ("source_image", "")
    assert i2i.flavour.conditioning_frames == 0  # the source is extra channels, not a clean frame
    with pytest.raises(ValueError, match="make_family") as refused:  # the t2i class cannot run an i2i flavour
        kandinsky5_image.Kandinsky5Image(flavour=i2i.flavour)
    named = str(refused.value).split("build it with ")[1].split(",")[0]  # module.make_family, importable
    assert getattr(importlib.import_module(named.rsplit(".", 1)[0]), "make_family") is kandinsky5_image.make_family


@pytest.mark.parametrize(("module", "flavour", "expected"), [
    (kandinsky5_video, "t2v-lite-sft-5s", ""), (kandinsky5_video, "i2v-lite-5s", ""),
    (kandinsky5_image, "t2i-lite-sft", ""), (kandinsky5_image, I2I, "source_image"),
    (hunyuanvideo15, "t2v-480p", ""), (hunyuanvideo15, "i2v-480p", "first_frame"),
])
def test_every_family_names_its_image_condition(module: Any, flavour: str, expected: str) -> None:
    assert module.make_family(flavour).image_condition_name == expected


@pytest.mark.parametrize(("module", "flavour"), [
    (kandinsky5_video, "t2v-lite-sft-5s"), (kandinsky5_video, "i2v-lite-5s"), (kandinsky5_image, "t2i-lite-sft"),
    (hunyuanvideo15, "i2v-480p"),
])
def test_text_only_families_refuse_images(module: Any, flavour: str) -> None:
    with pytest.raises(ValueError, match="encodes prompts alone"):
        module.make_family(flavour).encode_text({}, ["a cat"], images=[source(0)])


def test_i2i_text_needs_one_image_per_text(loaded: Loaded) -> None:
    for images in (None, [source(0)]):
        with pytest.raises(ValueError, match="source image"):
            loaded.family.encode_text(loaded.text, ["a cat", "a dog"], images=images)


# -- (a) text ----------------------------------------------------------------------------------------------
def test_text_rows_equal_pipeline_encode_prompt(loaded: Loaded) -> None:
    image = source(0)
    rows = loaded.family.encode_text(loaded.text, PROMPTS, images=[image] * len(PROMPTS))
    for prompt, row in zip(PROMPTS, rows):
        qwen, clip, cu_seqlens = reference_text(loaded, prompt, image)
        assert row["text_embeds"].dtype == np.float32 and row["text_embeds"].shape == qwen.shape[1:]
        same(row["text_embeds"][None], qwen)
        same(row["pooled_embeds"][None], clip)
        assert cu_seqlens.tolist() == [0, len(row["text_embeds"])]
    # after the crop: the user text (one token a byte here), the image's vision tokens, the 3 closing tokens, less
    # the USER_TOKENS_CUT tokens the crop takes past the template's prefix
    assert len(rows[-1]["text_embeds"]) == IMAGE_TOKENS + 3 - USER_TOKENS_CUT
    assert len(rows[0]["text_embeds"]) == len(PROMPTS[0]) + IMAGE_TOKENS + 3 - USER_TOKENS_CUT


def test_text_rows_see_the_source_image(loaded: Loaded) -> None:
    """Another source image changes the Qwen tokens from the image on (the text before it is causal), not CLIP's."""
    prompt = PROMPTS[0]
    first, second = loaded.family.encode_text(loaded.text, [prompt, prompt], images=[source(0), source(1)])
    assert first["text_embeds"].shape == second["text_embeds"].shape
    user = len(prompt) - USER_TOKENS_CUT  # the user text's tokens left after the crop
    np.testing.assert_array_equal(first["text_embeds"][:user], second["text_embeds"][:user])
    assert np.abs(first["text_embeds"][user:] - second["text_embeds"][user:]).max() > 1e-2
    np.testing.assert_array_equal(first["pooled_embeds"], second["pooled_embeds"])
    qwen, _, _ = reference_text(loaded, prompt, source(1))  # and the pipeline agrees on the second image
    same(second["text_embeds"][None], qwen)


def test_non_square_source_gives_its_own_vision_tokens(loaded: Loaded) -> None:
    """64x96 (H x W), halved to 48 x 32 px (W x H): 2 x 3 merged patches; the pipeline agrees."""
    image = source(2, 64, 96)
    (row,) = loaded.family.encode_text(loaded.text, [""], images=[image])
    assert len(row["text_embeds"]) == 6 + 3 - USER_TOKENS_CUT
    same(row["text_embeds"][None], reference_text(loaded, "", image)[0])


def test_long_prompt_is_cut_to_the_token_budget(loaded: Loaded) -> None:
    """The row keeps 1024 tokens after the crop: the text's first 1024 - 4 - 3 bytes after the USER_TOKENS_CUT the crop
    takes, the image, the closing tokens.

    diffusers 0.42.1 cuts the removed text off the end of the whole templated string, image markers included, and
    then fails; if it stops failing, compare with the pipeline on the long prompt itself.
    """
    image = source(0)
    (row,) = loaded.family.encode_text(loaded.text, [LONG_PROMPT], images=[image])
    assert len(row["text_embeds"]) == I2I_MAX_TEXT_TOKENS
    with pytest.raises(ValueError):
        reference_text(loaded, LONG_PROMPT, image)
    kept = LONG_PROMPT[: USER_TOKENS_CUT + I2I_MAX_TEXT_TOKENS - IMAGE_TOKENS - 3]  # ASCII: a token a byte (tiny)
    qwen, _, _ = reference_text(loaded, kept, image)
    same(row["text_embeds"][None], qwen)
    with torch.no_grad():  # CLIP sees the whole prompt, as in the pipeline (it keeps 77 tokens of it anyway)
        same(row["pooled_embeds"][None], loaded.pipe._encode_prompt_clip([LONG_PROMPT.strip()], "cpu"))


def test_a_source_image_past_the_token_budget_is_refused(loaded: Loaded) -> None:
    """With the real processor's pixel cap (1280 merged patches) a 2048 px source has more vision tokens than fit."""
    processor = copy.deepcopy(loaded.text["tokenizer"])
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    with pytest.raises(ValueError, match="1225 vision tokens"):
        loaded.family.encode_text(loaded.text | {"tokenizer": processor}, [""], images=[source(0, 2048, 2048)])


# -- (b) source latent -------------------------------------------------------------------------------------
def test_image_condition_equals_pipeline_vae_mode(loaded: Loaded) -> None:
    """The pipeline's preprocess + VAE, with the posterior's mode where it samples: (16, 1, H/8, W/8) float32."""
    vae, image = load_component(loaded.path, "vae"), source(3, 48, 80)
    cached = loaded.family.image_condition(vae, [], {"condition_frames": [image]})["image_latent"]
    pixels = loaded.pipe.image_processor.preprocess(Image.fromarray(image), height=48, width=80)
    with torch.no_grad():
        posterior = loaded.pipe.vae.encode(pixels).latent_dist
    assert cached.dtype == np.float32 and cached.shape == (16, 1, 6, 10)
    same(cached, posterior.mode()[:, :, None][0] * loaded.pipe.vae.config.scaling_factor)


# -- (c) transformer ---------------------------------------------------------------------------------------
def pipeline_inputs(loaded: Loaded, image: np.ndarray, seed: int = 1) -> torch.Tensor:
    """The pipeline's prepared latents: channels-last cat([noise, sampled source latent, ones]), (1, 1, h, w, 33)."""
    height, width = image.shape[:2]
    with torch.no_grad():
        return loaded.pipe.prepare_latents(Image.fromarray(image), 1, 16, height, width, torch.float32, "cpu",
                                           torch.Generator().manual_seed(seed))


def family_text(loaded: Loaded, prompt: str, image: np.ndarray, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """collate_text of the family's row, plus the source latent as the latent rows carry it (B, 16, 1, h, w)."""
    text = loaded.family.collate_text(loaded.family.encode_text(loaded.text, [prompt], images=[image]), "cpu")
    return text | {"image_latent": latents[..., 16:32].permute(0, 4, 1, 2, 3)}


def test_velocity_equals_pipeline_denoiser_call(loaded: Loaded) -> None:
    pipe, prompt, image = loaded.pipe, PROMPTS[0], source(4, 48, 80)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=3.0)
    scheduler.set_timesteps(4)  # as __call__ sets it (K5I2I:716)
    sigma, t = scheduler.sigmas[1], scheduler.timesteps[1]
    latents = pipeline_inputs(loaded, image)
    qwen, clip, cu_seqlens = reference_text(loaded, prompt, image)
    _, _, height, width, _ = latents.shape
    with torch.no_grad():
        ref = pipe.transformer(  # K5I2I:773-783
            hidden_states=latents, encoder_hidden_states=qwen, pooled_projections=clip, timestep=t.unsqueeze(0),
            visual_rope_pos=[torch.arange(1), torch.arange(height // 2), torch.arange(width // 2)],
            text_rope_pos=torch.arange(cu_seqlens.diff().max().item()), scale_factor=[1.0, 1.0, 1.0],
            sparse_params=None, return_dict=True,
        ).sample.permute(0, 4, 1, 2, 3)
        noisy = latents[..., :16].permute(0, 4, 1, 2, 3)  # (1, 16, 1, h, w)
        mine = loaded.family.velocity(pipe.transformer, noisy, sigma[None], family_text(loaded, prompt, image, latents))
    assert mine.shape == noisy.shape == (1, 16, 1, 6, 10) and mine.dtype == torch.float32
    same(mine, ref)


def test_velocity_refuses_the_wrong_checkpoint_or_a_missing_source(loaded: Loaded) -> None:
    image = source(0)
    latents = pipeline_inputs(loaded, image)
    noisy, text = latents[..., :16].permute(0, 4, 1, 2, 3), family_text(loaded, PROMPTS[0], image, latents)
    with pytest.raises(ValueError, match="visual_cond=False"):  # a t2i transformer under the i2i flavour
        loaded.family.velocity(kandinsky5_transformer(visual_cond=False), noisy, torch.tensor([0.5]), text)
    with pytest.raises(ValueError, match="visual_cond=True"):  # and the i2i transformer under t2i
        kandinsky5_image.make_family(None).velocity(loaded.pipe.transformer, noisy, torch.tensor([0.5]), text)
    without = {k: v for k, v in text.items() if k != "image_latent"}
    with pytest.raises(KeyError, match="image_latent"):
        loaded.family.velocity(loaded.pipe.transformer, noisy, torch.tensor([0.5]), without)


def randomised_lora(loaded: Loaded, rank: int = 4, alpha: float = 16) -> torch.nn.Module:
    transformer = load_component(loaded.path, "transformer")
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=loaded.family.lora_targets(True)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return transformer


def test_lora_learns_and_the_source_latent_matters(loaded: Loaded) -> None:
    image = source(0)
    latents = pipeline_inputs(loaded, image)
    noisy, text = latents[..., :16].permute(0, 4, 1, 2, 3), family_text(loaded, PROMPTS[0], image, latents)
    transformer = load_component(loaded.path, "transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=loaded.family.lora_targets(True)))
    transformer.train()
    prediction = loaded.family.velocity(transformer, noisy, torch.tensor([0.6]), text)
    prediction.square().mean().backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if "lora_B" in n}
    assert len(grads) == 26  # with the FFNs: 1 text block x (4 + 2), 2 visual blocks x (8 + 2)
    silent = sorted(n for n, g in grads.items() if g is None or not g.abs().sum() > 0)
    assert not silent, f"LoRA B weights without gradient: {silent}"
    with torch.no_grad():
        blind = loaded.family.velocity(transformer, noisy, torch.tensor([0.6]),
                                       text | {"image_latent": torch.zeros_like(text["image_latent"])})
    assert (prediction.detach() - blind).abs().max() > 1e-3, "the source latent must change the prediction"


# -- (d) render --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    height: int = 48
    width: int = 80
    num_frames: int = 1
    num_inference_steps: int = 2
    guidance: float = 3.0
    seed: int = 0
    flow_shift: float = 3.0


def test_render_from_rows_equals_pipeline_from_prompt(loaded: Loaded, tmp_path: Path) -> None:
    """Rows encoded with the source image, no text encoders: at lora_scale 0 the base pipeline given the prompt
    strings, the same image and seed; the saved LoRA loads into the renderer with its alpha."""
    family, settings, image = loaded.family, Settings(), source(5, 48, 80)
    prompt, negative = PROMPTS[0], family.default_negative_prompt
    trained = randomised_lora(loaded)
    family.save_lora(get_peft_model_state_dict(trained), tmp_path, adapter_config(trained))
    renderer = family.load_renderer(str(loaded.path), str(tmp_path / "pytorch_lora_weights.safetensors"), "cpu")
    assert isinstance(renderer, Kandinsky5I2IPipeline) and renderer.text_encoder is None
    latents = pipeline_inputs(loaded, image)
    text = family_text(loaded, prompt, image, latents)
    noisy = latents[..., :16].permute(0, 4, 1, 2, 3)
    with torch.no_grad():  # alpha 16 / rank 4 survived the file: the renderer's LoRA is the trained one
        same(family.velocity(renderer.transformer, noisy, torch.tensor([0.6]), text),
             family.velocity(trained, noisy, torch.tensor([0.6]), text))

    rows = family.encode_text(loaded.text, [prompt, negative], images=[image, image])
    base = family.render(renderer, *rows, settings, lora_scale=0.0, image=image)
    tuned = family.render(renderer, *rows, settings, lora_scale=1.0, image=image)
    assert base.dtype == np.uint8 and base.shape == (1, 48, 80, 3)
    assert np.abs(base.astype(int) - tuned).max() > 0, "the LoRA should change the render"

    pipe = loaded.pipe
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
    pipe.resolutions = [(settings.width, settings.height)]  # it would snap to a 1024 px size
    out = pipe(image=Image.fromarray(image), prompt=prompt, negative_prompt=negative, height=settings.height,
               width=settings.width, num_inference_steps=settings.num_inference_steps,
               guidance_scale=settings.guidance, generator=torch.Generator().manual_seed(settings.seed),
               output_type="np").image
    # bit for bit: the rows equal encode_prompt's embeddings, and LoRA scale 0 adds exact zeros
    np.testing.assert_array_equal(base, (np.clip(out, 0, 1) * 255).round().astype(np.uint8))


def test_render_needs_the_source_image_at_the_render_size(loaded: Loaded) -> None:
    family, settings = loaded.family, Settings()
    rows = family.encode_text(loaded.text, ["", ""], images=[source(0)] * 2)
    with pytest.raises(ValueError, match="pass `image`"):
        family.render(None, *rows, settings)
    with pytest.raises(ValueError, match=r"uint8 \(48, 80, 3\)"):
        family.render(None, *rows, settings, image=source(0, 80, 48))
    with pytest.raises(ValueError, match="text-to-image"):
        kandinsky5_image.make_family(None).render(None, *rows, settings, image=source(0, 48, 80))
