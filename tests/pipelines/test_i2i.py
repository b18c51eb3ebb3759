"""Kandinsky 5 Image i2i on the tiny real model, stage by stage: source images paired with their targets, the
source latent beside each target latent, prompt embeddings that see the source image, training input and loss,
and validation renders from a source image.

Data: `make_demo_edits` (four 64-96 px PNG edit pairs, captions such as "make the circle green").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dagster import DagsterInstance
from PIL import Image

from loraflow.config import LoraflowConfig, parse_config
from loraflow.contracts.renders import condition_frame
from loraflow.contracts.text_set import text_lookup
from loraflow.demo.dataset import make_demo_edits
from loraflow.pipelines import get_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.text.text_embeds import encode_texts, load_encoders
from loraflow.store import Store
from loraflow.training import batches as D
from loraflow.training import loop as T
from loraflow.validation.validate import RESULTS, validate
from tests.factory import reference_lora

I2I = "i2i-lite-sft"


def i2i_config(root: Path, model: Path, data: tuple[Path, Path], **overrides: Any) -> LoraflowConfig:
    targets, sources = data
    config = {
        "model_family": "kandinsky5-image", "model_flavour": I2I, "pretrained_model_name_or_path": str(model),
        "output_dir": str(root / "output"), "cache_dir": str(root / "cache"),
        "datasets": [
            {"id": "edits", "dataset_type": "image", "instance_data_dir": str(targets), "conditioning_data": "sources",
             "resolution": 64, "video": {"num_frames": 1}},
            {"id": "sources", "dataset_type": "conditioning", "instance_data_dir": str(sources)},
        ],
        "lora_rank": 4, "learning_rate": 1e-3, "max_train_steps": 2, "checkpointing_steps": 100, "seed": 42,
        "validation_prompt": "make the shape pink", "validation_resolution": "64x64",
        "validation_num_inference_steps": 2,
    }
    return parse_config({**config, **overrides})


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoraflowConfig, Path]:
    """clips, latents and text_embeds of the edit pairs, plus one target whose source image is missing."""
    from loraflow.demo.tiny import build_tiny

    root = tmp_path_factory.mktemp("i2i")
    model = build_tiny("kandinsky5-image", root / "model", flavour=I2I)
    targets, sources = make_demo_edits(root / "data" / "targets", root / "data" / "sources")
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(targets / "orphan.png")
    (targets / "orphan.txt").write_text("make it grey")
    config = i2i_config(root, model, (targets, sources))
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    assert build_clips(config, family, model_source(config), store).quarantined[0].reason == "missing_source_image"
    encode_latents(config, family, model_source(config), store)
    encode_texts(config, family, model_source(config), store)
    return config, sources


def test_each_target_clip_stores_its_source_image_cut_to_the_target_bucket(cached) -> None:
    config, sources = cached
    store = Store(config.cache_dir, config.manifest_names)
    clips = store.read_manifest("clips")
    assert sorted(Path(c["path"]).stem for c in clips) == ["edit_00", "edit_01", "edit_02", "edit_03"]  # not orphan
    for clip in clips:
        source = np.asarray(Image.open(sources / f"{Path(clip['path']).stem}.png").convert("RGB"))
        target = store.get("clips", [clip["key"]])[clip["key"]]["frames"][0]
        np.testing.assert_array_equal(condition_frame(store, clip["key"]), source)  # same size: nothing cut
        assert np.abs(np.asarray(target, np.int16) - source).max() > 50  # the edit recoloured the shape


def test_the_clips_preview_shows_each_source_image_below_its_target(cached) -> None:
    from loraflow.contracts.clip_rows import stored_clips
    from loraflow.media.previews import PREVIEW_CLIPS, THUMB, clip_preview

    config, sources = cached
    store = Store(config.cache_dir, config.manifest_names)
    preview = np.asarray(clip_preview(stored_clips(store, PREVIEW_CLIPS)))
    first = store.read_manifest("clips")[0]
    source = np.asarray(Image.open(sources / f"{Path(first['path']).stem}.png").convert("RGB"))
    assert preview.shape[0] == 2 * THUMB
    cell = preview[THUMB:, :THUMB]  # the first clip's source, fitted into its cell (64 px sources: not resized)
    top, left = (THUMB - source.shape[0]) // 2, (THUMB - source.shape[1]) // 2
    np.testing.assert_array_equal(cell[top : top + source.shape[0], left : left + source.shape[1]], source)


def test_the_source_latent_is_cached_beside_the_target_latent(cached) -> None:
    config, _ = cached
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    vae = load_component(config.pretrained_model_name_or_path, "vae")
    rows = store.read_manifest("latents")
    assert len(rows) == 4  # the four edit pairs (the orphan target was quarantined)
    for row in rows:
        cached_row = store.get("latents", [row["key"]])[row["key"]]
        source = np.array(condition_frame(store, row["clip_key"]))  # uint8 (H, W, 3)
        expected = family.image_condition(vae, [], {"condition_frames": [source]})["image_latent"]
        # bit for bit: the latents stage ran this same encode (same ops, shapes and threads) in this process
        np.testing.assert_array_equal(np.array(cached_row["image_latent"]), expected)
        assert np.abs(np.array(cached_row["latent"]) - expected).max() > 1e-2  # not the target's own latent


def test_prompt_embeddings_are_keyed_by_text_and_source_image(cached) -> None:
    """Each caption and the empty prompt once per source image, the validation prompts once with the render's
    image; the stored rows are what the family encodes for that text and image."""
    config, _ = cached
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    clips = store.read_manifest("clips")
    texts = text_lookup(store)
    for clip in clips:
        assert {(c, clip["condition"]) for c in [*clip["captions"], ""]} <= set(texts)
    validation = [(t, image) for t, image in texts if t == config.validation_prompt]
    assert len(validation) == 1 and validation[0][1] not in {c["condition"] for c in clips}
    components = load_encoders(config, family, model_source(config), torch.device("cpu"))
    first = clips[0]
    second = next(c for c in clips[1:] if (c["height"], c["width"]) == (first["height"], first["width"]))
    empties = []
    for clip in (first, second):  # same size: as many image tokens
        image = np.array(condition_frame(store, clip["key"]))
        (encoded,) = family.encode_text(components, [""], images=[image])
        key = texts["", clip["condition"]]
        stored = store.get("text_embeds", [key])[key]
        np.testing.assert_array_equal(np.array(stored["text_embeds"]), encoded["text_embeds"])
        empties.append(encoded["text_embeds"])
    assert np.abs(empties[0] - empties[1]).max() > 1e-4  # one empty prompt per source image, and they differ


def velocity_by_hand(transformer: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, text: dict,
                     image_latent: torch.Tensor) -> torch.Tensor:
    """Kandinsky5I2IPipeline's transformer call: channels-last cat([x_t, image latents, ones])."""
    qwen, clip = (torch.from_numpy(np.array(text[k]))[None] for k in ("text_embeds", "pooled_embeds"))
    x_t, image = x_t.permute(0, 2, 3, 4, 1), image_latent.permute(0, 2, 3, 4, 1)  # (B, 1, h, w, 16)
    _, frames, h, w, _ = x_t.shape
    out = transformer(
        hidden_states=torch.cat([x_t, image, torch.ones_like(x_t[..., :1])], -1), encoder_hidden_states=qwen,
        pooled_projections=clip, timestep=sigma * 1000,
        visual_rope_pos=[torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
        text_rope_pos=torch.arange(qwen.shape[1]), scale_factor=[1.0, 1.0, 1.0], sparse_params=None,
        return_dict=True,
    ).sample
    return out.permute(0, 4, 1, 2, 3)


def test_two_i2i_steps_equal_a_hand_written_reference(cached, tmp_path: Path) -> None:
    config, _ = cached
    config = config.model_copy(update={"output_dir": str(tmp_path / "out")})
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    report = T.train_lora(config, family, model_source(config), store)
    transformer, params, optimizer = reference_lora(Path(config.pretrained_model_name_or_path), config)
    plan = D.BatchPlan(D.build_samples(config, store), 1, config.seed)
    for step, logged in enumerate(report.history):
        (sample,) = plan(step)
        row = store.get("latents", [sample.latent_key])[sample.latent_key]
        x0, image = (torch.from_numpy(np.array(row[k]))[None] for k in ("latent", "image_latent"))
        draws = D.step_draws(config, family, step, tuple(x0.shape))
        text = store.get("text_embeds", [sample.text_key])[sample.text_key]
        s = draws.sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * draws.noise
        loss = ((velocity_by_hand(transformer, x_t, draws.sigma, text, image) - (draws.noise - x0)) ** 2).mean()
        with torch.no_grad():
            blind = velocity_by_hand(transformer, x_t, draws.sigma, text, torch.zeros_like(image))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        # bit for bit: the same ops on the same shapes as training's step
        # (tests/training/test_train.py's reference test)
        assert (loss.item(), norm) == (logged.loss, logged.grad_norm)
        assert norm > 0
        assert abs(((blind - (draws.noise - x0)) ** 2).mean().item() - logged.loss) > 1e-4  # the source is used


def test_i2i_validation_renders_from_a_source_image(cached, tmp_path: Path) -> None:
    config, sources = cached
    config = config.model_copy(update={"output_dir": str(tmp_path / "out")})
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    lora = T.train_lora(config, family, model_source(config), store).lora_path
    report = validate(config, family, model_source(config), store, lora)
    out = Path(report.prompts[0].lora).parents[1]
    assert (out / RESULTS).is_file() and Image.open(report.prompts[0].lora).size == (64, 64)
    assert report.condition_image == str(out / "condition.png")
    condition = np.asarray(Image.open(out / "condition.png"))  # the image every render started from
    # sources are 64 px high: fitting one into 64x64 is a center crop, no resampling
    centers = [np.asarray(Image.open(p).convert("RGB"))[:, (Image.open(p).width - 64) // 2:][:, :64]
               for p in sorted(sources.glob("*.png"))]
    assert any(np.array_equal(center, condition) for center in centers)


def test_i2i_eval_loss_without_validation_prompts(cached, tmp_path: Path) -> None:
    config, _ = cached  # no prompt: nothing renders, so no negative prompt is encoded (nor looked up)
    config = parse_config({**config.model_dump(mode="json", exclude_none=True), "output_dir": str(tmp_path / "out"),
                           "validation_prompt": None, "eval_holdout_fraction": 0.5})
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)  # its own text set
    encode_texts(config, family, model_source(config), store)
    lora = T.train_lora(config, family, model_source(config), store).lora_path
    report = validate(config, family, model_source(config), store, lora)
    assert report.eval_clips >= 1 and np.isfinite(report.eval_loss_lora)


def test_a_source_image_pairs_by_exact_name_and_an_ambiguous_one_is_quarantined(tmp_path: Path) -> None:
    from loraflow.media.frames import ProbeCache
    from loraflow.stages.clips.clips import _source_image

    targets, sources = make_demo_edits(tmp_path / "targets", tmp_path / "sources")
    config = i2i_config(tmp_path, tmp_path / "model", (targets, sources))
    edits, paired = config.training_datasets[0], config.source_images(config.training_datasets[0])
    probes = ProbeCache(Store(config.cache_dir, config.manifest_names))
    Image.open(sources / "edit_00.png").save(sources / "edit_00.v2.png")  # another stem: never its pair
    Image.open(sources / "edit_00.png").save(sources / "[edit_00].png")  # glob characters: just a name
    assert _source_image(targets / "edit_00.png", edits, paired, probes)[1] == sources / "edit_00.png"
    Image.open(sources / "edit_01.png").save(sources / "edit_01.jpg")
    with pytest.raises(Exception, match="2 source images share its name") as info:
        _source_image(targets / "edit_01.png", edits, paired, probes)
    assert info.value.reason == "ambiguous_source_image"


def test_a_source_too_large_for_the_prompt_is_quarantined_before_decoding(cached, tmp_path: Path) -> None:
    config, sources = cached  # the tiny processor caps images at 16 tokens: give it the real pixel bound
    model = shutil.copytree(config.pretrained_model_name_or_path, tmp_path / "model")
    processor = model / "tokenizer" / "processor_config.json"
    settings = json.loads(processor.read_text())
    settings["image_processor"]["size"]["longest_edge"] = 12845056  # Qwen2.5-VL's max_pixels
    processor.write_text(json.dumps(settings))
    family = get_family(config)
    assert family.size_problem(model, 1024, 1024) == ""  # 18 x 18 tokens at half size
    assert "1024 vision tokens" in family.size_problem(model, 1792, 1792)  # 32 x 32: no room for any text
    big = config.model_dump(mode="json", exclude_none=True)
    big["datasets"][0]["resolution"] = 1792
    big = parse_config({**big, "pretrained_model_name_or_path": str(model), "cache_dir": str(tmp_path / "cache")})
    report = build_clips(big, family, model_source(big), Store(big.cache_dir, big.manifest_names))
    too_large = [q for q in report.quarantined if q.reason == "source_too_large"]
    assert report.computed == 0 and len(too_large) == len(report.quarantined) - 1 >= 3  # and the orphan
    assert "lower `resolution` (1792) of dataset 'edits'" in too_large[0].detail


def test_source_folders_must_be_separate_from_their_targets(tmp_path: Path) -> None:
    from loraflow.config import ConfigError

    with pytest.raises(ConfigError, match="must be separate folders"):
        i2i_config(tmp_path, tmp_path / "model", (tmp_path / "edits", tmp_path / "edits" / "sources"))


def test_the_dataset_sensor_sees_a_changed_source_image(tmp_path: Path) -> None:
    from loraflow.assets.sensors import dataset_state

    targets, sources = make_demo_edits(tmp_path / "targets", tmp_path / "sources")
    config = i2i_config(tmp_path, tmp_path / "model", (targets, sources))
    before = dataset_state(config, config.training_datasets[0])
    Image.new("RGB", (64, 64), "red").save(sources / "edit_00.png")
    after = dataset_state(config, config.training_datasets[0])
    assert before["files"] == after["files"] == 12 and before["hash"] != after["hash"]


def test_the_demo_command_materializes_every_stage_of_an_i2i_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`loraflow demo --config` on an i2i config: tiny i2i model and edit pairs built, every asset through Dagster."""
    import yaml

    from loraflow.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    data = i2i_config(tmp_path, tmp_path / "model", (tmp_path / "edits", tmp_path / "sources")).model_dump(
        mode="json", exclude_defaults=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    assert main(["demo", "--config", str(tmp_path / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert "validation  computed 1" in out and "lora_path: " in out
    assert Image.open(out.split("video: ")[1].split()[0]).size == (64, 64)  # the LoRA's edit, a PNG
    with DagsterInstance.get() as instance:  # the UI's preview shows the source image above the edits
        (key,) = [k for k in instance.get_asset_keys() if k.path[-1] == "validation"]
        preview = instance.get_latest_materialization_event(key).asset_materialization.metadata["preview"].value
    assert preview.startswith("**every render starts from**") and preview.count("data:image/png;base64,") == 2


def test_check_lists_a_target_without_its_source_image(cached, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from loraflow.cli import main

    config, _ = cached
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    assert main(["check", str(path)]) == 0
    dropped = capsys.readouterr().out.split("dropped 1 file(s):")[1]
    assert "orphan.png" in dropped and "missing_source_image" in dropped


def test_k5_image_trains_with_crepa_on_single_frames_and_an_int8_base(cached, tmp_path: Path) -> None:
    """The K5 Image guide's int8-quanto base with CREPA on one-frame clips (REPA: each image aligned to its own
    teacher features, no neighbours): it trains, logs the term apart, and the LoRA differs from the plain run's."""
    from safetensors.torch import load_file

    from loraflow.demo.tiny import tiny_dinov2

    config, _ = cached
    settings = config.model_dump(mode="json", exclude_none=True)
    plain = parse_config({**settings, "output_dir": str(tmp_path / "plain")})
    store, family = Store(config.cache_dir, config.manifest_names), get_family(config)
    guided = parse_config({**settings, "output_dir": str(tmp_path / "guided"), "base_model_precision": "int8-quanto",
                           "crepa_enabled": True, "crepa_block_index": 1, "crepa_encoder_image_size": 16,
                           "crepa_encoder_path": str(tiny_dinov2(tmp_path / "dinov2"))})
    model = model_source(plain)  # the same checkpoint for both
    report, before = T.train_lora(guided, family, model, store), T.train_lora(plain, family, model, store)
    assert all(r.crepa_loss is not None and np.isfinite(r.crepa_loss) and r.crepa_loss != 0 for r in report.history)
    ours, theirs = load_file(report.lora_path), load_file(before.lora_path)
    assert ours.keys() == theirs.keys() and any(not torch.equal(ours[k], theirs[k]) for k in ours)
