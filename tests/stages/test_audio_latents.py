"""The audio_latents stage on the kinds of sound users' videos have, each a row with a reason or a correct latent.

Everything real: H.264 videos with PCM or AAC tracks muxed by PyAV (tests/media_factory.py `write_with_sound`), the
clips stage cutting them, the decode worker reading their sound, the tiny MMAudioVAE (the real class) saved and
loaded through `from_pretrained`, the real store. PCM tracks make the expected samples exact: a 44.1 kHz track is not
resampled, so its samples reach the VAE bit for bit (`s16` says what the file holds); a resampled one is compared
with the analytic tone within what swresample's filter and 16-bit storage allow.

Clips are 25 frames at 24 fps (`chunk`: frames 0-24, 25-49, 50-74, 75-99 of a 100-frame video): 1.04 s each, an audio
latent of ceil(25 / 24 x 44100 / 1024) = 45 frames, 46080 samples. Frame 50 starts at 50 / 24 s = 91875 samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import loraflow.media.frames as F
import loraflow.stages.audio.audio_latents as A
from loraflow.contracts.audio_rows import OK, audio_latent_length, audio_latents_of, read_audio_rows
from loraflow.contracts.clip_rows import read_clips
from loraflow.media.frames import decode_audio
from loraflow.pipelines.base import load_component, scaled_posterior
from loraflow.pipelines.kandinsky6.audio_vae import save_tiny_audio_vae
from loraflow.store import Store
from tests.factory import clips_config, run_clips
from tests.media_factory import Track, s16, tone, write_h264, write_video, write_with_sound, write_with_tracks

RATE = 44_100
FPS = 24
FRAMES = 25
LATENT = audio_latent_length(FRAMES, FPS, RATE, 1024)
SAMPLES = LATENT * 1024


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding the tiny audio VAE, as a Kandinsky 6 folder's model_index.json names it."""
    root = tmp_path_factory.mktemp("audio_model")
    save_tiny_audio_vae(root / "audio_vae")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "Kandinsky6TI2VAPipeline", "_diffusers_version": "0.42.1",
        "audio_vae": ["diffusers", "MMAudioVAE"]}))
    return root


def cache_audio(tiny_k5: Path, audio_model: Path, root: Path, write: dict, **dataset: object) -> tuple:
    """The files `write` makes (name -> writer of that path) as one dataset (`dataset`: more of its settings): clips,
    then audio latents. Returns (report, {(source, first frame): row}, store, config)."""
    data = root / "data"
    data.mkdir(parents=True)
    for name, writer in write.items():
        writer(data / name)
        (data / name).with_suffix(".txt").write_text("a sound\n")
    config = clips_config(tiny_k5, root, [{"instance_data_dir": str(data),
                                            "video": {"num_frames": FRAMES, "frame_extraction": "chunk"}, **dataset}])
    _, store = run_clips(config)
    report = A.encode_audio(config, audio_model, store)
    clips = {c.key: c for c in read_clips(store)}
    rows = {(clips[k].source, clips[k].indices[0]): row for k, row in read_audio_rows(store).items()}
    return report, rows, store, config


def encoded(audio_model: Path, waveform: np.ndarray) -> np.ndarray:
    """What the stage must store for this waveform: the tiny VAE's posterior mode x its scaling factor, (C, L)."""
    vae = load_component(audio_model, "audio_vae")
    with torch.no_grad():
        posterior = vae.encode(torch.from_numpy(np.asarray(waveform, np.float32))[None]).latent_dist
    return scaled_posterior(posterior, "mode", vae.config.scaling_factor)[0].numpy()


def stored_latent(store, row) -> np.ndarray:
    return audio_latents_of(store, [row.key])[0]


