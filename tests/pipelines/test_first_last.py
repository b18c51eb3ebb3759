"""Kandinsky 5 i2v with the first and the last frame (`i2v_mode: first_last`, musubi-tuner's `--i2v_mode`) on the
tiny real model: one run through the whole DAG (clips, latents, text_embeds, lora, validation), then what it left:
the latent cache, the training input and loss, and the renderer given both frames."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dagster import DagsterInstance
from diffusers.utils.torch_utils import randn_tensor

from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.config import load_config
from loraflow.contracts.renders import conditioning_clip, conditioning_image, render_settings
from loraflow.kernels.flow_matching import flow_mse, noisy_sample
from loraflow.pipelines import get_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
from tests.factory import demo_dict, write_config

I2V = "i2v-lite-5s"


@pytest.fixture(scope="module")
def run(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """One clip of the demo, 2 training steps, 2 render steps at 17 frames (the least K5 i2v renders)."""
    root = tmp_path_factory.mktemp("first-last")
    data = root / "data"
    data.mkdir()
    for ext in (".mp4", ".txt"):
        shutil.copy(demo_data / f"clip_00{ext}", data / f"clip_00{ext}")
    path = write_config(root / "config.yaml", demo_dict(
        tiny_k5, data, root, model_flavour=I2V, i2v_mode="first_last", max_train_steps=2, checkpointing_steps=100,
        validation_num_video_frames=17, validation_num_inference_steps=2))
    results = materialize_everything(LoraflowResource(config_path=str(path)), DagsterInstance.ephemeral())
    assert all(r.success for r in results)
    return load_config(path)


def test_first_last_runs_the_dag_and_caches_the_last_frame_encoded_alone(run) -> None:
    """The latent's first and last frames are those frames encoded alone (what validation gives the pipeline);
    the key is not an `i2v_mode: first` key, so a cache built without the last frame is encoded again."""
    store, family = Store(run.cache_dir, run.manifest_names), get_family(run)
    first = get_family(run.model_copy(update={"i2v_mode": "first"}))
    vae = load_component(run.pretrained_model_name_or_path, "vae")
    from loraflow.stages.latents.latents import latent_rows

    (row,) = store.read_manifest("latents")
    assert row["key"] not in {r.key for r in latent_rows(run.model_copy(update={"i2v_mode": "first"}), first,
                                                      model_source(run), store)}
    latent = np.array(store.get("latents", [row["key"]])[row["key"]]["latent"])
    frames = torch.from_numpy(np.array(store.get("clips", [row["clip_key"]])[row["clip_key"]]["frames"]))[None]
    with torch.no_grad():
        alone = [family.vae_encode(vae, frames[:, i]).numpy()[0] for i in (slice(0, 1), slice(-1, None))]
    np.testing.assert_array_equal(latent[:, :1], alone[0])
    np.testing.assert_array_equal(latent[:, -1:], alone[1])
    assert first.flavour.last_frame_given is False and family.flavour.last_frame_given


def test_first_last_gives_both_end_frames_clean_and_trains_the_others(run) -> None:
    family = get_family(run)
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 2, 16, 4, 4, 2, generator=generator)
    given, last = family.flavour.conditioning_frames, family.flavour.last_frame_given
    x_t = noisy_sample(x0, noise, torch.tensor([0.5, 0.9]), given, last)
    assert torch.equal(x_t[:, :, [0, -1]], x0[:, :, [0, -1]])
    assert not torch.equal(x_t[:, :, 1:-1], x0[:, :, 1:-1])
    prediction = torch.randn(x0.shape, generator=generator)
    expected = ((prediction - (noise - x0))[:, :, 1:-1] ** 2).mean()
    assert torch.equal(flow_mse(prediction, x0, noise, given, last), expected)
    # the transformer's mask channel marks both: run it and read its input
    transformer = load_component(run.pretrained_model_name_or_path, "transformer")
    masks: list[torch.Tensor] = []
    transformer.register_forward_pre_hook(lambda _m, _a, kw: masks.append(kw["hidden_states"][..., -1]),
                                          with_kwargs=True)
    text = {"text_embeds": torch.zeros(1, 3, transformer.config.in_text_dim),
            "pooled_embeds": torch.zeros(1, transformer.config.in_text_dim2),
            "text_mask": torch.ones(1, 3, dtype=torch.bool)}
    with torch.no_grad():
        family.velocity(transformer, x_t[:1], torch.tensor([0.5]), text)
    assert masks[0][0, :, 0, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_the_renderer_keeps_the_last_frame_and_first_renders_as_before(run) -> None:
    """Every transformer call sees the last latent frame clean (the last image's latent, drawn from the render seed
    after the noise and the first frame, as the pipeline draws the first frame's) and marked; the decoded latent's
    last frame is it. `i2v_mode: first` renders bit for bit as the pipeline called as before this mode existed."""
    store, family = Store(run.cache_dir, run.manifest_names), get_family(run)
    settings = render_settings(run, family, model_source(run), store)
    images = conditioning_image(store, conditioning_clip(run, family, store), settings, last=True)
    texts = {r["text"]: r["key"] for r in store.read_manifest("text_embeds")}
    rows = store.get("text_embeds", [texts[run.validation_prompt], texts[family.default_negative_prompt]])
    prompt, negative = rows[texts[run.validation_prompt]], rows[texts[family.default_negative_prompt]]
    pipe = family.load_renderer(run.pretrained_model_name_or_path, None, torch.device("cpu"))
    seen, decoded = [], []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"][:, -1].clone()), with_kwargs=True)
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, **kw: decoded.append(z.clone()) or decode(z, **kw)
    family.render(pipe, prompt, negative, settings, lora_scale=0.0, image=images[0], last_image=images[1])

    generator = torch.Generator().manual_seed(settings.seed)
    h, w = settings.height // 8, settings.width // 8
    randn_tensor((1, 5, h, w, 16), generator=generator)  # the noise, then the first frame, then the last
    pixels = [torch.from_numpy(i).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0 for i in images]
    with torch.no_grad():
        _, last = (pipe.vae.encode(p).latent_dist.sample(generator=generator) * pipe.vae.config.scaling_factor
                   for p in pixels)
    last = last[:, :, 0].permute(0, 2, 3, 1)  # (1, h, w, 16)
    assert len(seen) == 2 * settings.num_inference_steps  # conditional + unconditional per step
    for frame in seen:
        assert torch.equal(frame[..., :16], last) and torch.all(frame[..., 32] == 1)
    # the pipeline decodes latent / scaling_factor, (B, C, T, h, w)
    (z,) = decoded
    assert torch.equal(z[:, :, -1] * pipe.vae.config.scaling_factor, last.permute(0, 3, 1, 2))

    before = get_family(run.model_copy(update={"i2v_mode": "first"}))
    from diffusers import FlowMatchEulerDiscreteScheduler
    from PIL import Image

    ours = before.render(pipe, prompt, negative, settings, lora_scale=0.0, image=images[0])
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
    plain = pipe(image=Image.fromarray(images[0]), **before.prompt_embeds(prompt, negative, pipe.device),
                 height=settings.height, width=settings.width, num_frames=settings.num_frames,
                 num_inference_steps=settings.num_inference_steps, guidance_scale=settings.guidance,
                 generator=torch.Generator().manual_seed(settings.seed), output_type="np").frames[0]
    np.testing.assert_array_equal(ours, (np.clip(plain, 0, 1) * 255).round().astype(np.uint8))


def test_first_last_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    from pydantic import ValidationError

    for flavour, frames, says in (("t2v-lite-sft-5s", 17, "takes no clean first frame"),
                                  (I2V, 5, "set `video.num_frames` to 9")):
        config = demo_dict(tmp_path / "m", tmp_path / "d", tmp_path, model_flavour=flavour, i2v_mode="first_last")
        config["datasets"][0]["video"].update(num_frames=frames, min_frames=frames)
        with pytest.raises((ValueError, ValidationError), match=says):
            load_config(write_config(tmp_path / "config.yaml", config))


def test_the_importer_takes_musubi_tuners_option_name() -> None:
    from loraflow.simpletuner import import_simpletuner

    imported = import_simpletuner({"--i2v_mode": "first_last", "model_family": "kandinsky5-video",
                                   "model_flavour": "k5-lite-i2v-5s-sd"}, [])
    assert (imported.config["i2v_mode"], imported.config["model_flavour"]) == ("first_last", I2V)
    assert not imported.unmapped
