"""`LoraflowConfig.manifest_names`, the names the store gives a config's manifests (issue 62 item 2): each stage's
name of a dataset changes with what that stage's list is made from (the dataset's files and entry, the stage's keys
in STAGE_INPUTS, the stages it takes) and with nothing else, so two configs sharing a cache never read each other's
lists, and a config that changes one stage's settings keeps the lists of the stages before it. The integration:
tests/assets/test_shared_cache.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loraflow.config import LoraflowConfig, load_config
from loraflow.config.loraflow_config import PROMPT_IMAGE_KEYS, STAGE_INPUTS, WRITTEN_BESIDE
from tests.factory import REPO, demo_dict, write_config

# Each stage folder -> the manifests its code writes (the folder's reads of the config must be in their keys).
FOLDER_STAGES = {"clips": ("clips",), "captions": ("captions",), "latents": ("latents",), "audio": ("audio_latents",),
                 "teacher": ("teacher_features",), "text": ("text_embeds",)}
# What a stage reads of the config besides its keys, and why its list does not depend on it (or depends through
# `dataset_sources`, which every name starts from).
NOT_KEYS = {
    "cache_dir": "where the store is, not what it holds",
    "manifest_names": "the names themselves",
    "training_datasets": "the entries: in dataset_sources",
    "source_images": "the paired entry: in dataset_sources",
    "render_dataset_id": "in dataset_sources (renders_from)",
    "flavour": "model_family and model_flavour",
    "validation_prompts": "validation_prompt, validation_audio_prompt and user_prompt_library",
    "vae_enable_slicing": "a memory feature of equal values",
    "vae_enable_patch_conv": "a memory feature of equal values (exact patch conv)",
    "offload_during_startup": "a memory feature of equal values",
    "train_audio": "whether the sound stage runs, not what it lists",
}


# the names read the flavour (its components' environment variables): another one that is
VALID_OTHER = {"model_family": {"model_family": "kandinsky5-image", "model_flavour": None},
               "model_flavour": {"model_flavour": "t2v-lite-pretrain-5s"}}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> LoraflowConfig:
    root = tmp_path_factory.mktemp("names")
    (root / "model").mkdir()
    (root / "videos").mkdir()
    return load_config(write_config(root / "c.yaml", demo_dict(root / "model", root / "videos", root)))


def changed_stages(config: LoraflowConfig, other: LoraflowConfig) -> set[str]:
    return {stage for stage in STAGE_INPUTS if config.manifest_names.of(stage) != other.manifest_names.of(stage)}


def made_from(stage: str) -> set[str]:
    """The stage and every stage its list is made from, transitively."""
    return {stage}.union(*(made_from(s) for s in STAGE_INPUTS[stage][1]))


def test_each_key_renames_its_stage_and_the_stages_made_from_it_only(config: LoraflowConfig) -> None:
    for stage, (keys, _) in STAGE_INPUTS.items():
        for key in keys:
            update = VALID_OTHER.get(key, {key: f"another {key}"})
            changed = config.model_copy(update=update)  # no validation: the names' reach only
            expected = {s for s in STAGE_INPUTS if any(key in STAGE_INPUTS[m][0] for m in made_from(s))}
            assert changed_stages(config, changed) == expected, key
    assert config.manifest_names.of("quarantine") == config.manifest_names.of("clips")
    assert config.manifest_names.of("latents_quarantine") == config.manifest_names.of("latents")
    assert set(WRITTEN_BESIDE.values()) <= set(STAGE_INPUTS)


def test_the_entrys_settings_rename_every_stage_and_training_settings_none(config: LoraflowConfig) -> None:
    media = config.datasets[0]
    for entry in ({"repeats": 5}, {"resolution": 32}, {"crop_style": "random"}):
        other = config.model_copy(update={"datasets": (media.model_copy(update=entry), *config.datasets[1:])})
        assert changed_stages(config, other) == set(STAGE_INPUTS), entry
    for update in ({"learning_rate": 0.5}, {"max_train_steps": 7}, {"lora_rank": 64}, {"vae_enable_patch_conv": True},
                   {"offload_during_startup": True}, {"vae_enable_slicing": True}):
        assert changed_stages(config, config.model_copy(update=update)) == set(), update


def test_a_model_folder_written_two_ways_is_one(config: LoraflowConfig, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(config.pretrained_model_name_or_path)
    linked = config.model_copy(update={"pretrained_model_name_or_path": str(tmp_path / "link")})
    assert changed_stages(config, linked) == set()


def config_reads(files: list[Path]) -> dict[str, str]:
    """Each `config.<name>` the modules read (fields and properties of LoraflowConfig) -> where, first."""
    reads = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config":
                reads.setdefault(node.attr, f"{path.relative_to(REPO)}:{node.lineno}")
    return reads


def test_every_config_key_a_caching_stage_reads_is_in_its_keys_or_said_why_not() -> None:
    stages = REPO / "loraflow" / "stages"
    assert {p.name for p in stages.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FOLDER_STAGES)
    unsaid, read = {}, set()
    for folder, written in FOLDER_STAGES.items():
        keys = {key for stage in written for key in STAGE_INPUTS[stage][0]}
        reads = config_reads(sorted((stages / folder).rglob("*.py")))
        read |= reads.keys()
        unsaid |= {f"{folder}: {key}": where for key, where in reads.items() if key not in keys | NOT_KEYS.keys()}
    every = {key for keys, _ in STAGE_INPUTS.values() for key in keys}
    reads = config_reads(sorted(stages.glob("*.py")))  # the stages' shared modules (the shard worker): any stage's
    read |= reads.keys()
    unsaid |= {key: where for key, where in reads.items() if key not in every | NOT_KEYS.keys()}
    assert not unsaid, ("a caching stage reads these config keys: add each to its stage's keys in STAGE_INPUTS "
                        f"(loraflow_config.py) if it changes what the stage lists, else to NOT_KEYS with why: {unsaid}")
    assert set(NOT_KEYS) <= read, f"NOT_KEYS names what no stage reads: {set(NOT_KEYS) - read}"


def test_a_component_the_guides_environment_variable_gives_names_what_it_makes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HunyuanVideo 1.5's guide gives the text and vision encoders by HUNYUANVIDEO_TEXT_ENCODER_PATH and
    HUNYUANVIDEO_VISION_ENCODER_PATH (`sources.component_folders`): another folder there is another text set."""
    (tmp_path / "model").mkdir()
    (tmp_path / "videos").mkdir()
    settings = {**demo_dict(tmp_path / "model", tmp_path / "videos", tmp_path), "model_family": "hunyuanvideo-1.5",
                "model_flavour": "t2v-480p"}
    config = load_config(write_config(tmp_path / "c.yaml", settings))
    monkeypatch.setenv("HUNYUANVIDEO_TEXT_ENCODER_PATH", str(tmp_path / "encoder-1"))
    first = config.manifest_names.of("text_embeds")
    monkeypatch.setenv("HUNYUANVIDEO_TEXT_ENCODER_PATH", str(tmp_path / "encoder-2"))
    assert config.manifest_names.of("text_embeds") != first
    assert config.manifest_names.of("latents") == config.model_copy().manifest_names.of("latents")


def test_what_picks_i2is_validation_image_renames_its_text_set_only_where_prompts_see_an_image(
        config: LoraflowConfig) -> None:
    i2i = config.model_copy(update={"model_family": "kandinsky5-image", "model_flavour": "i2i-lite-sft"})
    assert i2i.flavour.prompt_sees_image and not config.flavour.prompt_sees_image
    for key in PROMPT_IMAGE_KEYS:
        update = {key: 7 if key == "seed" else f"another {key}"}
        assert changed_stages(i2i, i2i.model_copy(update=update)) == {"text_embeds"}, key
        assert changed_stages(config, config.model_copy(update=update)) == set(), key
