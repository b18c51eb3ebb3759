"""The audio_latents stage (`train_audio: true`, a flavour with an audio VAE: Kandinsky 6): each clip's sound over the
clip's own time span, encoded by the checkpoint's audio VAE (MMAudioVAE) into a cached latent; a clip whose sound
cannot be had gets a row that says why, and `clips_without_audio` decides whether it trains its video alone or is
left out (contracts/audio_rows.py).

A clip is `num_frames` frames played at the clips stage's rate (the dataset's `video.frame_rate`, else the
flavour's fps), from its first source frame's time. Its latent has the length the pipeline generates beside that
many frames (`audio_latent_length`), so its waveform is that many latent hops of samples from the clip's first frame
(a little past its last frame: the pipeline's ceil). The waveform: `frames.decode_audio` (media/audio_worker.py: the
track the dataset's `audio_stream` names, else the one FFmpeg picks (default disposition first), from its own start
time, any channel layout, clipped to full scale, the channels' mean, swresample to the VAE's `sample_rate`), in the
decode worker, so a file that hangs or crashes FFmpeg is a row, not a dead stage. Each row says which track it read
(`track`); a clip whose sound went over full scale is clipped, and its ok row's `detail` says by how much. The
latent: the posterior's mode times the VAE's `scaling_factor` (the pipeline divides its audio latents by it before
decoding), (C, L) float32.

A row says why there is no latent (REASONS) when the file has no audio track (no_audio); the clip's frames span
another stretch of the source than they play, by more than a frame (out_of_sync: a 25 fps source taken 1:1 at 24
fps, `buckets.FPS_TOLERANCE`, runs 4% slow, 0.2 s over 5 s; a 15 fps one taken 1:1 runs 60% fast); the track misses
more than one video frame's time of the clip (partial_audio: it starts after the clip's start or ends before its end;
less is padded with zeros, as a player plays it: an AAC track's priming, a track a few ms shorter than the picture);
none of it decodes (undecodable); reading it crashed the decoder (decoder_crash: a segmentation fault or abort, which
the same read repeats); or the VAE's latent is not finite (non_finite_latent). "More than a frame" is counted
exactly (in fractions of the rates: a 25-frame clip of a 25 fps source played at 24 fps drifts exactly one frame and is
kept). These rows are stored like latents, so a rerun decides nothing again and crashes nothing; a worker that timed
out or was killed from outside (decode_timeout) is not stored, and the next run tries the clip again. Audio shorter than
the clip is never stretched: MMAudio's own loaders drop such clips too ("Audio too short",
mmaudio/data/extraction/vgg_sound.py).

Store schema (`audio_latents/shards/*.parquet`; rows with and without a latent in shards of their own):
    key           str   content_key(the source file's version and the clip's frames, fps, audio VAE fingerprint,
                        its rate and hop, downmix, resampler, the dataset's audio_stream, CODE_VERSION): a clip's
                        bucket size is not in it
    clip_key      str
    status        str   "ok", or a key of REASONS
    detail        str   what was found and what to do ("" when ok, unless its sound was clipped)
    track         str   which audio track was read, and what it is ("" when none was)
    audio_latent  float32 (C, L)   ok rows only
Manifest (`audio_latents/manifest/<dataset>.parquet`, one part per dataset): AudioRow's fields.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from tqdm import tqdm

from loraflow.config import LoraflowConfig, select_datasets
from loraflow.contracts.audio_rows import OK, REASONS, STAGE, AudioRow, audio_latent_length
from loraflow.contracts.clip_rows import ClipRow, read_clips
from loraflow.contracts.reports import AudioLatentsReport, NoAudio
from loraflow.kernels.devices import free_models, pick_device
from loraflow.keys import content_key, data_version
from loraflow.media.frames import decode_audio, probe
from loraflow.media.types import ClipAudio, MediaError, Probe
from loraflow.pipelines.base import (
    component_fingerprint,
    load_component,
    non_finite,
    non_finite_detail,
    scaled_posterior,
)
from loraflow.pipelines.sources import ModelSource, as_source
from loraflow.store import Store

log = logging.getLogger(__name__)
CODE_VERSION = "audio-2"  # 2: FFmpeg's pick of track (was the first), 7.1 read, over full scale clipped
SHARD_CLIPS = 16  # clips per committed shard: what a killed run loses at most
COMPONENT = "audio_vae"
DOWNMIX = "mean"  # media/audio_worker.py
RESAMPLER = "swresample-default"
DECODE_TIMEOUT_S = 60.0  # one clip's sound; past it the worker is killed and the clip is tried again next run
TRANSIENT = ("decode_timeout", "unreadable")  # MediaErrors of a worker that hung or was killed (or a file gone)


@dataclass(frozen=True)
class PlannedAudio:
    """A current clip's audio row as the stage plans it: its key, and the rate its frames play at."""

    key: str
    clip: ClipRow
    fps: float
    audio_stream: int | None  # the dataset's `audio_stream`: None, FFmpeg's pick


