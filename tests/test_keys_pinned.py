"""Today's keys of every example config, pinned: a refactor must leave every cache and run where it is.

The literals were computed on commit e55ad30. A failing pin means every user of that config re-caches (text,
latents) or retrains (run key): change a pin only on purpose, with a CODE_VERSION bump that says why.
The keys hash config fields and content only (no model weights, no floats), so they are the same on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraflow.config import load_config
from loraflow.keys import content_key, hash_seed
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.latents import latents as L
from loraflow.stages.text.text_embeds import text_key
from loraflow.training.run import run_dir
from loraflow.validation.validate import prompt_image, render_settings
from tests.factory import clip_row

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = {"latents": "l", "text_embeds": "t"}  # fixed data versions: the pin depends on the config only
ENCODERS = {"text_encoder": "e1", "text_encoder_2": "e2"}  # fixed fingerprints: no weight files read

# config file -> (run key, text key of "a cat", text key of "a cat" seen with image "img", latent key, tiled key)
PINNED: dict[str, tuple[str, str, str, str, str]] = {
    # text keys re-pinned on purpose (issue 44), through the families' text signatures (no CODE_VERSION bump): the
    # Kandinsky 5 Video and t2i configs encode with the original repository's template ("promt", crop 129 / 41)
    # and Video keeps 256 caption tokens (was 512): new embeddings. i2i, HunyuanVideo 1.5, every run, latent and
    # tiled key are unchanged.
    # re-pinned on purpose (issue 21): the demo became the tiny world's i2v run; its text and latent keys are those
    # of kandinsky5_video_i2v.yaml (the caches are shared), its run key its own. The t2v demo's pin moved to
    # tests/demo_t2v.yaml's run key in tests/training/test_train.py.
    "demo.yaml": ("b940d077c6bf8f024793a0db9dd835d9", "586458496e209afb6176b863653f51d5",
                  "c0c8a2364c23d612dcfe2daa9e746597", "b14af841b52ad78b61a845c1648dce8b",
                  "f0672af01b1831a37116c785e55ab780"),
    "hunyuanvideo15.yaml": ("daa2eeaa3542b2f63bd319b1aca5fde3", "219c8afa4df85c88dc7cca29f5031d08",
                            "b69ab6de8dae3cc1a51a2060dc31ee0b", "e4a46b15ca1503b15648cfd8ef97ad79",
                            "6b14d68d6d021695b5393b14b4bbc527"),
    "hunyuanvideo15_i2v.yaml": ("321a6c34826f86a97f61e512162eea52", "219c8afa4df85c88dc7cca29f5031d08",
                                "b69ab6de8dae3cc1a51a2060dc31ee0b", "f562f26b86c9527a82088f6a0e824099",
                                "062e496019dd74d4c242217c75729d7c"),
    "kandinsky5_image.yaml": ("36e8ee29937b4263c887b93b2b2e92ff", "b6eed4b4f1ea0d68703f260e38c7e849",
                              "529dbb9a0442a61abb8175182e66c503", "e4a46b15ca1503b15648cfd8ef97ad79",
                              "6b14d68d6d021695b5393b14b4bbc527"),
    "kandinsky5_image_i2i.yaml": ("dac82510ea284c87ffacb6e0fffe69f0", "e4a164ec2d2cce3b34d79802ab9572c0",
                                  "4f7ab14cb9beb793082f2d149bb117d7", "72c750a8c949596f22c99e3acbd7b784",
                                  "f0ded7002a1e6fce6f313ad2d972160e"),
    "kandinsky5_video.yaml": ("59248a724f67c650f8d96b736a2c2fb5", "586458496e209afb6176b863653f51d5",
                              "c0c8a2364c23d612dcfe2daa9e746597", "e4a46b15ca1503b15648cfd8ef97ad79",
                              "6b14d68d6d021695b5393b14b4bbc527"),
    "kandinsky5_video_i2v.yaml": ("544e1c91a4b05c88b765a4bed977cffe", "586458496e209afb6176b863653f51d5",
                                  "c0c8a2364c23d612dcfe2daa9e746597", "b14af841b52ad78b61a845c1648dce8b",
                                  "f0672af01b1831a37116c785e55ab780"),
    # pinned on purpose when they were added (issue 19): their text and latent keys are those of the configs they
    # extend (the caches are shared), their run keys their own
    "hunyuanvideo15_crepa.yaml": ("db78e4022169dce9f385b59e8686c9fe", "219c8afa4df85c88dc7cca29f5031d08",
                                  "b69ab6de8dae3cc1a51a2060dc31ee0b", "e4a46b15ca1503b15648cfd8ef97ad79",
                                  "6b14d68d6d021695b5393b14b4bbc527"),
    # run key re-pinned on purpose (issue 43): its int8 base now stores Kandinsky 5's fp32-kept modules in bf16
    # (`fp32_modules_storage`, a new number); with `fp32_modules_storage: fp32` the old key comes back. Its text keys
    # are issue 44's (the original Kandinsky 5 template)
    "kandinsky5_image_crepa.yaml": ("cc12e7f7f1122cfe7d673e2f754d8c66", "b6eed4b4f1ea0d68703f260e38c7e849",
                                    "529dbb9a0442a61abb8175182e66c503", "e4a46b15ca1503b15648cfd8ef97ad79",
                                    "6b14d68d6d021695b5393b14b4bbc527"),
    "kandinsky5_video_crepa.yaml": ("56fac558f645d966bc2d9e1cf6e65e80", "586458496e209afb6176b863653f51d5",
                                    "c0c8a2364c23d612dcfe2daa9e746597", "e4a46b15ca1503b15648cfd8ef97ad79",
                                    "6b14d68d6d021695b5393b14b4bbc527"),
    # pinned when they were added (issue 46): Kandinsky 6's latent keys are Kandinsky 5 Video's over the same dataset
    # settings (kandinsky6.yaml's equal kandinsky5_video.yaml's: one VAE, one encode, the key names no family); its
    # text keys here are its own (`text_key` with the family itself: the stage keys a text Kandinsky 5 encodes alike
    # as Kandinsky 5 Video's, `text_embeds.keying_families`, which needs the checkpoint's tokenizer)
    "kandinsky6.yaml": ("8f7c97c752e576172495acf8290d087a", "fe067a1b54a4adeb43013916accd6686",
                        "4cbaa1c698285f34e268637e4aae1379", "e4a46b15ca1503b15648cfd8ef97ad79",
                        "6b14d68d6d021695b5393b14b4bbc527"),
    # pinned when added: kandinsky6.yaml with train_audio, so its text and latent keys are kandinsky6.yaml's (the
    # picture's caches are shared), its run key its own
    "kandinsky6_sound.yaml": ("e8c8c3c28379efdd60f1a27632d264f3", "fe067a1b54a4adeb43013916accd6686",
                              "4cbaa1c698285f34e268637e4aae1379", "e4a46b15ca1503b15648cfd8ef97ad79",
                              "6b14d68d6d021695b5393b14b4bbc527"),
    # run key re-pinned on purpose (issue 58): the π-Flow example trains its sound (train_audio, clips_without_audio
    # leave_out: the original samples a distilled checkpoint with both streams only); its text and latent keys stay
    "kandinsky6_distill_i2v.yaml": ("59a033008a055c2f127b6005474cce3d", "fe067a1b54a4adeb43013916accd6686",
                                    "4cbaa1c698285f34e268637e4aae1379", "7c6cf52d468fb2082bf08d22a44fdd26",
                                    "139c9e8035f84f3392bf40cc3113742a"),
}

# i2v/i2i: (the clip renders start from, the image id i2i prompts are encoded with) among three fake clips: pins the
# hold-out split (seeded by config) and the prompt image key, which is part of every i2i validation text key
RENDER_FROM = {"demo.yaml": ("clip-2", ""), "hunyuanvideo15_i2v.yaml": ("clip-1", ""),
               "kandinsky5_video_i2v.yaml": ("clip-1", ""), "kandinsky6_distill_i2v.yaml": ("clip-0", ""),
               "kandinsky5_image_i2i.yaml": ("clip-0", "c21a58f5775e9f2e0f14cf6a8e2bc512")}


class _Clips:
    """The one store call `latent_rows` makes."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def read_manifest(self, name: str, parts: list[str] | None = None) -> list[dict[str, Any]]:
        return self.rows