def test_a_start_offset_is_honoured_and_a_late_or_short_track_is_a_reason(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """A track that starts 0.5 s after the picture and ends at 4.0 s (the picture: 100 frames, 4.17 s), its tone
    starting 1.75 s into the track (2.25 s on the picture's clock): the clip from frame 50 holds exactly the track's
    samples 91875 - 22050 on; the first clip (0-1.04 s) misses 0.5 s of sound, the last (3.125-4.17 s) 0.17 s."""
    sound = tone(3.5, RATE, 440, starts_s=1.75)[None]
    write = {"late.mov": lambda p: write_with_sound(p, 100, sound, RATE, offset_s=0.5)}
    report, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    assert {k[1]: r.status for k, r in rows.items()} == {0: "partial_audio", 25: OK, 50: OK, 75: "partial_audio"}
    assert "0.50 s" in rows[("late.mov", 0)].detail  # what is silent, said
    first = 91875 - 22050  # the clip's first sample on the track's own clock
    expected = s16(sound[0, first:first + SAMPLES])
    assert len(expected) == SAMPLES
    np.testing.assert_array_equal(stored_latent(store, rows[("late.mov", 50)]), encoded(audio_model, expected))
    assert report.computed == 4 and len(report.quarantined) == 2


def test_files_without_usable_sound_are_rows_with_reasons(tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """No audio track; an AAC track whose packets are random bytes; a 15 fps file, whose frames the clips stage takes
    1:1 at 24 fps: 25 of them span 1.67 s of the source and play 1.04 s, so no sound of the source fits them; a float
    PCM track with 0.3 s of NaN (the VAE's log-mel would make every latent frame NaN): a gap, not a crash."""
    nan = tone(1.2, RATE, 440)
    nan[RATE // 2:RATE // 2 + round(0.3 * RATE)] = np.nan
    write = {"silent.mp4": lambda p: write_h264(p, num_frames=30, width=64, height=64),
             "broken.mp4": lambda p: write_video(p, 30, 64, 64, audio="broken"),
             "dark.mov": lambda p: write_with_sound(p, 30, tone(2.0, RATE, 440)[None], RATE, fps=15),
             "nan.mov": lambda p: write_with_sound(p, FRAMES, nan[None], RATE, codec="pcm_f32le")}
    report, rows, _, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    assert {source: r.status for (source, _), r in rows.items()} == {
        "silent.mp4": "no_audio", "broken.mp4": "undecodable", "dark.mov": "out_of_sync", "nan.mov": "partial_audio"}
    assert "leaves 0.30 s of this clip's 1.04 s silent" in rows[("nan.mov", 0)].detail
    assert "1.67 s of the source" in rows[("dark.mov", 0)].detail and "-r 24" in rows[("dark.mov", 0)].detail
    assert {q.reason for q in report.quarantined} == {"no_audio", "undecodable", "out_of_sync", "partial_audio"}


def test_5_1_is_the_mean_of_its_channels_and_8_khz_mono_is_resampled(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """Six channels of six tones at 48 kHz reach the VAE as their mean at 44.1 kHz; an 8 kHz tone as itself at
    44.1 kHz. Bound: 16-bit storage (1.5e-5) plus swresample's default filter on tones far below its cutoff
    (measured: 2.4e-5 at worst); 1e-3 is far below what a wrong downmix (a channel alone: 0.1) or rate (another
    pitch: the tone's amplitude) would leave."""
    channels = np.stack([tone(2.0, 48_000, 300 + 50 * c, amplitude=0.3 + 0.1 * c) for c in range(6)])
    write = {"surround.mov": lambda p: write_with_sound(p, 48, channels, 48_000, "5.1"),
             "phone.mov": lambda p: write_with_sound(p, 48, tone(2.0, 8000, 440)[None], 8000),
             "phone.mp4": lambda p: write_with_sound(p, 48, np.stack([tone(2.0, 48_000, 440)] * 2), 48_000,
                                                     "stereo", codec="aac"),
             "phone.mkv": lambda p: write_with_sound(p, 48, np.stack([tone(2.0, RATE, 440)] * 2), RATE, "stereo",
                                                     codec="aac")}
    report, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    assert all(r.status == OK for r in rows.values()), rows
    t = np.arange(SAMPLES) / RATE
    # AAC is lossy, so its samples are not compared one by one; lined up with the tone it correlates > 0.99, which a
    # shift of 0.4 ms (cos(2 pi 440 Hz x 0.4 ms) = 0.985) would not
    aac = decode_audio(tmp_path / "data" / "phone.mp4", 0.0, SAMPLES, RATE).waveform[round(0.05 * RATE):]
    assert np.corrcoef(aac, np.sin(2 * np.pi * 440 * t[round(0.05 * RATE):]))[0, 1] > 0.99
    # Matroska interleaves the first AAC packets with the first video frame's: all of them reach the clip
    assert decode_audio(tmp_path / "data" / "phone.mkv", 0.0, SAMPLES, RATE).covered.all()
    analytic = {"surround.mov": np.mean([(0.3 + 0.1 * c) * np.sin(2 * np.pi * (300 + 50 * c) * t) for c in range(6)],
                                        axis=0),
                "phone.mov": 0.5 * np.sin(2 * np.pi * 440 * t)}
    for source, want in analytic.items():
        sound = decode_audio(tmp_path / "data" / source, 0.0, SAMPLES, RATE)
        # from 10 ms on: the tracks start at full amplitude, and before them is silence, which the resampler's
        # filter (32 taps each side at the source rate: 4 ms at 8 kHz) blends into their first samples
        settled = round(0.01 * RATE)
        np.testing.assert_allclose(sound.waveform[settled:], want[settled:], atol=1e-3, err_msg=source)
        np.testing.assert_array_equal(stored_latent(store, rows[(source, 0)]), encoded(audio_model, sound.waveform))


def test_a_track_a_few_ms_short_is_padded_and_a_rerun_computes_nothing(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """A track 20 ms shorter than a 25-frame picture (under one frame, 42 ms): the clip trains with zeros where the
    track ends, as a player plays it; its latent covers 46080 samples, 1.045 s, so 1.021 s of it is sound."""
    sound = tone(FRAMES / FPS - 0.02, RATE, 440)[None]
    write = {"short.mov": lambda p: write_with_sound(p, FRAMES, sound, RATE)}
    report, rows, store, config = cache_audio(tiny_k5, audio_model, tmp_path, write)
    row = rows[("short.mov", 0)]
    assert row.status == OK, row.detail
    expected = np.zeros(SAMPLES)
    expected[:sound.shape[1]] = s16(sound[0])
    np.testing.assert_array_equal(stored_latent(store, row), encoded(audio_model, expected))
    again = A.encode_audio(config, audio_model, store)
    assert (again.computed, again.reused, again.data_version) == (0, 1, report.data_version)


def test_a_decoder_that_hangs_is_killed_and_its_clip_tried_again_next_run(
        tiny_k5: Path, audio_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that has not answered within the timeout is killed (a real process: here every decode outlasts a
    0.1 ms limit); its clip gets a decode_timeout row in the manifest but nothing in the store, and the next run,
    given the time, encodes it."""
    write = {"fine.mov": lambda p: write_with_sound(p, FRAMES, tone(1.2, RATE, 440)[None], RATE)}
    monkeypatch.setattr(A, "DECODE_TIMEOUT_S", 1e-4)
    report, rows, store, config = cache_audio(tiny_k5, audio_model, tmp_path, write)
    (row,) = rows.values()
    assert row.status == "decode_timeout" and "longer than" in row.detail
    assert (report.computed, report.reused) == (0, 0) and row.key not in store.keys(A.STAGE)
    monkeypatch.setattr(A, "DECODE_TIMEOUT_S", 60.0)
    again = A.encode_audio(config, audio_model, store)
    assert again.computed == 1 and read_audio_rows(store)[row.clip_key].status == OK


def test_the_default_track_is_read_not_the_first_and_audio_stream_names_another(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """Commentary (300 Hz, disposition comment) as the first track, the main mix (1000 Hz, flagged default) second, in
    FLAC (exact, as s16): the clip's latent is the main mix's, and its row says which track it read; with
    `audio_stream: 0` the commentary's, under another key."""
    commentary, main = tone(1.2, RATE, 300)[None], tone(1.2, RATE, 1000)[None]
    tracks = [Track(commentary, RATE, codec="flac", disposition=("comment",)),
              Track(main, RATE, codec="flac", disposition=("default",))]
    write = {"film.mkv": lambda p: write_with_tracks(p, FRAMES, tracks)}
    _, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path / "default", write)
    row = rows[("film.mkv", 0)]
    assert row.status == OK, row
    np.testing.assert_array_equal(stored_latent(store, row), encoded(audio_model, s16(main[0, :SAMPLES])))
    assert row.track.startswith("a:1 of 2 (default; FFmpeg's pick), stream #2: flac 1 ch"), row.track
    _, named, store, _ = cache_audio(tiny_k5, audio_model, tmp_path / "named", write, audio_stream=0)
    other = named[("film.mkv", 0)]
    assert other.status == OK and other.track.startswith("a:0 of 2 (comment; audio_stream)") and other.key != row.key
    np.testing.assert_array_equal(stored_latent(store, other), encoded(audio_model, s16(commentary[0, :SAMPLES])))
    _, missing, _, _ = cache_audio(tiny_k5, audio_model, tmp_path / "missing", write, audio_stream=2)
    assert missing[("film.mkv", 0)].status == "no_audio" and "audio_stream: 2" in missing[("film.mkv", 0)].detail


def test_7_1_aac_and_flac_become_latents_of_their_channels_mean(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """Eight channels of eight tones: PyAV 18.1 counts 9 planes in such a planar frame and `to_ndarray()` crashed the
    worker (decode_timeout, every run). FLAC (16-bit, at 44.1 kHz: not resampled) reaches the VAE as the mean of its
    channels within 16-bit storage (1.6e-5); AAC (lossy) correlates > 0.99 with that mean (the tones are orthogonal: one
    channel alone would give 0.12-0.53; FLAC's exact check is the one that sees a channel missing). Channel 3 is the
    LFE, which AAC low-passes (a 450 Hz tone there comes back at 0.24 of itself): it gets 60 Hz."""
    hz = [300 + 50 * c if c != 3 else 60 for c in range(8)]
    channels = np.stack([tone(1.2, RATE, hz[c], amplitude=0.1 + 0.05 * c) for c in range(8)])
    write = {"cinema.mkv": lambda p: write_with_sound(p, FRAMES, channels, RATE, "7.1", codec="flac"),
             "cinema.mp4": lambda p: write_with_sound(p, FRAMES, channels, RATE, "7.1", codec="aac")}
    report, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    assert {source: r.status for (source, _), r in rows.items()} == {"cinema.mkv": OK, "cinema.mp4": OK}, rows
    assert all("8 ch (7.1)" in r.track for r in rows.values())
    mean = s16(channels[:, :SAMPLES]).mean(axis=0)
    flac = decode_audio(tmp_path / "data" / "cinema.mkv", 0.0, SAMPLES, RATE).waveform
    np.testing.assert_allclose(flac, mean, atol=1e-6)
    np.testing.assert_array_equal(stored_latent(store, rows[("cinema.mkv", 0)]), encoded(audio_model, flac))
    aac = decode_audio(tmp_path / "data" / "cinema.mp4", 0.0, SAMPLES, RATE).waveform
    settled = round(0.05 * RATE)  # past the encoder's priming
    assert np.corrcoef(aac[settled:], mean[settled:])[0, 1] > 0.99
    assert report.computed == 2 and not report.quarantined


def test_a_track_that_crashes_the_decoder_is_stored_so_the_next_run_crashes_nothing(
        tiny_k5: Path, audio_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies of a segmentation fault reading the sound (planted: its audio reader dereferences address 0,
    a real SIGSEGV in the real worker process): the clip's row says so (decoder_crash, naming the signal, not "the
    file is corrupt, re-encode the video") and is stored, so the next run, crashing workers still, computes 0."""
    write = {"crash.mov": lambda p: write_with_sound(p, FRAMES, tone(1.2, RATE, 440)[None], RATE)}
    boot = F._WORKER_BOOT.replace(
        "from loraflow.media.frames import _serve;",
        "import ctypes, loraflow.media.audio_worker as w; w.clip_audio_local = lambda *a: ctypes.string_at(0); "
        "from loraflow.media.frames import _serve;")
    assert boot != F._WORKER_BOOT
    F._close_all_workers()  # idle workers booted without the fault
    monkeypatch.setattr(F, "_WORKER_BOOT", boot)
    try:
        report, rows, store, config = cache_audio(tiny_k5, audio_model, tmp_path, write)
        (row,) = rows.values()
        assert row.status == "decoder_crash" and "SIGSEGV" in row.detail and "corrupt" not in row.detail, row
        assert report.computed == 1 and row.key in store.keys(A.STAGE)
        again = A.encode_audio(config, audio_model, store)
        assert (again.computed, again.reused) == (0, 1)
        assert read_audio_rows(store)[row.clip_key].status == "decoder_crash"
    finally:
        F._close_all_workers()


def test_a_drift_of_exactly_one_frame_is_kept_and_sound_over_full_scale_is_clipped_and_said(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """A 25-frame clip of a 25 fps source taken 1:1 at 24 fps spans 1.000 s and plays 1.0417 s: exactly one frame (at
    24 fps) of drift, which the rule allows (float rounding made it 1/24 + 7e-17 and called it out_of_sync). A float
    track peaking at 1.65 reaches the VAE clipped to [-1, 1], and its ok row says so."""
    loud = tone(1.2, RATE, 440, amplitude=1.65)
    write = {"pal.mov": lambda p: write_with_sound(p, FRAMES, tone(1.2, RATE, 440)[None], RATE, fps=25),
             "loud.mov": lambda p: write_with_sound(p, FRAMES, loud[None], RATE, codec="pcm_f32le")}
    report, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    assert rows[("pal.mov", 0)].status == OK, rows[("pal.mov", 0)].detail
    row = rows[("loud.mov", 0)]
    assert row.status == OK and "peaks at 1.65" in row.detail, row
    expected = np.clip(loud[:SAMPLES].astype(np.float32), -1, 1)
    np.testing.assert_array_equal(stored_latent(store, row), encoded(audio_model, expected))
    assert [c.clip_key for c in report.clipped] == [row.clip_key]


def test_an_audio_latent_that_is_not_finite_is_refused_and_the_others_stored(
        tiny_k5: Path, audio_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real tiny audio VAE, its log-mel made NaN (a forward hook on its real `mel_converter` module) for the loud
    clip only: that clip's row is non_finite_latent, naming the clip and the precision, and holds no latent; the quiet
    one is stored as it encodes."""
    write = {"quiet.mov": lambda p: write_with_sound(p, FRAMES, tone(1.2, RATE, 440, amplitude=0.1)[None], RATE),
             "loud.mov": lambda p: write_with_sound(p, FRAMES, tone(1.2, RATE, 440, amplitude=0.9)[None], RATE)}
    load = A.load_component

    def poisoned(*args: object, **kwargs: object) -> torch.nn.Module:
        vae = load(*args, **kwargs)
        vae.mel_converter.register_forward_hook(
            lambda _, inputs, out: out * torch.nan if inputs[0].abs().max() > 0.5 else None)
        return vae

    monkeypatch.setattr(A, "load_component", poisoned)
    report, rows, store, _ = cache_audio(tiny_k5, audio_model, tmp_path, write)
    bad, good = rows[("loud.mov", 0)], rows[("quiet.mov", 0)]
    assert bad.status == "non_finite_latent" and "loud.mov" in bad.detail and "float32" in bad.detail, bad
    assert [q.reason for q in report.quarantined] == ["non_finite_latent"]
    assert good.status == OK
    expected = s16(tone(1.2, RATE, 440, amplitude=0.1)[:SAMPLES])
    np.testing.assert_array_equal(stored_latent(store, good), encoded(audio_model, expected))


def test_a_dataset_taken_out_of_the_config_leaves_no_audio_rows(
        tiny_k5: Path, audio_model: Path, tmp_path: Path) -> None:
    """Two datasets with sound, then a config without the second: that config's store reads no audio row of it, as
    none of its clips and latents (a cache shared by configs keeps every config's parts: docs/caches.md)."""
    folders = []
    for name in ("kept", "gone"):
        folder = tmp_path / name
        folder.mkdir()
        write_with_sound(folder / f"{name}.mov", FRAMES, tone(1.2, RATE, 440)[None], RATE)
        (folder / f"{name}.txt").write_text("a sound\n")
        folders.append({"instance_data_dir": str(folder), "video": {"num_frames": FRAMES}})
    both = clips_config(tiny_k5, tmp_path, folders)
    _, store = run_clips(both)
    A.encode_audio(both, audio_model, store)
    assert {r.dataset for r in read_audio_rows(store).values()} == {"d0", "d1"}
    kept = clips_config(tiny_k5, tmp_path, folders[:1])
    run_clips(kept)  # the config without d1 reads no row of it (its parts stay: another config may share them)
    assert {r.dataset for r in read_audio_rows(Store(kept.cache_dir, kept.manifest_names)).values()} == {"d0"}
