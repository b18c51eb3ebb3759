"""The audio side of the decode worker: the sound of one time span of a video file, as an audio VAE takes it (mono
float32 in [-1, 1] at the VAE's rate). Runs inside the worker process (`frames.decode_audio` sends the request), like
`decode_worker.decode_local` for frames, so a file that hangs or crashes FFmpeg costs one killed worker, not the stage.

The clock is the clips stage's: seconds from the file's first shown video frame (frame i of a clip is at its probe's
time of i). The audio track's own start (an offset: a track that starts after the picture, or an AAC track whose
first frame is its priming) is honoured through each decoded frame's presentation time; decoded frames follow one
another without gaps unless their times say otherwise by more than `JITTER_TICKS` ticks of the stream's time base
(Matroska stamps in milliseconds, which would otherwise open a 0-44-sample gap at every frame).

The track: the one `audio_stream` names (0 = the file's first audio track, ffmpeg's `-map 0:a:0`), else the one
FFmpeg picks, as loraflow's video path picks its picture (`decode_worker._video_stream`) and ffmpeg, ffplay and
torchcodec pick theirs: `av_find_best_stream` (libavformat), which ranks a default-disposition track first (and one for
the hearing or visually impaired last), then the most bits. A file whose commentary comes first and its main mix,
flagged default, second trains on the main mix. `ClipAudio.track` says which was read.

Every channel layout decodes: frames are read packed (one interleaved plane, `av.AudioResampler(format="flt")`, the
layout and rate kept), since PyAV 18.1 counts 9 planes in an 8-channel (7.1) planar frame and its `to_ndarray()`
reads past them and crashes the process. A sample over full scale (float PCM or a loud lossy track can hold 1.65) is
clipped to [-1, 1] per channel, as a player's output is, and counted (`ClipAudio.peak`, `clipped_s`): the VAE's
log-mel was trained on [-1, 1].

Downmix: the mean of the channels (5.1 and 7.1 too), as MMAudio's data loaders make mono before its VAE sees it
(hkchengrex/MMAudio mmaudio/data/extraction/vgg_sound.py `VGGSound.sample`: `audio_chunk.mean(dim=0)  # mono`, no
normalization by default); the mean of channels in [-1, 1] stays in [-1, 1], where FFmpeg's own downmix matrix
(`-ac 1`) sums 5.1 past 1 unless its output is integer. Resampling: FFmpeg's swresample through `av.AudioResampler`
(its default filter), on the downmixed mono span with `MARGIN_S` of context on each side, so its filter has real
neighbours at the span's edges; a track already at the VAE's rate is not resampled (bit-exact).

What the track does not cover (before it starts, after it ends, a packet that would not decode, a float sample that
is not finite) is zeros, what a player plays there, and is marked (`ClipAudio.covered`): the stage decides what a gap
means.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from loraflow.media.decode_worker import _open_container, _shown_frames, _video_stream
from loraflow.media.types import ClipAudio, MediaError

MARGIN_S = 0.25  # decoded (and resampled) beyond each end of the span: the resampler's context, a seek's slack
SEEK_BEFORE_S = 1.0  # a seek lands on the packet at or before its target, within about this much
JITTER_TICKS = 2  # a decoded frame's time may differ from the end of the one before by this many time-base ticks


def clip_audio_local(path: Path, start_s: float, num_samples: int, rate: int,
                     audio_stream: int | None = None) -> ClipAudio:
    """`num_samples` mono float32 samples at `rate` from `start_s` seconds after the file's first video frame, of the
    track `audio_stream` names (None: FFmpeg's pick). Raises MediaError("no_audio") for a file without an audio track
    (or without the one named) and MediaError("undecodable") when none of the span's packets decode."""
    import av

    origin = _first_frame_time(path)
    with _open_container(path) as container:  # another one: finding that frame read past the first audio packets
        stream, track = _audio_stream(container, path, audio_stream)
        begin = origin + start_s
        end = begin + num_samples / rate
        source_rate = stream.codec_context.sample_rate or stream.rate
        description = (f"{stream.codec_context.name} {stream.codec_context.channels} ch "
                       f"({stream.codec_context.layout.name}) at {source_rate} Hz")
        if not source_rate:
            raise MediaError("undecodable", f"{path}: its audio track ({description}) states no sample rate")
        first = math.floor((begin - MARGIN_S) * source_rate) / source_rate  # on the track's sample grid
        timeline = _Timeline(first, end + MARGIN_S, source_rate)
        if first - SEEK_BEFORE_S > 0:
            container.seek(int((first - SEEK_BEFORE_S) / stream.time_base), stream=stream, backward=True)
        errors = _decode_into(container, stream, timeline, end + MARGIN_S)
    mono = timeline.samples.mean(axis=0) if len(timeline.samples) else np.zeros(timeline.length, np.float32)
    at_rate = mono if source_rate == rate else _resample(mono, source_rate, rate, av)
    offset = round((begin - first) * rate)  # off by at most half a sample at `rate` when the rates differ
    waveform = np.zeros(num_samples, np.float32)
    kept = at_rate[offset:offset + num_samples]
    waveform[:len(kept)] = np.clip(kept, -1.0, 1.0)  # the resampler's ringing around a clipped peak
    seconds = np.arange(num_samples) / rate + (begin - first)
    covered = timeline.covered_at(seconds)
    over = timeline.over_at(seconds)
    if errors and not covered.any():
        raise MediaError("undecodable", f"{path}: its audio track ({description}) does not decode over "
                         f"{start_s:.2f}-{start_s + num_samples / rate:.2f} s ({errors[0]}); re-encode the sound "
                         "(ffmpeg -i in.mp4 -c:v copy -c:a aac out.mp4)")
    peak = float(timeline.peaks[timeline.index_of(seconds)][covered].max(initial=0.0))
    return ClipAudio(waveform=waveform, rate=rate, covered=covered, source=description, errors=tuple(errors[:3]),
                     track=track, peak=peak, clipped_s=float(over.sum() / rate))


def _audio_stream(container: Any, path: Path, audio_stream: int | None) -> tuple[Any, str]:
    """The track to read and which it is in words ("a:1 of 2 (default; FFmpeg's pick), stream #2")."""
    import av

    tracks = list(container.streams.audio)
    if not tracks:
        raise MediaError("no_audio", f"{path}: the file has no audio track")
    if audio_stream is not None and audio_stream >= len(tracks):
        raise MediaError("no_audio", f"{path}: `audio_stream: {audio_stream}` names no track: the file has "
                         f"{len(tracks)} audio track(s) (0-{len(tracks) - 1}); set the dataset's audio_stream to one "
                         "of them or leave it unset for FFmpeg's pick")
    # best() is None only where FFmpeg has no decoder for any of them: the first one then says so when decoded
    stream = tracks[audio_stream] if audio_stream is not None else container.streams.best("audio") or tracks[0]
    flags = [flag.name for flag in av.stream.Disposition if flag & stream.disposition]
    why = "audio_stream" if audio_stream is not None else "FFmpeg's pick"
    position = tracks.index(stream)
    return stream, (f"a:{position} of {len(tracks)} ({', '.join(flags) or 'no disposition'}; {why}), "
                    f"stream #{stream.index}")


def _first_frame_time(path: Path) -> float:
    """When the first shown video frame is presented, in seconds: the clips stage's time 0."""
    with _open_container(path) as container:
        stream = _video_stream(container, path)
        frame = next(iter(_shown_frames(container, stream)), None)
        if frame is None:
            raise MediaError("zero_frames", f"{path}: the video stream has no decodable frames")
        if frame.time is not None:
            return float(frame.time)
        return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


class _Timeline:
    """Float planar samples at the source rate over [first, last) seconds, and which of them the track covered."""

    def __init__(self, first: float, last: float, rate: int) -> None:
        self.first, self.rate = first, rate
        self.length = max(1, math.ceil((last - first) * rate))
        self.samples = np.zeros((0, self.length), np.float32)  # channels known at the first frame
        self.covered = np.zeros(self.length, bool)
        self.peaks = np.zeros(self.length, np.float32)  # the loudest channel's |sample| before clipping
        self.next_at: float | None = None  # where the next frame starts when it follows the last one without a gap

    def place(self, planar: np.ndarray, time: float | None, tick: float) -> None:
        if not len(self.samples):
            self.samples = np.zeros((planar.shape[0], self.length), np.float32)
        if time is None or (self.next_at is not None and abs(time - self.next_at) <= JITTER_TICKS * tick):
            time = self.next_at if self.next_at is not None else time
        if time is None:
            return  # no time and nothing before it: it cannot be placed
        at = round((time - self.first) * self.rate)
        lo, hi = max(at, 0), min(at + planar.shape[1], self.length)
        if lo < hi:
            part = planar[:self.samples.shape[0], lo - at:hi - at]  # a channel count that changes mid-stream
            finite = np.isfinite(part).all(axis=0)  # a float track's NaN or inf: silence, and not covered
            part = np.where(finite, part, 0.0)
            self.samples[:len(part), lo:hi] = np.clip(part, -1.0, 1.0)
            self.peaks[lo:hi] = np.abs(part).max(axis=0)
            self.covered[lo:hi] = finite
        self.next_at = time + planar.shape[1] / self.rate

    def index_of(self, seconds_from_first: np.ndarray) -> np.ndarray:
        """The source samples at these times (clamped to the timeline)."""
        return np.clip(np.floor(seconds_from_first * self.rate).astype(np.int64), 0, self.length - 1)

    def covered_at(self, seconds_from_first: np.ndarray) -> np.ndarray:
        index = np.floor(seconds_from_first * self.rate).astype(np.int64)
        inside = (index >= 0) & (index < self.length)
        return np.where(inside, self.covered[self.index_of(seconds_from_first)], False)

    def over_at(self, seconds_from_first: np.ndarray) -> np.ndarray:
        """Whether a channel was over full scale (and clipped) at these times."""
        return self.covered_at(seconds_from_first) & (self.peaks[self.index_of(seconds_from_first)] > 1.0)


def _decode_into(container: Any, stream: Any, timeline: _Timeline, stop_s: float) -> list[str]:
    """Decode the track's packets into `timeline` until `stop_s`; a packet that does not decode is skipped (its
    time stays uncovered) and its error returned."""
    import av

    tick = float(stream.time_base)
    packed = av.AudioResampler(format="flt")  # sample format only: same layout and rate, no delay; packed: see above
    errors: list[str] = []
    for packet in container.demux(stream):
        if packet.pts is not None and packet.pts * tick > stop_s:
            break
        try:
            frames = packet.decode()
        except av.error.FFmpegError as err:
            errors.append(f"packet at {packet.pts * tick if packet.pts is not None else '?'} s: {err}")
            timeline.next_at = None  # the next frame is placed by its own time
            continue
        for frame in frames:
            # one frame: no resampling, no delay; (1, N x C) interleaved -> (C, N)
            converted = [f.to_ndarray().reshape(-1, f.layout.nb_channels).T for f in packed.resample(frame)]
            if converted:
                timeline.place(np.concatenate(converted, axis=1), frame.time, tick)
    return errors


def _resample(mono: np.ndarray, source_rate: int, rate: int, av: Any) -> np.ndarray:
    """Mono float32 from `source_rate` to `rate` with swresample, flushed: as many samples as the span lasts."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(mono[None], np.float32), format="flt", layout="mono")
    frame.sample_rate = source_rate
    out = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(out) if out else np.zeros(0, np.float32)
