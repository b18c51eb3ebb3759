from pathlib import Path

import pytest
import yaml

from loraflow.config import ConfigError, load_config, parse_config
from tests.factory import REPO, demo


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_demo_config_loads() -> None:
    config = load_config(REPO / "configs" / "demo.yaml")
    assert config.model_family == "kandinsky5-video"
    assert config.validation_size == (64, 96)  # WIDTHxHEIGHT 96x64


def test_unknown_key_names_the_nearest_valid_one() -> None:
    data = demo()
    data["lora_rnk"] = 8
    data["datasets"][0]["video"]["num_frame"] = 17
    found = problems(data)
    assert "lora_rnk: unknown key; did you mean 'lora_rank'?" in found
    assert "datasets[0].video.num_frame: unknown key; did you mean 'num_frames'?" in found


@pytest.mark.parametrize("frames, suggestion", [(16, "Use 13 or 17"), (120, "Use 117 or 121"), (48, "Use 45 or 49")])
def test_frames_must_be_4k_plus_1(frames: int, suggestion: str) -> None:
    data = demo()
    data["datasets"][0]["video"]["num_frames"] = frames
    (problem,) = problems(data)
    assert problem.startswith("datasets[0].video.num_frames:") and suggestion in problem and str(frames) in problem


def test_every_problem_is_reported_at_once() -> None:
    data = demo()
    data.update(model_flavour="t2v-lite", validation_num_video_frames=60, learning_rate=-1, typo=1)
    found = problems(data)
    assert len(found) == 4
    assert any(p.startswith("model_flavour:") and "t2v-lite-sft-5s" in p for p in found)
    assert any(p.startswith("validation_num_video_frames:") for p in found)
    assert any(p.startswith("learning_rate:") for p in found)


