"""`caption_strategy: auto` (stages/captions/captions.py, docs/footage.md): a tiny Qwen2.5-VL of the real classes
(random weights, the processor and tokenizer the tiny checkpoints use), saved and loaded through from_pretrained,
captions each clip without a user caption from its stored frames; cached by clip, captioner and prompt."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import pytest

from loraflow.contracts.clip_rows import read_clips
from loraflow.media.frames import ProbeCache
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.captions.captions import build_captions
from loraflow.store import Store
from tests.factory import clips_config, run_clips, videos


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2.5-VL folder as a Hub repository holds one: the model and its processor side by side."""
    import torch

    from loraflow.pipelines.tiny_parts import qwen_tokenizer, qwen_vl_encoder, qwen_vl_processor

    folder = tmp_path_factory.mktemp("qwen-vl")
    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    qwen_vl_encoder(tokenizer).save_pretrained(folder)
    qwen_vl_processor(tokenizer).save_pretrained(folder)
    return folder


def auto_config(model: Path, root: Path, data: Path, vl: Path, **overrides: object):
    return clips_config(model, root, [{"instance_data_dir": str(data), "caption_strategy": "auto"}],
                        caption_model_path=str(vl), caption_max_new_tokens=6, **overrides)


def captioned(config) -> dict[str, tuple[str, ...]]:
    store = Store(config.cache_dir, config.manifest_names)  # the config's captions, beside those of other prompts
    build = build_captions(config, model_source(config), store)
    return build, {Path(c.path).name: c.captions for c in read_clips(store)}


def test_auto_captions_every_uncaptioned_clip_alike_each_time_and_keeps_user_captions(
        tiny_k5: Path, tiny_vl: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, second, third = videos(data, 3, captions=False, num_frames=6)
    first.with_suffix(".txt").write_text("a user's caption\n", encoding="utf-8")
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl, caption_prefix="sks, ")
    run_clips(config)
    report, captions = captioned(config)
    assert report.computed == 2 and report.reused == 0
    assert captions[first.name] == ("a user's caption",)  # a user's file wins: not captioned, no prefix
    made = captions[second.name][0]
    assert made.startswith("sks, ") and len(made) > len("sks, ")  # the trigger word, then what the model said
    # the same weights, frames and prompt: the same caption, in another cache from scratch
    again = auto_config(tiny_k5, tmp_path / "again", data, tiny_vl, caption_prefix="sks, ")
    run_clips(again)
    assert captioned(again)[1] == captions


def test_only_new_or_changed_clips_and_a_new_prompt_caption_again(tiny_k5: Path, tiny_vl: Path,
                                                                   tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, _ = videos(data, 2, captions=False, num_frames=6)
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    run_clips(config)
    assert captioned(config)[0].computed == 2
    assert captioned(config)[0].computed == 0  # nothing changed: nothing captioned, the model not even loaded
    os.utime(first, ns=(1, 1))  # another version of one file: its clip's key changes
    ProbeCache._memory = OrderedDict()
    run_clips(config)
    report, _ = captioned(config)
    assert (report.computed, report.reused) == (1, 1)
    reprompted = auto_config(tiny_k5, tmp_path, data, tiny_vl, caption_prompt="What is in this video?")
    assert captioned(reprompted)[0].computed == 2  # another prompt: every clip again
    prefixed = auto_config(tiny_k5, tmp_path, data, tiny_vl, caption_prefix="zz ")
    report, captions = captioned(prefixed)
    assert report.computed == 0 and all(c[0].startswith("zz ") for c in captions.values())  # a prefix is no recaption


def test_the_captions_reach_text_embeds_which_waits_for_them(tiny_k5: Path, tiny_vl: Path, tmp_path: Path) -> None:
    from loraflow.stages.text.text_embeds import needed_texts

    data = tmp_path / "data"
    videos(data, 1, captions=False, num_frames=6)
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    _, store = run_clips(config)
    family, model = get_family(config), model_source(config)
    with pytest.raises(FileNotFoundError, match="materialize the `captions` asset"):
        needed_texts(config, family, model, store)  # not captioned yet: no clip trains on the empty prompt
    _, captions = captioned(config)
    assert captions["clip_0.mp4"][0] in {text for text, _ in needed_texts(config, family, model, store)}


def test_export_writes_them_as_user_captions_which_then_win(tiny_k5: Path, tiny_vl: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from loraflow.cli import main
    from tests.factory import write_config

    data = tmp_path / "data"
    first, second = videos(data, 2, captions=False, num_frames=6)
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    run_clips(config)
    _, captions = captioned(config)
    path = write_config(tmp_path / "config.yaml", config.model_dump(mode="json", exclude_defaults=True))
    assert main(["captions", "export", str(data), "--config", str(path)]) == 0
    assert first.with_suffix(".txt").read_text(encoding="utf-8") == captions[first.name][0] + "\n"
    second.with_suffix(".txt").write_text("edited by hand\n", encoding="utf-8")
    assert main(["captions", "export", str(data), "--config", str(path)]) == 0  # a file there is never replaced
    assert second.with_suffix(".txt").read_text(encoding="utf-8") == "edited by hand\n"
    run_clips(config)
    report, again = captioned(config)
    assert again == {first.name: captions[first.name], second.name: ("edited by hand",)} and report.computed == 0


def test_a_checkpoint_without_a_full_vl_model_and_its_processor_says_what_to_set(tiny_k5: Path,
                                                                                  tmp_path: Path) -> None:
    data = tmp_path / "data"
    videos(data, 1, captions=False, num_frames=6)
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "caption_strategy": "auto"}])
    run_clips(config)
    with pytest.raises(FileNotFoundError, match="set `caption_model_path`"):
        build_captions(config, model_source(config), Store(config.cache_dir, config.manifest_names))


