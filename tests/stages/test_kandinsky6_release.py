"""Kandinsky 6 as its release means it (issue 58), on the tiny Kandinsky 6 through the real stages and `loraflow check`.

1. The caption contract: `a.audio.txt` / `a.speech.txt` (or the `audio_caption` / `speech` metadata columns) composed
   into the release's prompt `caption <S>speech<E> <AUDCAP>audio<ENDAUDCAP>` (kandinsky6/spec.py `compose_prompt`
   cites the ComfyUI node and the beautifier), which the text_embeds stage encodes and `check` shows.
2. The distilled flavours train and render their sound (the original π-Flow sampler refuses video alone).
3. i2v on a transformer without the I2VA token types is refused before any stage runs.
4. One shift: a checkpoint whose scheduler says 10 trains and renders at 10.
5. The render size defaults to the release's 864x480 x 121.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraflow.cli import main
from loraflow.config import ConfigError, load_config
from loraflow.contracts.clip_rows import read_clips
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import get_family, plan_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.text.text_embeds import encode_texts, text_key
from loraflow.store import Store
from tests.factory import demo_dict, write_config
from tests.media_factory import write_h264

FRAMES = 17
CAPTION = "a dog barks at the door"
AUDIO = "loud barking, a door creaks"
SPEECH = "Let me in!"
COMPOSED = f"{CAPTION} <S>{SPEECH}<E> <AUDCAP>{AUDIO}<ENDAUDCAP>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("kandinsky6", tmp_path_factory.mktemp("k6-release") / "k6")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dog.mp4 with its caption, audio caption and speech; cat.mp4 with its caption alone."""
    data = tmp_path_factory.mktemp("k6-captions")
    for name in ("dog", "cat"):
        write_h264(data / f"{name}.mp4", num_frames=FRAMES, width=64, height=64)
    (data / "dog.txt").write_text(CAPTION + "\n")
    (data / "dog.audio.txt").write_text(AUDIO + "\n")
    (data / "dog.speech.txt").write_text(SPEECH + "\n")
    (data / "cat.txt").write_text("a cat sleeps\n")
    return data


def config_at(root: Path, model: Path, data: Path, family: str = "kandinsky6", **overrides: object):
    root.mkdir(parents=True, exist_ok=True)
    values = demo_dict(model, data, root, model_family=family, **overrides)
    if family == "kandinsky6" and "model_flavour" not in overrides:
        values.pop("model_flavour")
    return load_config(write_config(root / "config.yaml", values))


def test_the_encoded_text_is_the_releases_prompt(tiny: Path, data: Path, tmp_path: Path) -> None:
    """The clip with an audio caption and speech trains on `caption <S>speech<E> <AUDCAP>audio<ENDAUDCAP>` (the
    release's order: speech inside the video caption, the sound last), which the text stage encodes; the clip without
    keeps its plain caption, keyed as before."""
    config = config_at(tmp_path, tiny, data, train_audio=True)
    family, model, store = get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model, store)
    captions = {c.source: c.captions for c in read_clips(store)}
    assert captions == {"dog.mp4": (COMPOSED,), "cat.mp4": ("a cat sleeps",)}
    encode_texts(config, family, model, store)
    texts = {row["text"]: row["key"] for row in store.read_manifest("text_embeds")}
    assert COMPOSED in texts and CAPTION not in texts
    # the plain caption's key is the one it always had (no audio caption: nothing changes)
    assert "a cat sleeps" in texts


def test_metadata_columns_compose_alike(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "meta"
    data.mkdir()
    write_h264(data / "dog.mp4", num_frames=FRAMES, width=64, height=64)
    (data / "meta.jsonl").write_text(json.dumps({"file_name": "dog.mp4", "caption": CAPTION, "audio_caption": AUDIO,
                                                 "speech": [SPEECH]}) + "\n")
    values = demo_dict(tiny, data, tmp_path, model_family="kandinsky6")
    values.pop("model_flavour")
    values["datasets"][0].update(caption_strategy="metadata", metadata_file="meta.jsonl")
    config = load_config(write_config(tmp_path / "meta.yaml", values))
    build_clips(config, get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names))
    assert [c.captions for c in read_clips(Store(config.cache_dir, config.manifest_names))] == [(COMPOSED,)]


def test_other_families_read_no_sound_captions(tiny: Path, data: Path, tmp_path: Path) -> None:
    """Kandinsky 5 reads neither file: its captions stay plain and the two files are listed as not used."""
    config = config_at(tmp_path, tiny, data, family="kandinsky5-video")
    store = Store(config.cache_dir, config.manifest_names)
    plan = plan_family(config)
    build_clips(config, plan, config.pretrained_model_name_or_path, store)
    assert {c.source: c.captions for c in read_clips(store)}["dog.mp4"] == (CAPTION,)
    unused = {Path(q["file"]).name: q["reason"] for q in store.read_manifest("quarantine")}
    assert unused == {"dog.audio.txt": "not_used", "dog.speech.txt": "not_used"}