def audio_vae_config(model: ModelSource) -> dict:
    """The checkpoint's audio_vae/config.json (its rate and hop key the rows; nothing is loaded)."""
    return json.loads((as_source(model).folder(COMPONENT) / "config.json").read_text())


def planned_audio(config: LoraflowConfig, model: ModelSource, store: Store,
                  datasets: list[str] | None = None) -> list[PlannedAudio]:
    """One row per current clip of the datasets (None: every training dataset) with the key its audio row has."""
    chosen = select_datasets(config, datasets)
    fps = {d.id: d.video.frame_rate or config.flavour.fps for d in chosen}
    streams = {d.id: d.audio_stream for d in chosen}
    vae = audio_vae_config(model)
    rate, hop = int(vae["sample_rate"]), 2 * int(vae["hop_length"])  # MMAudioVAE.latent_hop_length
    vae_id = component_fingerprint(model, COMPONENT)

    def key(clip: ClipRow) -> str:
        return content_key(source=clip.source_version or clip.key, indices=list(clip.indices),
                           fps=fps[clip.dataset], audio_vae=vae_id, rate=rate, hop=hop, downmix=DOWNMIX,
                           resampler=RESAMPLER, sampling="mode", stream=streams[clip.dataset], code=CODE_VERSION)

    return [PlannedAudio(key(c), c, fps[c.dataset], streams[c.dataset])
            for c in read_clips(store, parts=datasets) if c.dataset in fps]


def encode_audio(config: LoraflowConfig, model: ModelSource, store: Store,
                 datasets: list[str] | None = None) -> AudioLatentsReport:
    """The audio rows of the datasets' clips (None: every training dataset): encodes what the store lacks (the audio
    VAE loads only then), writes each dataset's manifest part."""
    store = store.named(config.manifest_names)  # its manifests named by what they are made from, whoever opened it
    planned = planned_audio(config, model, store, datasets)
    have = store.keys(STAGE)
    todo = list({p.key: p for p in planned if p.key not in have}.values())  # clips of one span share a row
    device = pick_device()
    transient: dict[str, dict] = {}
    if todo:
        vae = load_component(model, COMPONENT, torch.float32, str(device))
        try:
            for start in tqdm(range(0, len(todo), SHARD_CLIPS), desc=STAGE, unit="shard"):
                rows = [_row(p, vae, device) for p in todo[start:start + SHARD_CLIPS]]
                transient |= {r["key"]: r for r in rows if r["status"] == "decode_timeout"}
                kept = [r for r in rows if r["status"] != "decode_timeout"]
                store.put(STAGE, [r for r in kept if "audio_latent" in r])  # a shard's rows share their columns
                store.put(STAGE, [r for r in kept if "audio_latent" not in r])
        finally:
            free_models(vae)
    keys = {p.key for p in planned} - transient.keys()
    stored = {**(store.get(STAGE, keys, columns=["key", "status", "detail", "track"]) if keys else {}), **transient}
    manifest = [AudioRow(p.key, p.clip.key, p.clip.dataset, stored[p.key]["status"], stored[p.key]["detail"],
                         stored[p.key].get("track") or "") for p in planned]
    for dataset in select_datasets(config, datasets):
        store.write_manifest(STAGE, [r.to_row() for r in manifest if r.dataset == dataset.id], part=dataset.id)
    clips = {p.clip.key: p.clip for p in planned}
    missing = tuple(NoAudio(r.dataset, clips[r.clip_key].source, r.clip_key, r.status, r.detail)
                    for r in manifest if not r.ok)
    for row in missing:
        log.warning("no audio latent for clip %s of %s: %s (%s)", row.clip_key, row.source, row.reason, row.detail)
    clipped = tuple(NoAudio(r.dataset, clips[r.clip_key].source, r.clip_key, r.status, r.detail)
                    for r in manifest if r.ok and r.detail)
    for row in clipped:
        log.warning("clip %s of %s: %s", row.clip_key, row.source, row.detail)
    return AudioLatentsReport(data_version=data_version(r.key for r in manifest if r.key not in transient),
                              computed=len(todo) - len(transient), reused=sum(p.key in have for p in planned),
                              quarantined=missing, clipped=clipped, device=str(device))


