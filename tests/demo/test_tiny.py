"""Tiny checkpoints must load through the real diffusers/transformers classes and actually run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    Kandinsky5I2IPipeline,
    Kandinsky5T2IPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from peft import LoraConfig
from PIL import Image
from safetensors.torch import load_file
from transformers import Qwen2VLProcessor, SiglipImageProcessorPil, SiglipVisionModel

from loraflow.demo.tiny import RECIPE_KEY, build_tiny

# max_sequence_length=1024: the byte-level tokenizer spends ~630 tokens on the K5 template, so the
# default 512 (+ the pipeline's hard-coded crop of 128) would truncate the prompt away.
K5_MAX_SEQ = 1024
K5_LORA_TARGETS = [
    f"{attn}.{layer}"
    for attn in ("self_attention", "cross_attention")
    for layer in ("to_query", "to_key", "to_value", "out_layer")
]
# The REFERENCE target list; these suffixes also match the token-refiner blocks.
HV15_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]


@pytest.fixture(scope="module")
def k5_video_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("kandinsky5-video", tmp_path_factory.mktemp("tiny") / "k5v")


@pytest.fixture(scope="module")
def hv15_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("tiny") / "hv15")


def test_unknown_family_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny("sdxl", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_build_is_idempotent_and_leaves_no_staging(k5_video_dir: Path) -> None:
    index = k5_video_dir / "model_index.json"
    before = index.stat().st_mtime_ns
    assert build_tiny("kandinsky5-video", k5_video_dir) == k5_video_dir
    assert index.stat().st_mtime_ns == before
    assert [p.name for p in k5_video_dir.parent.iterdir()] == [k5_video_dir.name]


def test_a_folder_built_by_another_recipe_is_refused_not_reused(k5_video_dir: Path, tmp_path: Path) -> None:
    """Seen failing when any folder holding the right pipeline class was reused: `world=True` over an old random
    checkpoint silently kept the random one."""
    index = (k5_video_dir / "model_index.json").read_text()
    random = "kandinsky5-video t2v v1"
    with pytest.raises(ValueError, match=rf"was built by {random} \(seed 0\), but this build is "
                                         r"kandinsky5-video world v1 \(seed 0\): delete"):
        build_tiny("kandinsky5-video", k5_video_dir, world=True)
    with pytest.raises(ValueError, match=rf"\(seed 0\), but this build is {random} \(seed 1\)"):
        build_tiny("kandinsky5-video", k5_video_dir, seed=1)
    assert (k5_video_dir / "model_index.json").read_text() == index  # refused: nothing rebuilt, nothing reused
    older = shutil.copytree(k5_video_dir, tmp_path / "older")  # a folder built before the mark existed
    unmarked = {k: v for k, v in json.loads(index).items() if k != RECIPE_KEY}
    (older / "model_index.json").write_text(json.dumps(unmarked))
    with pytest.raises(ValueError, match="has no build_tiny recipe in its model_index.json"):
        build_tiny("kandinsky5-video", older)
    # the builder's name is words (moving its module keeps the folder); its version is what makes a folder stale
    (older / "model_index.json").write_text(json.dumps({**unmarked, RECIPE_KEY: {"builder": "kandinsky5-video t2v v0",
                                                                                 "seed": 0}}))
    with pytest.raises(ValueError,
                       match=rf"was built by kandinsky5-video t2v v0 \(seed 0\), but this build is {random}"):
        build_tiny("kandinsky5-video", older)


def test_same_seed_same_weights(tmp_path: Path, k5_video_dir: Path) -> None:
    other = build_tiny("kandinsky5-video", tmp_path / "again", seed=0)
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(k5_video_dir / name), load_file(other / name)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_k5_video_components_load_from_subfolders(k5_video_dir: Path) -> None:
    transformer = Kandinsky5Transformer3DModel.from_pretrained(k5_video_dir, subfolder="transformer")
    vae = AutoencoderKLHunyuanVideo.from_pretrained(k5_video_dir, subfolder="vae")
    assert transformer.config.visual_cond and transformer.config.in_visual_dim == 16
    assert transformer.dtype == torch.float32
    assert (vae.config.latent_channels, vae.config.spatial_compression_ratio) == (16, 8)
    assert vae.config.temporal_compression_ratio == 4
    # The zero-initialised modulation must have been re-randomised and survive the round trip.
    modulation = [p for n, p in transformer.named_parameters() if "modulation" in n]
    assert modulation and all(p.abs().sum() > 0 for p in modulation)


def test_k5_video_pipeline_generates(k5_video_dir: Path) -> None:
    pipe = Kandinsky5T2VPipeline.from_pretrained(k5_video_dir)
    pipe.set_progress_bar_config(disable=True)
    video = pipe(
        prompt="a cat walks on the grass",
        height=32,
        width=32,
        num_frames=17,
        num_inference_steps=2,
        guidance_scale=2.0,  # exercises the negative-prompt branch too
        max_sequence_length=K5_MAX_SEQ,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    assert video.shape == (1, 17, 32, 32, 3)
    assert np.isfinite(video).all()


def _k5_training_step(transformer: Kandinsky5Transformer3DModel) -> None:
    """One flow-matching step with the transformer called exactly as the pipeline calls it."""
    gen = torch.Generator().manual_seed(0)
    frames, height, width, channels, text_len = 5, 4, 4, 16, 7
    x0 = torch.randn(1, frames, height, width, channels, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.tensor([0.7])
    x_t = (1 - sigma) * x0 + sigma * noise
    # visual_cond=True: [x_t, conditioning latents, mask], zeros for text-to-video.
    hidden_states = torch.cat([x_t, torch.zeros_like(x_t), torch.zeros_like(x_t[..., :1])], dim=-1)
    pred = transformer(
        hidden_states=hidden_states,
        encoder_hidden_states=torch.randn(1, text_len, transformer.config.in_text_dim, generator=gen),
        pooled_projections=torch.randn(1, transformer.config.in_text_dim2, generator=gen),
        timestep=sigma * 1000,
        visual_rope_pos=[torch.arange(frames), torch.arange(height // 2), torch.arange(width // 2)],
        text_rope_pos=torch.arange(text_len),
        scale_factor=(1, 2, 2),
        sparse_params=None,
        return_dict=False,
    )
    assert pred.shape == x0.shape
    torch.nn.functional.mse_loss(pred, noise - x0).backward()


def test_k5_video_lora_gradients_are_nonzero(k5_video_dir: Path) -> None:
    transformer = Kandinsky5Transformer3DModel.from_pretrained(k5_video_dir, subfolder="transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=K5_LORA_TARGETS))
    transformer.train()
    _k5_training_step(transformer)
    lora_b = {n: p for n, p in transformer.named_parameters() if "lora_B" in n}
    # 1 text block x 4 + 2 visual blocks x 8 adapted linears.
    assert len(lora_b) == 20
    zero = [n for n, p in lora_b.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not zero, f"LoRA B weights without gradient: {zero}"
    assert not any(p.requires_grad for n, p in transformer.named_parameters() if "lora_" not in n)


def test_k5_image_pipeline_generates(tmp_path: Path) -> None:
    pipe = Kandinsky5T2IPipeline.from_pretrained(build_tiny("kandinsky5-image", tmp_path / "k5i"))
    pipe.set_progress_bar_config(disable=True)
    assert not pipe.transformer.config.visual_cond  # T2I feeds plain 16-channel latents
    assert pipe.vae.config.latent_channels == 16
    # The pipeline snaps any size to its list (>= 1024 px); widen the list to keep the test small.
    pipe.resolutions = [(64, 64)]
    image = pipe(
        prompt="a red cube",
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=2.0,
        max_sequence_length=K5_MAX_SEQ,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).image
    assert image.shape == (1, 64, 64, 3)
    assert np.isfinite(image).all()


def test_k5_i2i_checkpoint_is_its_own_and_refuses_a_reuse_for_t2i(tmp_path: Path) -> None:
    path = build_tiny("kandinsky5-image", tmp_path / "k5i2i", flavour="i2i-lite-pretrain")
    pipe = Kandinsky5I2IPipeline.from_pretrained(path)
    assert pipe.transformer.config.visual_cond  # 16 noisy + 16 source + 1 ones channels
    assert isinstance(pipe.tokenizer, Qwen2VLProcessor)
    assert pipe.tokenizer.image_token_id == pipe.text_encoder.config.image_token_id
    assert build_tiny("kandinsky5-image", path, flavour="i2i-lite-sft") == path  # idempotent
    with pytest.raises(ValueError, match="Kandinsky5T2IPipeline"):  # a t2i run must not pick up the i2i folder
        build_tiny("kandinsky5-image", path, flavour="t2i-lite-sft")
    with pytest.raises(ValueError, match="unknown flavour"):
        build_tiny("kandinsky5-image", tmp_path / "other", flavour="i2v-lite-5s")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(("size", "tokens"), [((32, 32), 4), ((128, 128), 4), ((64, 96), 6), ((256, 256), 16),
                                              ((1024, 1024), 16)])
def test_k5_i2i_vision_tower_takes_the_processor_output(tmp_path: Path, size: tuple[int, int], tokens: int) -> None:
    """(H, W) source -> the pipeline's half-size image -> `tokens` vision tokens (56^2..112^2 px), which the tiny
    Qwen2.5-VL's vision tower encodes; another image changes the hidden states from the image on."""
    from loraflow.pipelines.tiny_parts import qwen_tokenizer, qwen_vl_encoder, qwen_vl_processor

    tokenizer = qwen_tokenizer()
    processor, encoder = qwen_vl_processor(tokenizer), qwen_vl_encoder(tokenizer)
    hidden = []
    for seed in (0, 1):
        pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).resize((size[1] // 2, size[0] // 2))
        inputs = processor(text=["a<|vision_start|><|image_pad|><|vision_end|>"], images=[image], videos=None,
                           return_tensors="pt")
        assert int((inputs["input_ids"] == encoder.config.image_token_id).sum()) == tokens
        with torch.no_grad():
            hidden.append(encoder(**inputs, output_hidden_states=True).hidden_states[-1][0])
    assert torch.isfinite(hidden[0]).all() and torch.equal(hidden[0][:2], hidden[1][:2])  # "a", <|vision_start|>
    assert (hidden[0][2:] - hidden[1][2:]).abs().amax(-1).min() > 1e-2


def test_k5_i2i_pipeline_generates(tmp_path: Path) -> None:
    path = build_tiny("kandinsky5-image", tmp_path / "k5i2i", flavour="i2i-lite-sft")
    pipe = Kandinsky5I2IPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.resolutions = [(64, 48)]
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    image = pipe(
        image=source,
        prompt="make it red",
        height=48,
        width=64,
        num_inference_steps=2,
        guidance_scale=2.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).image
    assert image.shape == (1, 48, 64, 3)
    assert np.isfinite(image).all()


def test_hv15_components(hv15_dir: Path) -> None:
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(hv15_dir, subfolder="vae")
    assert (vae.config.latent_channels, vae.config.spatial_compression_ratio) == (32, 16)
    assert vae.config.temporal_compression_ratio == 4
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(hv15_dir, subfolder="transformer")
    assert transformer.config.in_channels == 2 * 32 + 1


def test_hv15_t2v_pipeline_generates(hv15_dir: Path) -> None:
    pipe = HunyuanVideo15Pipeline.from_pretrained(hv15_dir)
    pipe.set_progress_bar_config(disable=True)
    video = pipe(
        prompt='a sign that says "hello"',  # quoted text exercises the ByT5 branch
        height=32,
        width=32,
        num_frames=17,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    assert video.shape == (1, 17, 32, 32, 3)
    assert np.isfinite(video).all()


def test_hv15_i2v_pipeline_generates(hv15_dir: Path) -> None:
    # model_index.json lists image_encoder and feature_extractor: the folder alone loads the i2v pipeline
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(hv15_dir)
    assert isinstance(pipe.image_encoder, SiglipVisionModel)
    assert isinstance(pipe.feature_extractor, SiglipImageProcessorPil)
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8))
    embeds = pipe.encode_image(image, batch_size=1, device=torch.device("cpu"), dtype=torch.float32)
    assert embeds.shape == (1, 729, pipe.transformer.config.image_embed_dim)
    video = pipe(
        image=image,
        prompt="a cat",
        num_frames=17,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    # Size comes from transformer.config.target_size (64 px) and the image's aspect ratio.
    assert video.shape == (1, 17, 64, 64, 3)
    assert np.isfinite(video).all()


def test_hv15_lora_gradients_are_nonzero(hv15_dir: Path) -> None:
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(hv15_dir, subfolder="transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=HV15_LORA_TARGETS))
    transformer.train()
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 32, 5, 2, 2, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.tensor([0.7])
    x_t = (1 - sigma) * x0 + sigma * noise
    mask, mask_2 = torch.zeros(1, 12), torch.zeros(1, 6)
    mask[:, :9], mask_2[:, :3] = 1, 1
    pred = transformer(
        hidden_states=torch.cat([x_t, torch.zeros_like(x_t), torch.zeros_like(x_t[:, :1])], dim=1),
        timestep=sigma * 1000,
        encoder_hidden_states=torch.randn(1, 12, transformer.config.text_embed_dim, generator=gen),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(1, 6, transformer.config.text_embed_2_dim, generator=gen),
        encoder_attention_mask_2=mask_2,
        image_embeds=torch.zeros(1, 729, transformer.config.image_embed_dim),
        return_dict=False,
    )[0]
    torch.nn.functional.mse_loss(pred, noise - x0).backward()
    last = f"transformer_blocks.{transformer.config.num_layers - 1}."
    # The last block's text-stream output is discarded, so its context-only layers get no gradient.
    dead = ("attn.add_q_proj", "attn.to_add_out", "ff_context.")
    live = {
        n: p
        for n, p in transformer.named_parameters()
        if "lora_B" in n and not (n.startswith(last) and any(d in n for d in dead))
    }
    zero = [n for n, p in live.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not zero, f"LoRA B weights without gradient: {zero}"
