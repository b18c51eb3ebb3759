"""The lora stage's data: samples, the batch of each micro-step, and its random draws.

Every draw of micro-step k comes from (seed, k) alone (`step_seed`), and an epoch's batch order from (seed, epoch),
so a resumed run reads and draws exactly what the killed one would have (training/loop.py's exact resume).

With `train_audio` a sample also names its clip's audio latent (contracts/audio_rows.py; a clip without one trains its
video alone, or is left out, as `clips_without_audio` says), and its micro-batch carries the clean audio latents and
their noise, drawn from a generator of its own: the video's draws are the same with sound on or off.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from loraflow.config import LoraflowConfig
from loraflow.contracts.audio_rows import audio_latents_of, read_audio_rows, trains
from loraflow.contracts.clip_rows import ClipRow, read_clips
from loraflow.contracts.holdout import split_clips
from loraflow.contracts.latent_rows import draw_latents, read_latent_rows
from loraflow.contracts.masks import batch_mask
from loraflow.contracts.teacher_features import load_teacher_batch
from loraflow.contracts.text_set import read_text_set
from loraflow.kernels.flow_matching import auto_shift, sample_sigmas
from loraflow.kernels.scheduled_sampling import draw_offsets, rollout_probability
from loraflow.keys import hash_seed
from loraflow.pipelines.base import AS_T2V, IMAGE_CONDITION_COLUMNS, ModelFamily, TextRow, image_conditions
from loraflow.store import Store
from loraflow.training.row_cache import RowCache


@dataclass(frozen=True)
class Sample:
    latent_key: str
    text_key: str
    empty_key: str  # the empty prompt's embedding, for caption dropout (i2i: with this sample's source image)
    # (bucket, text tokens, sound): only equal groups share a batch (K5 has no text mask; a transformer call takes
    # audio for all its samples or none, of one length); sound: the dataset, whose play rate sets the audio latent's
    # length beside the bucket's frames, or "" for a sample that trains its video alone
    group: tuple[str, int, str]
    audio_key: str = ""  # `train_audio`: the clip's audio latent row; "": its video alone


@dataclass(frozen=True)
class StepDraws:
    drop_caption: bool  # the whole batch trains on the empty prompt (one text length per batch)
    noise: torch.Tensor  # (B, C, T, h, w) float32, drawn on the CPU: the same numbers on any device
    sigma: torch.Tensor  # (B,) in (0, 1), shifted
    seed: int  # seeds TREAD's token subset
    rollout: torch.Tensor | None = None  # (B,) scheduled sampling's offsets in timesteps; None: off


@dataclass(frozen=True)
class MicroBatch:
    samples: list[Sample]
    x0: torch.Tensor  # (B, C, T, h, w) clean latents, CPU
    text: dict[str, torch.Tensor]  # family.collate_text output, CPU
    draws: StepDraws
    teacher: torch.Tensor | None = None  # (B, T, g * g, E) CREPA's cached teacher features; None: off
    mask: torch.Tensor | None = None  # (B, 1, 1, h, w) loss masks (contracts/masks.py); None: unmasked
    audio: JointAudio | None = None  # `train_audio`, samples with sound; None: the video alone


@dataclass(frozen=True)
class JointAudio:
    """A micro-batch's sound (`train_audio`): the clean audio latents (B, C, L), the audio VAE's scaled latents as
    the audio_latents stage stores them, and their noise, drawn on the CPU from (seed, micro-step, "audio_noise")."""
    x0: torch.Tensor
    noise: torch.Tensor


def training_texts(clips: list[ClipRow]) -> Iterator[tuple[str, str]]:
    """The (text, image) items training reads: each caption (none: the empty prompt, unconditional, as eval loss
    treats it) and the empty prompt for caption dropout, with the clip's source image for i2i ("" otherwise)."""
    for clip in clips:
        yield from ((caption, clip.condition_key) for caption in [*(clip.captions or [""]), ""])