def clip_start(clip: ClipRow, info: Probe, fps: float) -> tuple[float, str]:
    """(the clip's first frame's time in seconds from the source's first frame, why its frames span another time of
    the source than they play at `fps`, or "")."""
    def time(i: int) -> float:
        return info.frame_times[i] if info.frame_times else i / info.fps

    def exact(seconds: float) -> Fraction:  # 1/24, 24000/1001 as they are: the rule is not at float rounding's mercy
        return Fraction(seconds).limit_denominator(1_000_000)

    start, last = time(clip.indices[0]), time(clip.indices[-1])
    spans, plays = last - start + 1 / info.fps, clip.num_frames / fps
    drift_frames = (exact(last) - exact(start) + 1 / exact(info.fps) - clip.num_frames / exact(fps)) * exact(fps)
    if abs(drift_frames) <= 1:  # at most one frame at the rate it plays
        return start, ""
    return start, (f"its {clip.num_frames} frames span {spans:.2f} s of the source ({info.fps:g} fps) and play "
                   f"{plays:.2f} s at {fps:g} fps: its sound would end {abs(spans - plays):.2f} s out of step with "
                   f"its picture; convert the file to {fps:g} fps (ffmpeg -i in.mp4 -r {fps:g} out.mp4), whose "
                   "frames the clips stage then takes at their own times, or set the dataset's video.frame_rate to "
                   f"{info.fps:g}")


@torch.no_grad()
def _row(planned: PlannedAudio, vae: torch.nn.Module, device: torch.device) -> dict:
    """The clip's stored row: its latent, or the reason it has none; which track it read, and what was clipped."""
    clip, fps = planned.clip, planned.fps
    row = {"key": planned.key, "clip_key": clip.key, "track": ""}
    rate, hop = int(vae.config.sample_rate), int(vae.latent_hop_length)
    length = audio_latent_length(clip.num_frames, fps, rate, hop)
    try:
        sound = _sound(clip, fps, length * hop, rate, planned.audio_stream)
    except MediaError as err:  # a worker that hung or was killed: tried again; a reason of its own: undecodable
        status = "decode_timeout" if err.reason in TRANSIENT else err.reason if err.reason in REASONS else "undecodable"
        return {**row, "status": status, "detail": str(err)}
    row["track"] = f"{sound.track}: {sound.source}"
    latent = scaled_posterior(vae.encode(torch.from_numpy(sound.waveform)[None].to(device)).latent_dist, "mode",
                              float(vae.config.scaling_factor))[0]
    if tuple(latent.shape[1:]) != (length,):
        raise RuntimeError(f"{clip.source}: audio latent {tuple(latent.shape)}, expected {length} frames: a loraflow "
                           "bug")
    bad = non_finite({"audio_latent": latent})
    if bad:
        what = f"{clip.source} (clip {clip.key}, frames {clip.indices[0]}-{clip.indices[-1]}, peak {sound.peak:.2f})"
        return {**row, "status": "non_finite_latent", "detail": non_finite_detail(what, COMPONENT, vae.dtype, bad)}
    detail = ""
    if sound.clipped_s:
        detail = (f"clipped: its sound peaks at {sound.peak:.2f}, over full scale (1.0), for {sound.clipped_s:.2f} s "
                  "of the clip; those samples were clipped to [-1, 1] before the VAE (as a player plays them). To "
                  "keep their shape, lower the track's level (ffmpeg -i in.mp4 -c:v copy -af volume=-6dB out.mp4)")
    return {**row, "status": OK, "detail": detail, "audio_latent": latent.cpu().numpy()}


def _sound(clip: ClipRow, fps: float, num_samples: int, rate: int, audio_stream: int | None) -> ClipAudio:
    """The clip's mono sound at `rate`; MediaError with the REASONS key when it has none."""
    info = probe(clip.path)
    if not info.has_audio:
        raise MediaError("no_audio", f"{clip.source}: the file has no audio track")
    start, drift = clip_start(clip, info, fps)
    if drift:
        raise MediaError("out_of_sync", f"{clip.source}: {drift}")
    sound = decode_audio(clip.path, start, num_samples, rate, timeout_s=DECODE_TIMEOUT_S, audio_stream=audio_stream)
    seconds = clip.num_frames / fps
    missing = sound.uncovered_s(seconds)
    if missing > 1 / fps:
        covered = np.flatnonzero(sound.covered[: round(seconds * rate)])
        where = f"{covered[0] / rate:.2f}-{(covered[-1] + 1) / rate:.2f} s" if len(covered) else "none"
        errors = f"; packets that did not decode: {'; '.join(sound.errors)}" if sound.errors else ""
        raise MediaError("undecodable" if sound.errors else "partial_audio",
                         f"{clip.source}: its audio track ({sound.track}: {sound.source}) leaves {missing:.2f} s of "
                         f"this clip's {seconds:.2f} s silent (it covers {where} of it; source "
                         f"{start:.2f}-{start + seconds:.2f} s){errors}; it trains as `clips_without_audio` says")
    return sound
