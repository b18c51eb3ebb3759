"""What the audio rows decide for training: which clips train under `clips_without_audio`, and how long the audio
latent beside a clip is (the Kandinsky 6 pipeline's arithmetic)."""

from __future__ import annotations

import pytest

from loraflow.contracts.audio_rows import OK, AudioRow, audio_latent_length, trains


def row(status: str) -> AudioRow:
    return AudioRow(key="k", clip_key="c", dataset="d", status=status, detail="" if status == OK else "why")


@pytest.mark.parametrize(("audio", "video_only", "leave_out"), [
    (row(OK), True, True),
    (row("no_audio"), True, False),
    (row("partial_audio"), True, False),
    (None, True, False),  # no row yet (the stage has not run on the clip): no sound to train
])
def test_a_clip_without_sound_trains_its_picture_or_is_left_out(audio: AudioRow | None, video_only: bool,
                                                                 leave_out: bool) -> None:
    assert (trains(audio, "video_only"), trains(audio, "leave_out")) == (video_only, leave_out)


def test_an_unknown_choice_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="video_only, leave_out"):
        trains(row(OK), "drop")


def test_the_latent_length_is_the_pipelines_for_its_frames() -> None:
    # released 5 s: 121 frames at 24 fps, 44.1 kHz, 1024 samples a latent frame: ceil(121 / 24 x 44100 / 1024)
    # = ceil(217.13) = 218; a 25-frame clip: ceil(44.86) = 45; one frame: ceil(1.79) = 2
    assert [audio_latent_length(f, 24, 44_100, 1024) for f in (121, 25, 1)] == [218, 45, 2]