def keys_of(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str, str, str]:
    config = load_config(REPO / "configs" / name)
    family = get_family(config)
    monkeypatch.setattr(L, "component_fingerprint", lambda path, component: f"fp-{component}")
    dataset = next(d.id for d in config.datasets if d.dataset_type != "text_embeds")
    clips = _Clips([clip_row("clip-0", dataset, bucket="b").to_row()])
    row = L.latent_rows(config, get_family(config), model_source(config), clips)[0]
    precision = config.text_encoder_1_precision
    return (run_dir(config, UPSTREAM).name, text_key("a cat", family, ENCODERS, precision),
            text_key("a cat", family, ENCODERS, precision, image="img"), row.key, row.tiled_key)


def test_the_content_key_itself_is_pinned() -> None:
    assert content_key(b=[1, "x"], a={"z": None}) == "633867a794e272c3cc83a5e09a0c0989"


def test_the_hash_seeds_are_pinned() -> None:
    """Training's draws, the eval noise and CREPA's projector come from one derivation (keys.hash_seed); its values
    are those of the three copies it replaced (computed with `int(content_key(...)[:15], 16)`), so runs resume
    and eval losses compare across the change."""
    from loraflow.training.batches import step_seed
    from loraflow.validation.evaluation import EvalItem, noise_seed

    assert step_seed(7, 3, "draws") == 428335594093367529
    assert noise_seed(7, EvalItem("clip", "latent", "text", "a/b.mp4", (0, 2, 4))) == 159497710700697628
    assert hash_seed(seed=7, purpose="crepa_projector") == 917467584767469212


def test_every_example_config_is_pinned() -> None:
    assert sorted(PINNED) == sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(PINNED))
def test_example_config_keys_are_those_of_before(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert keys_of(name, monkeypatch) == PINNED[name]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_image_renders_start_from_is_that_of_before(name: str) -> None:
    config = load_config(REPO / "configs" / name)
    family, dataset = get_family(config), config.datasets[0].id
    clips = _Clips([clip_row(f"clip-{i}", dataset, source=f"s{i}.mp4").to_row() for i in range(3)])
    assert (prompt_image(config, family, clips, render_settings(config, family, model_source(config)))
            == RENDER_FROM.get(name, (None, "")))


def test_kept_modules_stored_in_fp32_keep_the_run_key_of_before() -> None:
    """`fp32_modules_storage` (issue 43) is bf16 under a bf16/fp8/int8 base unless the config says: a config that
    asks fp32, what every run computed before the option, has the run key it had (kandinsky5_image_crepa.yaml's,
    pinned on e55ad30)."""
    config = load_config(REPO / "configs" / "kandinsky5_image_crepa.yaml")
    assert config.fp32_modules_storage == "bf16"
    before = config.model_copy(update={"fp32_modules_storage": "fp32"})
    assert run_dir(before, UPSTREAM).name == "9ffa53f4400d3bba9d1a18bac9c8e20a"
    assert run_dir(config, UPSTREAM).name == PINNED["kandinsky5_image_crepa.yaml"][0]