def test_a_videos_own_caption_is_not_anothers_sound(tiny: Path, tmp_path: Path) -> None:
    """`x.audio.txt` beside a video `x.audio.mp4` is that video's caption: the video `x.mp4` beside both is refused
    (ambiguous), never given another file's caption as its sound."""
    data = tmp_path / "twins"
    data.mkdir()
    for name in ("x", "x.audio"):
        write_h264(data / f"{name}.mp4", num_frames=FRAMES, width=64, height=64)
        (data / f"{name}.txt").write_text(f"caption of {name}\n")
    (data / "x.audio.txt").write_text("the caption of x.audio.mp4\n")
    config = config_at(tmp_path / "run", tiny, data)
    store = Store(config.cache_dir, config.manifest_names)
    build_clips(config, get_family(config), model_source(config), store)
    assert {c.source: c.captions for c in read_clips(store)} == {"x.audio.mp4": ("the caption of x.audio.mp4",)}
    assert [(Path(q["file"]).name, q["reason"]) for q in store.read_manifest("quarantine")] == [
        ("x.mp4", "ambiguous_caption")]


def test_check_shows_the_composed_text_and_counts_clips_without_audio_caption(
        tiny: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = config_at(tmp_path, tiny, data, train_audio=True)
    assert main(["check", "--no-estimates", str(tmp_path / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"one clip's text as the text encoder gets it: {COMPOSED!r}" in out
    assert "train_audio: 1 of 2 clip(s) have no audio caption" in out
    assert config.train_audio


def test_the_validation_prompt_takes_the_same_form(tiny: Path, data: Path, tmp_path: Path) -> None:
    config = config_at(tmp_path, tiny, data, validation_prompt=CAPTION, validation_audio_prompt=AUDIO)
    assert config.validation_prompts["validation"] == f"{CAPTION} <AUDCAP>{AUDIO}<ENDAUDCAP>"
    with pytest.raises(ConfigError, match="validation_audio_prompt"):
        config_at(tmp_path / "k5", tiny, data, family="kandinsky5-video", validation_audio_prompt=AUDIO)


def test_text_keys_of_plain_captions_are_unchanged(tiny: Path, data: Path, tmp_path: Path) -> None:
    """A caption without an audio caption is the text it was: its key is `text_key` of that text."""
    config = config_at(tmp_path, tiny, data)
    family, model, store = get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model, store)
    encode_texts(config, family, model, store)
    rows = {row["text"]: row["key"] for row in store.read_manifest("text_embeds")}
    encoders = json.loads(store.get("text_embeds", [rows["a cat sleeps"]])[rows["a cat sleeps"]]["encoders"])
    keys = {text_key("a cat sleeps", keyed, encoders) for keyed in (family, family.text_twin)}
    assert rows["a cat sleeps"] in keys


@pytest.mark.parametrize("flavour", ["lite-distill-t2v", "pro-distill-i2v"])
def test_a_distilled_flavour_without_its_sound_is_refused(flavour: str, tmp_path: Path) -> None:
    """`train_audio: false` on a π-Flow flavour is refused naming the original sampler's rule and the checkpoints
    to fine-tune instead; left out, it is true (the release's)."""
    from loraflow.config import parse_config

    base = {"model_family": "kandinsky6", "model_flavour": flavour, "pretrained_model_name_or_path": "m",
            "datasets": [{"id": "d", "instance_data_dir": str(tmp_path)}]}
    with pytest.raises(ConfigError) as refused:
        parse_config({**base, "train_audio": False})
    message = str(refused.value)
    size, task = flavour.split("-")[0], flavour.split("-")[-1]
    assert "base-model PiFlow requires both video and audio latents" in message
    assert "piflow.enabled requires sample_audio=True" in message
    assert f"'{size}-{task}'" in message and f"'{size}-pretrain-{task}'" in message
    assert parse_config(base).train_audio
    assert not parse_config({**base, "model_flavour": f"{size}-{task}"}).train_audio  # sft: the picture alone


def test_the_distilled_example_trains_its_sound() -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "kandinsky6_distill_i2v.yaml")
    assert config.train_audio and config.clips_without_audio == "leave_out"


def test_i2v_on_a_transformer_without_the_i2va_token_types_is_refused_before_any_stage(
        tiny: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Kandinsky 6 checkpoint whose transformer has visual_token_type_num_embeddings 0 (the released T2VA Lite):
    `check` refuses i2v on it, naming the flavour to use, and so does the first stage (`model_source`, which every
    stage calls before it loads anything); t2v on it is fine. Before: the first i2v step raised ValueError in the
    transformer."""
    from loraflow.pipelines.sources import ModelRefused

    model = tmp_path / "t2va-lite"
    shutil.copytree(tiny, model)
    config_file = model / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "visual_token_type_num_embeddings": 0}))
    config = config_at(tmp_path / "i2v", model, data, model_flavour="lite-i2v")
    assert main(["check", "--no-estimates", str(tmp_path / "i2v" / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "visual_token_type_num_embeddings 0" in err and "Use flavour 'lite-t2v'" in err
    with pytest.raises(ModelRefused, match="I2VA token types"):
        model_source(config)
    config_at(tmp_path / "t2v", model, data, model_flavour="lite-t2v")
    assert main(["check", "--no-estimates", str(tmp_path / "t2v" / "config.yaml")]) == 0


@pytest.mark.parametrize(("flavour", "refused"), [("lite-i2v", True), ("lite-pretrain-i2v", True),
                                                  ("lite-distill-i2v", False), ("pro-i2v", False)])
def test_check_reads_the_released_lite_as_the_release_ships_it(
        flavour: str, refused: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not downloaded, `check` judges the flavour's own repository by its released config: the T2VA Lite (sft and
    pretrain) has no I2VA token types (released/k6-lite.transformer.json cites the release)."""
    from loraflow.pipelines import family_flavour

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "clips").mkdir()
    config = write_config(tmp_path / "k6.yaml", {
        "model_family": "kandinsky6", "model_flavour": flavour, "train_audio": True,
        "pretrained_model_name_or_path": family_flavour("kandinsky6", flavour).repo,
        "datasets": [{"id": "clips", "instance_data_dir": str(tmp_path / "clips")}]})
    main(["check", "--no-estimates", str(config)])
    assert ("visual_token_type_num_embeddings 0" in capsys.readouterr().err) == refused


def test_a_checkpoint_whose_scheduler_says_10_trains_and_renders_at_10(
        tiny: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Kandinsky 6's recipe trains at its render shift: a checkpoint whose scheduler config says 10 (the original
    sampler's default scheduler_scale) trains at 10 (`at_training_shift`, what `train_lora` draws with) and renders at
    10; `check` prints both with their source, and warns, naming both, when a config makes them differ. Before:
    training drew at the flavour's 5.0 whatever the checkpoint said."""
    from dataclasses import replace

    from loraflow.training.batches import step_draws
    from loraflow.training.loop import at_training_shift
    from loraflow.validation.validate import render_settings

    model = tmp_path / "shift-10"
    shutil.copytree(tiny, model)
    scheduler = model / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "shift": 10.0}))
    config = config_at(tmp_path / "run", model, data)
    family, source = get_family(config), model_source(config)
    trained = at_training_shift(config, family, source)
    assert trained.flavour.training_shift == 10.0
    assert render_settings(config, family, source).flow_shift == 10.0
    shape = (1, 16, 5, 4, 4)
    at = {shift: step_draws(config, replace(family, flavour=replace(family.flavour, training_shift=shift)), 0, shape)
          for shift in (5.0, 10.0)}
    drawn = step_draws(config, trained, 0, shape).sigma
    assert drawn.equal(at[10.0].sigma) and not drawn.equal(at[5.0].sigma)
    assert main(["check", "--no-estimates", str(tmp_path / "run" / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert "sigma shift: training 10 (the checkpoint's scheduler/scheduler_config.json" in out
    assert "renders 10 (the checkpoint's scheduler/scheduler_config.json)" in out and "warning: training" not in out
    config_at(tmp_path / "apart", model, data, validation_flow_shift=3.0)
    assert main(["check", "--no-estimates", str(tmp_path / "apart" / "config.yaml")]) == 0
    assert ("warning: training draws sigmas at shift 10 (the checkpoint's scheduler/scheduler_config.json (flavour "
            "'lite-t2v' trains at its render shift)), renders sample at shift 3 (validation_flow_shift)"
            ) in capsys.readouterr().out


def test_validation_renders_at_the_releases_size_by_default(tiny: Path, data: Path, tmp_path: Path) -> None:
    """Left out, validation renders 864x480 x 121 frames at 24 fps, the release's (spec.py cites the preset)."""
    from loraflow.validation.validate import render_settings

    values = demo_dict(tiny, data, tmp_path, model_family="kandinsky6")
    for key in ("model_flavour", "validation_resolution", "validation_num_video_frames"):
        values.pop(key)
    config = load_config(write_config(tmp_path / "default.yaml", values))
    settings = render_settings(config, get_family(config), model_source(config))
    assert (settings.width, settings.height, settings.num_frames) == (864, 480, 121)
    assert config.flavour.fps == 24.0
