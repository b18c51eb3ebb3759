"""The hold-out split: which clips train and which are held out for eval loss (training, evaluation and the clip
renders start from all read it)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import ClipRow


def split_holdout(keys: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split keys into (train, eval), each in input order; round(fraction * n) keys (at least 1) are held out.

    Keys are ranked by sha256(seed, key), so the split ignores the order of `keys`, and adding a key moves
    at most one other key from one side to the other.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"`eval_holdout_fraction` must be in [0, 1); got {fraction}")
    if len(set(keys)) != len(keys):
        raise ValueError("split_holdout needs distinct keys")
    if fraction == 0 or not keys:
        return list(keys), []
    count = max(1, round(fraction * len(keys)))
    if count >= len(keys):
        raise ValueError(f"`eval_holdout_fraction` {fraction} of {len(keys)} source(s) leaves nothing to train on; "
                         "add videos or lower the fraction")
    ranked = sorted(keys, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    held = set(ranked[:count])
    return [k for k in keys if k not in held], [k for k in keys if k in held]


def split_clips(clips: Sequence[ClipRow], config: LoraflowConfig) -> tuple[list[str], list[str]]:
    """Clip keys (train, eval) from the clips manifest: all of `eval_dataset_id`, and every clip of a held-out
    `eval_holdout_fraction` of the other source videos (whole videos: no frame of an eval video is trained on)."""
    held = {c.key for c in clips if c.dataset == config.eval_dataset_id}
    sources = sorted({clip_source(c) for c in clips if c.key not in held})
    _, held_sources = split_holdout(sources, config.eval_holdout_fraction, config.seed)
    held |= {c.key for c in clips if clip_source(c) in set(held_sources)}
    return [c.key for c in clips if c.key not in held], [c.key for c in clips if c.key in held]


def clip_source(clip: ClipRow) -> str:
    return f"{clip.dataset}/{clip.source}"  # dataset-relative path: stable across machines and re-encodes


def evaluates(config: LoraflowConfig) -> bool:
    return config.eval_holdout_fraction > 0 or config.eval_dataset_id is not None