def build_samples(config: LoraflowConfig, store: Store) -> list[Sample]:
    """One sample per (latent, caption) x repeats; clips held out for eval loss are never trained on. With
    `train_audio`, each names its clip's audio latent, or none (`clips_without_audio: video_only`); a clip left out
    (`leave_out`) has no sample."""
    clips = read_clips(store)
    train_keys, _ = split_clips(clips, config)
    by_key, trained = {c.key: c for c in clips}, set(train_keys)
    text_set = read_text_set(store)
    texts, tokens = {r.item: r.key for r in text_set}, {r.key: r.n_tokens for r in text_set}
    sounds = read_audio_rows(store) if config.train_audio else {}
    samples = []
    for row in read_latent_rows(store):
        if row.clip_key not in trained:
            continue
        clip = by_key[row.clip_key]
        audio_key = ""
        if config.train_audio:
            sound = sounds.get(clip.key)
            if sound is None:
                raise KeyError(f"clip {clip.key} of {clip.source} has no audio_latents row (train_audio): "
                               "materialize `audio_latents` for its dataset")
            if not trains(sound, config.clips_without_audio):
                continue
            audio_key = sound.key if sound.ok else ""
        *captioned, empty = training_texts([clip])
        for item in [*captioned, empty]:
            if item not in texts:
                raise KeyError(f"caption {item[0]!r} of {clip.source} has no cached embedding: "
                               "materialize `text_embeds`")
        for item in captioned:
            key = texts[item]
            group = (row.bucket, tokens[key], clip.dataset if audio_key else "")
            samples += [Sample(row.key, key, texts[empty], group, audio_key)] * clip.repeats
    if not samples:
        raise ValueError("no training samples: every clip is held out for eval, failed to encode or (train_audio with "
                         "clips_without_audio: leave_out) has no sound; check the `latents` quarantine, the "
                         "`audio_latents` rows and `eval_holdout_fraction` / `eval_dataset_id`")
    return samples


