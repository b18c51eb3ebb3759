"""Kandinsky 5 Video i2v on the tiny real model: training input and loss, eval loss, and validation renders.

The caches are the two-clip dataset of tests/factory.py `build_caches` (17-frame clips: 5 latent frames, the least
Kandinsky5I2VPipeline renders without NaN). i2v reads the same caches as t2v; only the flavour differs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor

from loraflow.contracts.renders import conditioning_clip
from loraflow.contracts.text_set import text_lookup
from loraflow.pipelines import family_spec, get_family
from loraflow.pipelines.base import load_component, load_lora_file
from loraflow.pipelines.kandinsky5.video.family import make_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
from loraflow.training import batches as D
from loraflow.training import loop as T
from loraflow.validation.evaluation import EVAL_SIGMAS, EvalItem, eval_losses, noise_seed
from loraflow.validation.validate import conditioning_image, render_settings, validate
from tests.factory import cache_for, make_config, reference_lora, run_clips
from tests.numerics import assert_float64_close

I2V = "i2v-lite-5s"


@pytest.fixture(scope="module")
def trained(own_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("i2v-run")
    shutil.copytree(own_caches["root"] / "cache", root / "cache")  # its i2v lists beside the t2v ones, in a copy
    config = make_config(own_caches, root / "out", model_flavour=I2V, validation_num_video_frames=17,
                         cache_dir=str(root / "cache"))
    return config, T.train_lora(config, get_family(config), model_source(config), cache_for(config))


def test_every_k5_i2v_flavour_gives_one_clean_frame_and_t2v_none() -> None:
    flavours = family_spec("kandinsky5-video").flavours
    assert {f.name for f in flavours if f.task == "i2v"} == {"i2v-lite-5s", "i2v-pro-sft-5s", "i2v-pro-sft-5s-sd",
                                                            "i2v-pro-pretrain-5s", "i2v-pro-distilled-5s"}
    for flavour in flavours:
        assert make_family(flavour.name).flavour.conditioning_frames == (1 if flavour.task == "i2v" else 0)


def test_first_latent_frame_equals_the_first_frame_alone_only_for_a_static_clip(tiny_k5: Path) -> None:
    """Why the latents stage encodes frame 0 alone for i2v: the VAE's convolutions and attention are causal, its
    GroupNorms are not (statistics over every frame), so a clip's latent frame 0 is not the image's latent.

    A static clip's frame 0 equals the image's as math, not as float sums (its GroupNorm statistics add 17 times as
    many terms): so the VAE runs in float64, and vae_encode rounds both to float32 (tests/numerics.py)."""
    vae, family = load_component(tiny_k5, "vae").double(), make_family(I2V)
    generator = torch.Generator().manual_seed(0)
    first = (torch.rand(1, 1, 48, 64, 3, generator=generator) * 255).to(torch.uint8)
    moving = torch.cat([first, (torch.rand(1, 16, 48, 64, 3, generator=generator) * 255).to(torch.uint8)], 1)
    with torch.no_grad():
        alone = family.vae_encode(vae, first)
        static = family.vae_encode(vae, first.repeat(1, 17, 1, 1, 1))[:, :, :1]
        in_clip = family.vae_encode(vae, moving)[:, :, :1]
    assert_float64_close(static, alone, float32_roundings=2)
    assert (in_clip - alone).abs().mean() > 0.05 * alone.abs().mean()  # measured: 0.018 vs 0.089


def test_i2v_latents_hold_the_first_frame_encoded_alone(own_caches: dict[str, Path], tmp_path: Path) -> None:
    from loraflow.stages.latents.latents import encode_latents

    config = make_config(own_caches, tmp_path / "out", model_flavour=I2V, cache_dir=str(tmp_path / "cache"))
    shutil.copytree(own_caches["root"] / "cache", tmp_path / "cache")
    store, family = Store(config.cache_dir), get_family(config)  # the t2v lists: the only ones
    t2v_rows = {r["clip_key"]: r["key"] for r in store.read_manifest("latents")}
    store = run_clips(config)[1]  # the i2v flavour's clips (the t2v ones, listed again: nothing decoded)
    # new keys: i2v latents differ
    assert encode_latents(config, family, model_source(config), store).computed == len(t2v_rows)
    vae = load_component(own_caches["model"], "vae")
    for row in store.read_manifest("latents"):
        i2v, t2v = (store.get("latents", [k])[k]["latent"] for k in (row["key"], t2v_rows[row["clip_key"]]))
        frames = torch.from_numpy(np.array(store.get("clips", [row["clip_key"]])[row["clip_key"]]["frames"]))[None]
        with torch.no_grad():
            alone = family.vae_encode(vae, frames[:, :1])[0]
        # the image latent inference uses: the stage's own encode of frame 0 alone (same ops, shapes and threads)
        np.testing.assert_array_equal(i2v[:, :1], alone.numpy())
        np.testing.assert_array_equal(i2v[:, 1:], t2v[:, 1:])  # the generated frames: the whole clip's encode
        assert np.abs(i2v[:, :1] - t2v[:, :1]).max() > 1e-3


def test_two_i2v_steps_equal_a_hand_written_reference(trained, own_caches: dict[str, Path]) -> None:
    """The transformer called as Kandinsky5I2VPipeline's loop calls it: frame 0 of x_t is the clean latent, the
    mask marks frame 0, visual_cond is zero; the loss covers latent frames 1.. only. AdamW by hand. Bit for bit: the
    same ops on the same shapes as training's step, in this process (test_train.py's reference test says why)."""
    config, report = trained
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    transformer, params, optimizer = reference_lora(own_caches["model"], config)
    plan = D.BatchPlan(D.build_samples(config, store), 1, config.seed)
    for step, logged in enumerate(report.history):
        (sample,) = plan(step)
        x0 = torch.from_numpy(np.array(store.get("latents", [sample.latent_key])[sample.latent_key]["latent"]))[None]
        draws = D.step_draws(config, family, step, tuple(x0.shape))
        text = store.get("text_embeds", [sample.text_key])[sample.text_key]
        qwen, clip = (torch.from_numpy(np.array(text[k]))[None] for k in ("text_embeds", "pooled_embeds"))
        s = draws.sigma.view(-1, 1, 1, 1, 1)
        x_t = ((1 - s) * x0 + s * draws.noise).permute(0, 2, 3, 4, 1)  # (B, T, h, w, 16)
        x_t[:, 0] = x0.permute(0, 2, 3, 4, 1)[:, 0]  # the image latent replaces frame 0
        mask = torch.zeros_like(x_t[..., :1])
        mask[:, 0] = 1
        latents = torch.cat([x_t, torch.zeros_like(x_t), mask], -1)
        _, frames, h, w, _ = x_t.shape
        velocity = transformer(
            hidden_states=latents, encoder_hidden_states=qwen, pooled_projections=clip, timestep=draws.sigma * 1000,
            visual_rope_pos=[torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
            text_rope_pos=torch.arange(qwen.shape[1]),
            scale_factor=(1, 2, 2) if 480 <= h * 8 <= 854 and 480 <= w * 8 <= 854 else (1, 3.16, 3.16),
            sparse_params=None, return_dict=True,
        ).sample
        target = (draws.noise - x0).permute(0, 2, 3, 4, 1)
        loss = ((velocity[:, 1:] - target[:, 1:]) ** 2).mean()
        everywhere = ((velocity - target) ** 2).mean().item()  # what an unmasked loss would have logged
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        assert (loss.item(), norm) == (logged.loss, logged.grad_norm)
        assert abs(everywhere - logged.loss) > 1e-4


def test_i2v_eval_loss_is_the_masked_loss(trained) -> None:
    config, report = trained
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    row = store.read_manifest("latents")[0]
    text_key = text_lookup(store)["", ""]
    transformer = load_component(config.pretrained_model_name_or_path, "transformer")
    load_lora_file(transformer, report.lora_path)
    item = EvalItem(row["clip_key"], row["key"], text_key, "demo-videos/clip.mp4", (0, 1))  # any clip identity
    (losses,) = [eval_losses(transformer, family, store, [item], 3, torch.device("cpu"))]
    plain = load_component(config.pretrained_model_name_or_path, "transformer")
    x0 = torch.from_numpy(np.array(store.get("latents", [row["key"]])[row["key"]]["latent"]))[None]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(noise_seed(3, item)))
    text = family.collate_text([store.get("text_embeds", [text_key])[text_key]], torch.device("cpu"))
    j = EVAL_SIGMAS.index(0.5)
    noisy = 0.5 * x0 + 0.5 * noise
    noisy[:, :, 0] = x0[:, :, 0]
    with torch.no_grad():
        prediction = family.velocity(plain, noisy, torch.full((1,), 0.5), text)
    expected = ((prediction - (noise - x0))[:, :, 1:] ** 2).mean().item()
    # bit for bit: LoRA scale 0 adds exact zeros, and the rest is this computation (one clip: its mean is itself)
    assert losses[j].base == expected
    assert losses[j].lora != losses[j].base


def test_i2v_validation_renders_from_the_first_frame(trained, own_caches: dict[str, Path]) -> None:
    """Every denoising step sees the conditioning image's latent as frame 0 (mask 1), the one the pipeline draws
    from the render seed; t2v sees noise there. Pixels can't show it: the tiny VAE is random, so a decoded frame
    does not resemble its input. The mp4s have the configured frame count."""
    config, report = trained
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    settings = render_settings(config, family, model_source(config))
    clip_key = conditioning_clip(config, family, store)
    image = conditioning_image(store, clip_key, settings)
    assert image.shape == (settings.height, settings.width, 3)
    result = validate(config, family, model_source(config), store, report.lora_path)
    for path in (result.prompts[0].lora, result.prompts[0].base):
        with av.open(path) as container:
            assert sum(1 for _ in container.decode(video=0)) == config.validation_num_video_frames == 17
    assert (Path(result.prompts[0].lora).parents[1] / "condition.png").is_file()

    seen: dict[str, list[torch.Tensor]] = {}
    t2v = make_family("t2v-lite-sft-5s")
    texts = {r["text"]: r["key"] for r in store.read_manifest("text_embeds")}
    rows = store.get("text_embeds", [texts[config.validation_prompt], texts[family.default_negative_prompt]])
    prompt, negative = rows[texts[config.validation_prompt]], rows[texts[family.default_negative_prompt]]
    for name, fam, given in (("i2v", family, {"image": image}), ("t2v", t2v, {})):
        pipe = fam.load_renderer(config.pretrained_model_name_or_path, None, torch.device("cpu"))
        inputs = seen.setdefault(name, [])
        pipe.transformer.register_forward_pre_hook(
            lambda _m, _a, kw, inputs=inputs: inputs.append(kw["hidden_states"][:, 0].clone()), with_kwargs=True)
        video = fam.render(pipe, prompt, negative, settings, lora_scale=0.0, **given)
        assert video.shape == (17, settings.height, settings.width, 3)
    vae = load_component(config.pretrained_model_name_or_path, "vae")
    generator = torch.Generator().manual_seed(settings.seed)
    randn_tensor((1, 5, settings.height // 8, settings.width // 8, 16), generator=generator)  # the noise, first
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0
    with torch.no_grad():
        expected = vae.encode(pixels).latent_dist.sample(generator=generator)[:, :, 0].permute(0, 2, 3, 1)
        expected = expected * vae.config.scaling_factor  # (1, h, w, 16)
    assert len(seen["i2v"]) == 2 * settings.num_inference_steps  # conditional + unconditional per step
    for frame0 in seen["i2v"]:  # bit for bit: the pipeline's own encode, same pixels (x / 127.5 - 1 == 2x / 255 - 1
        # for every uint8 x), same draw, same kernels
        assert torch.equal(frame0[..., :16], expected) and torch.all(frame0[..., 32] == 1)
    for frame0 in seen["t2v"]:
        assert (frame0[..., :16] - expected).abs().mean() > 0.5 and torch.all(frame0[..., 32] == 0)


def test_the_i2v_example_config_validates() -> None:
    from loraflow.config import load_config
    from tests.factory import REPO

    config = load_config(REPO / "configs" / "kandinsky5_video_i2v.yaml")
    family = get_family(config)
    assert family.flavour.conditioning_frames == 1
    assert render_settings(config, family, model_source(config)).num_frames >= 17


def test_validation_using_datasets_renders_from_an_image_of_the_eval_dataset(tiny_k5: Path, tmp_path: Path) -> None:
    """The seeds' i2v setup: videos to train on, an image dataset (`eval_dataset_id`) to render validation from.
    Its images are kept (not quarantined as `single_image`), the first by name is the render's first frame, and
    eval loss leaves them out (an image has no frame after the first to score)."""
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.validation.evaluation import eval_items
    from tests.factory import clips_config, run_clips, videos
    from tests.media_factory import read_index, write_image

    videos(tmp_path / "videos", 2, num_frames=18)
    stills = tmp_path / "stills"
    stills.mkdir()
    for name, index in (("b", 9), ("a", 4)):
        write_image(stills / f"{name}.png", width=96, height=64, index=index)
        (stills / f"{name}.txt").write_text(f"still {name}", encoding="utf-8")
    datasets = [{"instance_data_dir": str(tmp_path / "videos"), "video": {"num_frames": 17}},
                {"instance_data_dir": str(stills), "dataset_type": "image"}]
    config = clips_config(tiny_k5, tmp_path, datasets, model_flavour=I2V, eval_dataset_id="d1",
                          validation_using_datasets=True, validation_prompt="a still moves",
                          validation_resolution="96x64",
                          validation_num_video_frames=17)
    report, store = run_clips(config)
    assert report.quarantined == ()
    family = get_family(config)
    encode_latents(config, family, model_source(config), store)
    encode_texts(config, family, model_source(config), store)
    clip_key = conditioning_clip(config, family, store)
    clip = next(c for c in store.read_manifest("clips") if c["key"] == clip_key)
    assert Path(clip["source"]).name == "a.png"
    assert read_index(conditioning_image(store, clip_key, render_settings(config, family, model_source(config)))) == 4
    assert eval_items(config, family, store) == []  # the held-out clips are images: nothing to score
