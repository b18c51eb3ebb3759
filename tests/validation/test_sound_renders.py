"""Validation renders with their sound (Kandinsky 6 under `train_audio`), on the tiny Kandinsky 6 with a random LoRA.

Each written mp4 is decoded by PyAV: its audio stream is the vocoder's, at the audio VAE's rate, as long as the video
within one AAC frame (the encoder pads its last frame to a whole one), and not silence; the contact sheet draws each
render's spectrogram below its frames; a finished run is reused, and a video-only run (Kandinsky 6 without
`train_audio`) is keyed apart and writes no audio stream. Kandinsky 5's silent mp4s: tests/validation/test_validate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from loraflow.config import LoraflowConfig, parse_config
from loraflow.contracts.reports import ValidationReport
from loraflow.demo.tiny import build_tiny
from loraflow.media.previews import BLOCK_GAP, contact_sheet, spectrograms
from loraflow.media.types import Sound
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store
from loraflow.validation.validate import validate
from tests.factory import fill_validation_store, random_lora, validation_dict

LSB_16 = 2.0 ** -15  # one step of 16-bit audio: a track quieter than this is silence on any player


@pytest.fixture(scope="module")
def sound_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoraflowConfig, Store, Path]:
    """(a Kandinsky 6 lite-t2v config with `train_audio`: one prompt, 5 frames at 64x48, no eval; its store; a LoRA
    of random B)."""
    root = tmp_path_factory.mktemp("sound")
    model = build_tiny("kandinsky6", root / "k6")
    data = validation_dict(model, root, model_family="kandinsky6", model_flavour="lite-t2v", train_audio=True,
                           eval_holdout_fraction=0)
    del data["user_prompt_library"]
    config = parse_config(data)
    store = Store(config.cache_dir, config.manifest_names)
    fill_validation_store(config, store)
    return config, store, random_lora(config, root / "lora")


@pytest.fixture(scope="module")
def sound_run(sound_inputs: tuple) -> ValidationReport:
    config, store, lora = sound_inputs
    return validate(config, get_family(config), model_source(config), store, str(lora))


def decoded(path: str) -> tuple[np.ndarray, float, Sound | None, int]:
    """(frames, fps, the audio stream's sound or None, its codec's frame size in samples) of a written mp4."""
    with av.open(path) as container:
        video = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video)])
        fps = float(video.average_rate)
    with av.open(path) as container:
        if not container.streams.audio:
            return frames, fps, None, 0
        audio = container.streams.audio[0]
        assert audio.codec_context.channels == 1  # mono, as the vocoder renders it
        samples = np.concatenate([f.to_ndarray()[0] for f in container.decode(audio)])
        return frames, fps, Sound(samples, audio.rate), audio.codec_context.frame_size


def test_each_render_carries_the_vocoders_sound_over_the_videos_span(sound_inputs: tuple,
                                                                     sound_run: ValidationReport) -> None:
    config = sound_inputs[0]
    rate = json.loads((Path(config.pretrained_model_name_or_path) / "audio_vae" / "config.json").read_text())[
        "sample_rate"]  # what Kandinsky6TI2VAPipeline.audio_sample_rate reads
    (row,) = sound_run.prompts
    for path in (row.base, row.lora):
        frames, fps, sound, frame_size = decoded(path)
        assert len(frames) == config.validation_num_video_frames and fps == 24.0
        assert sound is not None and sound.rate == rate == 44_100
        # AAC codes whole frames of `frame_size` samples (1024) and mp4 trims the encoder's priming: the decoded
        # track runs from the video's start and ends within one frame of the video's end (5 / 24 s: 9187.5 samples)
        assert frame_size == 1024
        assert abs(len(sound.waveform) - len(frames) / fps * rate) < frame_size
        assert np.sqrt(np.mean(sound.waveform.astype(np.float64) ** 2)) > LSB_16


def test_the_contact_sheet_draws_each_renders_spectrogram_under_its_frames(sound_run: ValidationReport) -> None:
    (row,) = sound_run.prompts
    renders = {label: decoded(path) for label, path in (("base", row.base), ("LoRA", row.lora))}
    frames_only = contact_sheet({label: r[0] for label, r in renders.items()}, title=f"{row.name}: {row.prompt}")
    panel = spectrograms({label: r[2] for label, r in renders.items()})  # its size: the figure's, not the sound's
    sheet = np.asarray(Image.open(row.contact_sheet).convert("RGB"))
    assert sheet.shape[0] == frames_only.height + BLOCK_GAP + panel.height
    assert sheet.shape[1] == max(frames_only.width, panel.width)
    drawn = sheet[frames_only.height + BLOCK_GAP:, :panel.width].reshape(-1, 3)
    assert len(np.unique(drawn, axis=0)) > 100  # a colour map over time and frequency, not a blank panel


def test_a_finished_run_is_reused_and_a_video_only_run_is_keyed_apart_without_sound(
        sound_inputs: tuple, sound_run: ValidationReport) -> None:
    config, store, lora = sound_inputs
    family, model = get_family(config), model_source(config)
    again = validate(config, family, model, store, str(lora))
    assert again.computed == 0 and again.reused == 1 and again.data_version == sound_run.data_version
    silent_config = config.model_copy(update={"train_audio": False})
    silent = validate(silent_config, family, model, store, str(lora))
    assert silent.computed == 1 and silent.data_version != sound_run.data_version
    (row,) = silent.prompts
    for path in (row.base, row.lora):
        frames, _, sound, _ = decoded(path)
        assert sound is None and len(frames) == config.validation_num_video_frames