def test_the_graph_has_the_captions_asset_only_for_auto_configs(tiny_k5: Path, tiny_vl: Path,
                                                                 tmp_path: Path) -> None:
    from dagster import AssetKey, AssetsDefinition

    from loraflow.assets.jobs import JOBS, graph
    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.stages import ALL_ASSETS
    from tests.factory import write_config

    data = tmp_path / "data"
    videos(data, 1, num_frames=6)
    plain = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    path = write_config(tmp_path / "plain.yaml", plain.model_dump(mode="json", exclude_defaults=True))
    assert graph(LoraflowResource(config_path=str(path))) == (ALL_ASSETS, JOBS)
    auto = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    path = write_config(tmp_path / "auto.yaml", auto.model_dump(mode="json", exclude_defaults=True))
    assets, jobs = graph(LoraflowResource(config_path=str(path)))
    by_key = {key: a for a in assets if isinstance(a, AssetsDefinition) for key in a.keys}
    assert AssetKey("captions") in by_key
    assert AssetKey("captions") in by_key[AssetKey("text_embeds")].asset_deps[AssetKey("text_embeds")]
    cache = next(j for j in jobs if j.name == "cache_dataset")
    assert "captions" in str(cache.selection)


def test_the_captions_asset_materializes_after_clips(tiny_k5: Path, tiny_vl: Path, tmp_path: Path) -> None:
    from dagster import DagsterInstance, materialize

    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.stages import captions, clips
    from tests.factory import write_config

    data = tmp_path / "data"
    videos(data, 2, captions=False, num_frames=6)
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    path = write_config(tmp_path / "auto.yaml", config.model_dump(mode="json", exclude_defaults=True))
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("datasets", ["d0"])
        done = materialize([clips, captions], partition_key="d0", instance=instance,
                           resources={"loraflow": LoraflowResource(config_path=str(path))})
    meta = {k: v.value for k, v in done.asset_materializations_for_node("captions")[0].metadata.items()}
    assert (meta["computed"], meta["captioned_clips"], meta["captioner"]) == (2, 2, str(tiny_vl))
    assert all(c[0] for c in captioned(config)[1].values())


def test_with_scene_cuts_a_scene_of_its_own_caption_keeps_it_and_export_writes_one_per_scene(
        tiny_k5: Path, tiny_vl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loraflow.stages.captions.captions import export_captions
    from tests.stages.test_scene_cuts import footage

    monkeypatch.setattr(ProbeCache, "_memory", OrderedDict())
    data = tmp_path / "data"
    footage(data)
    (data / "long.0001.txt").write_text("the blue scene\n", encoding="utf-8")
    config = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data), "caption_strategy": "auto",
                                               "video": {"num_frames": 17, "frame_extraction": "chunk",
                                                         "scene_cuts": "detect"}}],
                          caption_model_path=str(tiny_vl), caption_max_new_tokens=6)
    run_clips(config)
    report, _ = captioned(config)
    store = Store(config.cache_dir, config.manifest_names)
    by_scene = {}
    for clip in read_clips(store):
        by_scene.setdefault(clip.scene.number, set()).add(clip.captions)
    assert by_scene[1] == {("the blue scene",)} and report.computed == 4  # scene 2's four chunks, captioned
    written, kept = export_captions(config, store, tmp_path / "out")
    assert [p.name for p in written] == ["long.0002.txt"] and kept == []


def test_the_generated_captions_train(tiny_k5: Path, tiny_vl: Path, tmp_path: Path) -> None:
    """clips -> captions -> latents and text_embeds -> one training step: the batches find each generated caption's
    embedding (a missing one fails the step, naming text_embeds)."""
    import math

    from loraflow.config import load_config
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.training.batches import training_texts
    from tests.factory import demo_dict, train, write_config

    data = tmp_path / "data"
    videos(data, 2, captions=False, num_frames=17)
    settings = demo_dict(tiny_k5, data, tmp_path, max_train_steps=1, checkpointing_steps=100,
                         caption_model_path=str(tiny_vl), caption_max_new_tokens=6, caption_prefix="sks, ")
    settings["datasets"][0]["caption_strategy"] = "auto"
    config = load_config(write_config(tmp_path / "config.yaml", settings))
    family, model, store = get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names)
    run_clips(config)
    build_captions(config, model, store)
    encode_latents(config, family, model, store)
    encode_texts(config, family, model, store)
    texts = {text for text, _ in training_texts(read_clips(store))}
    assert any(t.startswith("sks, ") for t in texts)
    assert math.isfinite(train(config).final_loss)


def test_check_estimates_the_captioners_weights_for_an_auto_config(tiny_k5: Path, tiny_vl: Path,
                                                                   tmp_path: Path) -> None:
    """The captions row: the captioner's weights and buffers as it loads on an accelerator (bf16); none without an
    auto dataset."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from loraflow.estimates import estimate
    from loraflow.estimates.inputs import component_configs

    data = tmp_path / "data"
    videos(data, 1, captions=False, num_frames=6)
    config = auto_config(tiny_k5, tmp_path, data, tiny_vl)
    configs = component_configs({c: Path(tiny_k5) / c for c in config.flavour.components})
    rows = {e.stage: e for e in estimate(config, get_family(config), configs, (5, 64, 96), "cuda")}
    vl = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_vl), dtype=torch.bfloat16)
    loaded = sum(t.numel() * t.element_size() for t in [*vl.parameters(), *vl.buffers()])
    assert rows["captions"].parts == {"weights": loaded}
    plain = clips_config(tiny_k5, tmp_path, [{"instance_data_dir": str(data)}])
    assert "captions" not in {e.stage for e in estimate(plain, get_family(plain), configs, (5, 64, 96), "cuda")}