def epoch_batches(samples: list[Sample], batch_size: int, seed: int, epoch: int) -> list[list[Sample]]:
    """Seeded shuffle, then batches drawn within `Sample.group`s (bucket, text length, sound); the batch order is
    shuffled too."""
    rng = random.Random(f"{seed}-{epoch}")
    order = samples[:]
    rng.shuffle(order)
    groups: dict[tuple[str, int, str], list[Sample]] = {}
    for sample in order:
        groups.setdefault(sample.group, []).append(sample)
    batches = [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    rng.shuffle(batches)
    return batches


class BatchPlan:
    """Micro-step k's batch: a pure function of (samples, batch size, seed, k); one epoch's order kept at a time."""

    def __init__(self, samples: list[Sample], batch_size: int, seed: int) -> None:
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.per_epoch = len(epoch_batches(samples, batch_size, seed, 0))  # group sizes fix the count
        self._epoch: tuple[int, list[list[Sample]]] = (-1, [])

    def __call__(self, micro_step: int) -> list[Sample]:
        epoch, index = divmod(micro_step, self.per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_batches(self.samples, self.batch_size, self.seed, epoch))
        return self._epoch[1][index]


def step_seed(seed: int, micro_step: int, purpose: str) -> int:
    return hash_seed(seed=seed, step=micro_step, purpose=purpose)


def step_draws(config: LoraflowConfig, family: ModelFamily, micro_step: int, shape: tuple[int, ...]) -> StepDraws:
    """Caption dropout, noise and sigmas of one micro-step, from (seed, micro_step) alone."""
    generator = torch.Generator().manual_seed(step_seed(config.seed, micro_step, "draws"))
    drop = torch.rand(1, generator=generator).item() < config.caption_dropout_probability
    noise = torch.randn(shape, generator=generator)
    shift = config.flow_schedule_shift if config.flow_schedule_shift is not None else family.flavour.training_shift
    if config.flow_schedule_auto_shift:  # the token count as SimpleTuner counts it: frames x h/2 x w/2
        shift = auto_shift(shape[2] * (shape[3] // 2) * (shape[4] // 2))
    beta = (config.flow_beta_schedule_alpha, config.flow_beta_schedule_beta) if config.flow_use_beta_schedule else None
    sigma = sample_sigmas(shape[0], generator, config.flow_sigma_sampling, shift, config.flow_sigmoid_scale, beta=beta,
                          timesteps=(config.min_timestep, config.max_timestep))
    return StepDraws(drop, noise, sigma, step_seed(config.seed, micro_step, "tread"),
                     rollout_offsets(config, micro_step, shape[0]))


def rollout_offsets(config: LoraflowConfig, micro_step: int, batch: int) -> torch.Tensor | None:
    """Scheduled sampling's per-sample rollout lengths, from their own generator: the other draws stay as they are
    with it on or off, and a resumed run draws the same (None when max_step_offset is 0)."""
    if not config.scheduled_sampling_max_step_offset:
        return None
    step = micro_step // (config.gradient_accumulation_steps * config.num_processes)  # the optimizer step
    probability = rollout_probability(
        step, config.scheduled_sampling_probability, config.scheduled_sampling_ramp_steps,
        config.scheduled_sampling_prob_start, config.scheduled_sampling_prob_end,
        config.scheduled_sampling_start_step, config.scheduled_sampling_ramp_shape)
    generator = torch.Generator().manual_seed(step_seed(config.seed, micro_step, "rollout"))
    return draw_offsets(batch, generator, probability, config.scheduled_sampling_max_step_offset,
                        config.scheduled_sampling_strategy)


def trains_as_i2v(config: LoraflowConfig, micro_step: int) -> bool:
    """`i2v_prob`: whether this micro-batch trains as i2v (always when unset), drawn per micro-batch because the
    HunyuanVideo 1.5 DiT drops the image stream only when a whole batch has none (HVT:701); from its own generator,
    so the other draws stay as they are and a resumed run draws the same."""
    if config.i2v_prob is None:
        return True
    generator = torch.Generator().manual_seed(step_seed(config.seed, micro_step, "i2v"))
    return torch.rand(1, generator=generator).item() < config.i2v_prob


def load_micro_batch(
    config: LoraflowConfig, family: ModelFamily, store: Store | RowCache, samples: list[Sample], micro_step: int,
    teacher: dict[str, str] | None = None,
) -> MicroBatch:
    """Everything a micro-step reads, on the CPU (runs on the prefetch thread)."""
    latents = store.get("latents", {s.latent_key for s in samples})
    x0 = torch.from_numpy(np.stack([latents[s.latent_key]["latent"] for s in samples]))  # (B, C, T, h, w), a copy
    if config.latent_sampling == "distribution":  # a fresh posterior sample per micro-step, the same on resume
        logvar = torch.from_numpy(np.stack([latents[s.latent_key]["latent_logvar"] for s in samples]))
        x0 = draw_latents(x0, logvar, torch.Generator().manual_seed(step_seed(config.seed, micro_step, "latents")))
    draws = step_draws(config, family, micro_step, tuple(x0.shape))
    text_keys = [s.empty_key if draws.drop_caption else s.text_key for s in samples]
    rows: dict[str, TextRow] = store.get("text_embeds", set(text_keys))
    text = family.collate_text([rows[k] for k in text_keys], torch.device("cpu"))
    text.update(image_conditions([latents[s.latent_key] for s in samples]))  # i2v rows' first-frame condition
    if not trains_as_i2v(config, micro_step):
        text = {k: v for k, v in text.items() if k not in IMAGE_CONDITION_COLUMNS} | {AS_T2V: torch.ones(1, dtype=bool)}
    features = load_teacher_batch(store, [teacher[s.latent_key] for s in samples]) if teacher else None
    mask = batch_mask([latents[s.latent_key] for s in samples], config.masked_loss_probability,
                      step_seed(config.seed, micro_step, "masked_loss"))
    return MicroBatch(samples, x0, text, draws, features, mask, joint_audio(config, store, samples, micro_step))


def joint_audio(config: LoraflowConfig, store: Store | RowCache, samples: list[Sample],
                micro_step: int) -> JointAudio | None:
    """The batch's sound, or None when its samples train their video alone (a batch is one `group`: all or none)."""
    if not samples[0].audio_key:
        return None
    x0 = torch.from_numpy(audio_latents_of(store, [s.audio_key for s in samples]))
    generator = torch.Generator().manual_seed(step_seed(config.seed, micro_step, "audio_noise"))
    return JointAudio(x0, torch.randn(x0.shape, generator=generator))
