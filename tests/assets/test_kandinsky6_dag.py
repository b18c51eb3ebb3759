"""Kandinsky 6 with its sound through the whole DAG on the tiny checkpoint, in-process as `loraflow demo` runs it:
clips -> latents, text_embeds, audio_latents -> lora (both streams) -> validation (an mp4 with an audio track), then
again, computing nothing (issue 46's acceptance).

The dataset is what users have: two H.264 videos with an AAC track (as phones write them, in .mp4) and one without a
track, which trains its picture alone (`clips_without_audio: video_only`, the default)."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from dagster import DagsterInstance
from safetensors.torch import load_file

from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.demo.tiny import build_tiny
from tests.factory import demo_dict, write_config
from tests.media_factory import tone, write_video, write_with_sound

FRAMES = 25  # 17 kept by the suite's config (num_frames 17), at 24 fps


@pytest.fixture(scope="module")
def k6_dag(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("k6-dag")
    data = root / "data"
    data.mkdir()
    for name, hz in (("low.mp4", 220.0), ("high.mp4", 880.0)):
        sound = tone(FRAMES / 24, 44_100, hz)[None]
        write_with_sound(data / name, FRAMES, sound, 44_100, width=96, height=64, codec="aac")
        (data / name).with_suffix(".txt").write_text(f"a tone of {int(hz)} Hz\n")
    write_video(data / "silent.mp4", FRAMES, width=96, height=64)
    (data / "silent.txt").write_text("a silent clip\n")
    model = build_tiny("kandinsky6", root / "k6")
    settings = demo_dict(model, data, root, model_family="kandinsky6", train_audio=True, max_train_steps=4,
                         checkpointing_steps=100)
    settings.pop("model_flavour")  # the family's default: lite-t2v
    resource = LoraflowResource(config_path=str(write_config(root / "config.yaml", settings)))
    instance = DagsterInstance.ephemeral()
    return materialize_everything(resource, instance), materialize_everything(resource, instance)


def metadata(results, asset: str) -> dict:
    (event,) = [e for r in results for e in r.get_asset_materialization_events() if e.asset_key.path[-1] == asset]
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_kandinsky6_trains_both_streams_and_renders_an_mp4_with_its_sound(k6_dag) -> None:
    first, _ = k6_dag
    assert [r.success for r in first] == [True, True]
    audio = metadata(first, "audio_latents")
    assert audio["computed"] == 3  # every clip has a row: two latents, one saying it has no track
    lora = metadata(first, "lora")
    assert Path(lora["lora_path"]).is_file() and np.isfinite(lora["final_loss"])
    history = json.loads(Path(lora["history"]).read_text())
    assert any(row["audio_loss"] > 0 for row in history)  # steps on the tones trained the sound too
    assert any(".audio_dec_block." in key for key in load_file(lora["lora_path"]))  # and the LoRA holds it
    video = Path(metadata(first, "validation")["video"])
    with av.open(str(video)) as container:
        [stream] = container.streams.audio
        assert stream.rate == 44_100
        samples = sum(frame.samples for frame in container.decode(stream))
    assert samples > 0


def test_a_second_pass_computes_nothing(k6_dag) -> None:
    _, second = k6_dag
    assert all(r.success for r in second)
    for asset in ("clips", "latents", "audio_latents", "text_embeds", "lora", "validation"):
        assert metadata(second, asset)["computed"] == 0, asset