def test_the_guides_training_features_name_their_allowed_values() -> None:
    data = demo()
    data.update(optimizer="lion", report_to="comet_ml", base_model_precision="int4-quanto",
                scheduled_sampling_strategy="late", scheduled_sampling_sampler="unipc")
    found = problems(data)
    assert ("optimizer: Input should be 'adamw', 'adamw_bf16', 'muon', 'prodigy' or 'adamw_schedulefree' "
            "(got 'lion')") in found
    assert "report_to: Input should be 'tensorboard', 'wandb' or 'none' (got 'comet_ml')" in found
    assert any(p.startswith("base_model_precision:") and "'int8-torchao' or 'int8-quanto'" in p for p in found)
    assert any(p.startswith("scheduled_sampling_strategy:") and "'biased_late'" in p for p in found)
    assert any(p.startswith("scheduled_sampling_sampler:") and "'euler'" in p for p in found)
    assert problems({**demo(), "crepa_enabled": True}) == [
        "config: `crepa_enabled` needs the teacher's weights: set `crepa_encoder_path` to a local folder holding a "
        "transformers DINOv2 (save_pretrained)"]
    routed = {"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0}]}}
    assert "TREAD routes a subset" in problems({**demo(), "crepa_enabled": True, "crepa_encoder_path": "t",
                                                **routed})[0]


def i2i(**changes: object) -> dict:
    """The demo config as Kandinsky 5 Image i2i: an image dataset paired with a source-image dataset."""
    data = demo()
    data.update(model_family="kandinsky5-image", model_flavour="i2i-lite-sft", validation_num_video_frames=None)
    data["datasets"] = [
        {"id": "edited", "dataset_type": "image", "instance_data_dir": "data/edited", "conditioning_data": "sources",
         "video": {"num_frames": 1}},
        {"id": "sources", "dataset_type": "conditioning", "instance_data_dir": "data/sources"},
    ]
    data.update(changes)
    return data


def test_an_i2i_config_pairs_a_dataset_with_its_source_images() -> None:
    config = parse_config(i2i())
    (edited,) = config.training_datasets  # the conditioning dataset is never trained on by itself
    assert config.source_images(edited).id == "sources"


def test_i2i_without_conditioning_data_names_the_key_and_the_conditioning_datasets() -> None:
    data = i2i()
    del data["datasets"][0]["conditioning_data"]
    (problem,) = problems(data)
    assert "`conditioning_data`" in problem and "conditioning datasets: sources" in problem


def test_conditioning_data_must_name_a_conditioning_dataset() -> None:
    data = i2i()
    data["datasets"][0]["conditioning_data"] = "edited"
    (problem,) = problems(data)
    assert "'edited' is not an enabled dataset with `dataset_type: conditioning`; allowed: sources" in problem


def test_conditioning_data_goes_on_the_image_dataset_only() -> None:
    data = i2i()
    data["datasets"][1]["conditioning_data"] = "sources"
    (problem,) = problems(data)
    assert "dataset 'sources': `conditioning_data` goes on the image dataset" in problem


def test_conditioning_data_is_refused_by_flavours_without_a_source_image() -> None:
    (problem,) = problems(i2i(model_flavour="t2i-lite-sft"))
    assert "dataset 'edited': `conditioning_data`" in problem and "choose an i2i flavour" in problem


@pytest.mark.parametrize(("family", "flavour", "dataset", "expected"), [
    ("kandinsky5-video", "i2v-lite-5s", {"dataset_type": "image"}, "single images have none"),
    ("kandinsky5-video", "i2v-lite-5s", {"video": {"num_frames": 1}}, "single images have none"),
    ("kandinsky5-image", "t2i-lite-sft", {"video": {"num_frames": 17}}, "set `video.num_frames` to 1"),
    ("kandinsky5-image", "t2i-lite-sft", {"video": {"num_frames": 1, "frame_extraction": "full"}}, "other than full"),
])
def test_clip_lengths_the_flavour_cannot_train_on_fail_at_load(family: str, flavour: str, dataset: dict,
                                                               expected: str) -> None:
    data = demo()
    data.update(model_family=family, model_flavour=flavour, validation_num_video_frames=17)
    data["datasets"][0].update(dataset)
    (problem,) = problems(data)
    assert f"dataset '{data['datasets'][0]['id']}'" in problem and expected in problem


@pytest.mark.parametrize(("flavour", "expected"), [("i2v-lite-5s", "set `eval_dataset_id`"),
                                                    ("t2v-lite-sft-5s", "takes no image")])
def test_validation_using_datasets_needs_an_i2v_flavour_and_an_eval_dataset(flavour: str, expected: str) -> None:
    data = demo()
    data.update(model_flavour=flavour, validation_using_datasets=True, validation_num_video_frames=17)
    (problem,) = problems(data)
    assert "validation_using_datasets" in problem and expected in problem


def test_validation_using_datasets_without_prompts_fails_at_load() -> None:
    data = demo()
    data["datasets"].insert(1, {**data["datasets"][0], "id": "stills", "dataset_type": "image"})
    data.update(model_flavour="i2v-lite-5s", validation_using_datasets=True, eval_dataset_id="stills",
                validation_num_video_frames=17, validation_prompt=None, user_prompt_library=None)
    (problem,) = problems(data)
    assert "nothing to render" in problem


def test_unknown_family_lists_allowed() -> None:
    data = demo()
    data["model_family"] = "sdxl"
    (problem,) = problems(data)
    assert "kandinsky5-video" in problem


def test_separate_dataset_file_is_read(tmp_path: Path) -> None:
    data = demo()
    (tmp_path / "multidatabackend.json").write_text(__import__("json").dumps(data.pop("datasets")))
    data["dataset_backend_config"] = "multidatabackend.json"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    assert load_config(tmp_path / "config.yaml").training_datasets[0].id == "demo-videos"


@pytest.mark.parametrize("name", ["demo.yaml", "kandinsky5_video.yaml", "kandinsky5_video_i2v.yaml",
                                  "kandinsky5_image.yaml", "kandinsky5_image_i2i.yaml", "hunyuanvideo15.yaml",
                                  "hunyuanvideo15_i2v.yaml", "kandinsky5_video_crepa.yaml",
                                  "kandinsky5_image_crepa.yaml", "hunyuanvideo15_crepa.yaml"])
def test_every_example_config_validates(name: str) -> None:
    from loraflow.pipelines import get_family

    config = load_config(REPO / "configs" / name)
    family = get_family(config)  # the flavour is one the family can train
    height, width = config.validation_size
    assert height % family.spatial_multiple == 0 and width % family.spatial_multiple == 0


@pytest.mark.parametrize("bad_id", ["", "cats...dogs", "tab\there"])
def test_a_dataset_id_must_be_a_valid_partition_key(bad_id: str) -> None:
    data = demo()
    data["datasets"][0]["id"] = bad_id
    (problem,) = problems(data)
    assert problem.startswith("datasets[0].id:") and "partition" in problem


@pytest.mark.parametrize("key", ["output_dir", "cache_dir"])
def test_outputs_inside_a_dataset_folder_are_refused(key: str, tmp_path: Path) -> None:
    data = demo()
    data["datasets"][0]["instance_data_dir"] = str(tmp_path / "videos")
    data[key] = str(tmp_path / "videos" / "run")  # rendered videos would become training data, and the sensor loop
    (problem,) = problems(data)
    assert f"`{key}`" in problem and "inside dataset" in problem
    data[key] = "s3://bucket/videos" if key == "cache_dir" else str(tmp_path / "out")
    parse_config(data)


@pytest.mark.parametrize("key", ["output_dir", "cache_dir"])
@pytest.mark.parametrize("folder", ["/", "/etc", "/usr/lib/loraflow", "/proc/self", "/home", "~"])
def test_outputs_in_a_system_folder_are_refused_naming_the_key(key: str, folder: str) -> None:
    data = demo()
    data[key] = str(Path.home()) if folder == "~" else folder
    (problem,) = problems(data)
    assert problem.startswith(f"config: `{key}` {data[key]}") and "system folder" in problem


@pytest.mark.parametrize("settings, named", [
    ({"flow_use_beta_schedule": True, "flow_sigma_sampling": "uniform"}, "`flow_use_beta_schedule` replaces"),
    ({"flow_schedule_auto_shift": True, "flow_schedule_shift": 3.0}, "`flow_schedule_auto_shift` computes the shift"),
    ({"min_timestep": 800, "max_timestep": 200}, "`min_timestep` 800 must be below `max_timestep` 200"),
    ({"optimizer": "prodigy", "loraplus_lr_ratio": 16}, "`loraplus_lr_ratio` with optimizer prodigy"),
    ({"optimizer": "muon", "crepa_enabled": True, "crepa_encoder_path": "t"}, "optimizer muon orthogonalises"),
], ids=["beta+uniform", "auto+static-shift", "timestep-range", "loraplus+prodigy", "muon+crepa"])
def test_the_peers_options_that_exclude_each_other_are_named(settings: dict, named: str) -> None:
    data = demo()
    data.update(settings)
    (problem,) = problems(data)
    assert named in problem


@pytest.mark.parametrize("settings, named", [
    ({"train_audio": True}, "has no audio VAE and generates no sound"),
    ({"clips_without_audio": "leave_out"}, "`clips_without_audio` says what training does"),
    ({"model_family": "kandinsky6", "model_flavour": "lite-t2v", "train_audio": True,
      "scheduled_sampling_max_step_offset": 2}, "the rollout steps the picture alone, not its sound"),
    ({"model_family": "kandinsky6", "model_flavour": "lite-t2v", "train_audio": True, "fsdp": True,
      "num_processes": 2}, "set clips_without_audio: leave_out (every batch then has sound), or fsdp: false"),
], ids=["sound-without-an-audio-vae", "clips_without_audio-alone", "sound+scheduled-sampling", "sound+fsdp"])
def test_sound_is_trained_only_by_a_flavour_with_an_audio_vae(settings: dict, named: str) -> None:
    data = demo()
    data.pop("pretrained_model_name_or_path")  # the flavour's repository
    data.update(settings)
    (problem,) = problems(data)
    assert named in problem


def test_two_datasets_with_one_id_are_refused() -> None:
    """`loraflow partitions` crashed on them (sqlite IntegrityError: one partition per id)."""
    data = demo()
    data["datasets"].insert(1, {**data["datasets"][0], "instance_data_dir": "elsewhere"})
    (problem,) = problems(data)
    assert problem.startswith("datasets:") and "'demo-videos' names 2 datasets" in problem


@pytest.mark.parametrize("long_id", ["v" * 300, "猫" * 30])  # a CJK character is 9 characters of its file name
def test_a_dataset_id_too_long_for_a_file_name_is_refused(long_id: str) -> None:
    """It failed after minutes of caching (File name too long) when the store wrote the dataset's manifest part."""
    data = demo()
    data["datasets"][0]["id"] = long_id
    (problem,) = problems(data)
    assert problem.startswith("datasets[0].id:") and "file name" in problem


def test_the_longest_dataset_id_accepted_names_files_the_store_can_write(tmp_path: Path) -> None:
    from loraflow.keys import PART_STEM_LIMIT
    from loraflow.store import Store

    data = demo()
    longest = "v" * PART_STEM_LIMIT
    data["datasets"][0]["id"] = longest
    parse_config(data)
    store = Store(str(tmp_path))  # its atomic write adds the longest suffix to the part's file name
    store.write_manifest("clips", [{"key": "a"}], part=longest)
    with store.part_lock(longest):
        assert store.read_manifest("clips", parts=[longest]) == [{"key": "a"}]
    data["datasets"][0]["id"] = longest + "v"
    (problem,) = problems(data)
    assert f"{PART_STEM_LIMIT + 1} characters" in problem
