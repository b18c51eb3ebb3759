"""Audio rows: the `audio_latents` manifest's typed row (a clip's audio latent, or why it has none), written by the
audio_latents stage (stages/audio/audio_latents.py, which describes the stored rows) and read by training; what a
config's `clips_without_audio` does with a clip that has none; and the audio latent length the Kandinsky 6 pipeline
generates for a number of video frames.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: contracts stay free of numpy and the store at import
    import numpy as np

    from loraflow.store import Store

STAGE = "audio_latents"
OK = "ok"
# Why a clip has no audio latent (the row's `status`); each row's `detail` says what was found and what to do.
REASONS = {
    "no_audio": "the file has no audio track",
    "partial_audio": "the track misses more than a video frame's time of the clip (it starts late, ends early, or "
                     "has a gap)",
    "out_of_sync": "the clip's frames span another time of the source than they play (a source rate taken 1:1): "
                   "its sound would drift from its picture",
    "undecodable": "the audio track does not decode over the clip",
    "decoder_crash": "reading the track crashed the decoder (stored: the next run does not read it again)",
    "non_finite_latent": "the audio VAE encoded the clip's sound to NaN or inf (not trained on)",
    "decode_timeout": "decoding the audio took too long or its worker was killed (not stored: the next run tries "
                      "again)",
}
# `clips_without_audio`: a clip whose row is not OK trains its video alone, or is left out of training
CLIPS_WITHOUT_AUDIO = ("video_only", "leave_out")


@dataclass(frozen=True)
class AudioRow:
    """A row of the `audio_latents` manifest, its fields the Parquet columns in order."""

    key: str
    clip_key: str
    dataset: str
    status: str  # OK, or a key of REASONS
    detail: str  # what was found and what to do ("" when ok, unless its sound was clipped: then how much)
    track: str = ""  # the audio track read, in words ("a:1 of 2 (default; FFmpeg's pick), stream #2: aac ...")

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> AudioRow:
        return cls(row["key"], row["clip_key"], row["dataset"], row["status"], row["detail"], row.get("track") or "")


def read_audio_rows(store: Store, parts: Iterable[str] | None = None) -> dict[str, AudioRow]:
    """The current clips' audio rows by clip key (of the datasets `parts`; None: every dataset)."""
    return {row["clip_key"]: AudioRow.from_row(row) for row in store.read_manifest(STAGE, parts=parts)}


def trains(row: AudioRow | None, clips_without_audio: str) -> bool:
    """Whether a clip trains at all: one without an audio latent (no row counts as none) only with `video_only`."""
    if clips_without_audio not in CLIPS_WITHOUT_AUDIO:
        raise ValueError(f"clips_without_audio must be one of {', '.join(CLIPS_WITHOUT_AUDIO)}; "
                         f"got {clips_without_audio!r}")
    return (row is not None and row.ok) or clips_without_audio == "video_only"


def audio_latents_of(store: Store, keys: list[str]) -> np.ndarray:
    """(B, C, L) float32: the stored latents of these keys (OK rows), in order; the Kandinsky 6 pipeline's
    `audio_latents` layout (it permutes to the transformer's (B, L, C) itself)."""
    import numpy as np

    rows = store.get(STAGE, set(keys))
    return np.stack([np.asarray(rows[k]["audio_latent"], np.float32) for k in keys])


def audio_latent_length(num_frames: int, fps: float, sample_rate: int, latent_hop: int) -> int:
    """Audio latent frames the Kandinsky 6 pipeline generates beside `num_frames` video frames (4k + 1, as a Kandinsky 6
    bucket's are) at `fps`: diffusers 0.42.1 Kandinsky6TI2VAPipeline.__call__, `audio_length = ceil(((num_latent_frames
    - 1) * vae_scale_factor_temporal + 1) / frame_rate * audio_sample_rate / audio_latent_hop_length)`, the first
    factor being num_frames for 4k + 1 frames; `latent_hop` is MMAudioVAE.latent_hop_length (2 x its mel hop: 1024
    samples at 44.1 kHz released). The latent covers latent_hop x that many samples: the clip's frames and up to one
    latent frame more."""
    return math.ceil(num_frames / fps * sample_rate / latent_hop)
