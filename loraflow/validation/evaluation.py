"""Eval loss: the flow-matching loss of the base model and the LoRA on clips held out of training.

Numbers compare across runs and configs:
- the held-out set depends only on (seed, dataset, source path): `split_holdout` ranks by a hash;
- the sigmas are fixed, 0.1 .. 0.9 (timesteps 100 .. 900), with no shift, whatever the training schedule;
- i2v flavours: frame 0 given clean and left out of the loss, as in training (`kernels.flow_matching.flow_mse`);
  HunyuanVideo 1.5 i2v: the clip's cached first-frame condition (`image_conditions`), as in training;
- each clip's noise comes from (validation seed, what the clip is: its dataset-relative path and frame indices),
  shared by every sigma and by base and LoRA, so base and LoRA are compared on exactly the same noisy inputs; not
  from the clip key, which holds the file's mtime: a fresh clone's regenerated demo data drew other noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import read_clips
from loraflow.contracts.holdout import clip_source, split_clips
from loraflow.contracts.latent_rows import read_latent_rows
from loraflow.contracts.reports import EvalLoss
from loraflow.contracts.text_set import text_lookup
from loraflow.kernels.flow_matching import flow_mse, noisy_sample
from loraflow.keys import hash_seed
from loraflow.pipelines.base import ModelFamily, image_conditions, set_lora_scale
from loraflow.store import Store

EVAL_SIGMAS: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(1, 10))
SCALES = {"base": 0.0, "lora": 1.0}  # LoRA scale 0 is the base model exactly


@dataclass(frozen=True)
class EvalItem:
    clip_key: str
    latent_key: str
    text_key: str  # the clip's first caption
    source: str  # dataset/relative path (`clip_source`) and
    indices: tuple[int, ...]  # source frame indices: what the clip is, wherever its file lives (seeds its noise)


def eval_items(config: LoraflowConfig, family: ModelFamily, store: Store) -> list[EvalItem]:
    """The held-out clips that have a latent, each with its first caption's embedding key.

    Not the images i2v validation renders from (`validation_using_datasets`) when the flavour scores only the
    frames after the first: an image has none (its loss would be NaN)."""
    clips = read_clips(store)
    _, held = split_clips(clips, config)
    by_key = {c.key: c for c in clips}
    latents = {row.clip_key: row.key for row in read_latent_rows(store)}
    texts = text_lookup(store)
    items = []
    for clip_key in held:
        if clip_key not in latents:  # quarantined by the latents stage (non-finite latent)
            continue
        clip = by_key[clip_key]
        if family.flavour.conditioning_frames and clip.num_frames == 1:
            continue
        text = ((clip.captions or [""])[0], clip.condition_key)  # i2i: + source
        if text not in texts:
            raise KeyError(f"eval clip {clip.source}: caption {text[0]!r} has no cached embedding; "
                           "materialize `text_embeds`")
        items.append(EvalItem(clip_key, latents[clip_key], texts[text], clip_source(clip), clip.indices))
    return items


def noise_seed(seed: int, item: EvalItem) -> int:
    return hash_seed(seed=seed, source=item.source, indices=item.indices)


@torch.no_grad()
def eval_losses(
    transformer: torch.nn.Module, family: ModelFamily, store: Store, items: Sequence[EvalItem], seed: int,
    device: torch.device,
) -> list[EvalLoss]:
    """Mean MSE(velocity, noise - x0) over `items` at each of EVAL_SIGMAS, for LoRA scale 0 (base) and 1.

    One clip and one sigma per forward (batch 1): real clips are ~50k tokens. Returns one row per sigma.
    """
    if not items:
        return []
    latents = store.get("latents", [i.latent_key for i in items])
    texts = store.get("text_embeds", {i.text_key for i in items})
    sums = {name: np.zeros(len(EVAL_SIGMAS)) for name in SCALES}
    given, last = family.flavour.conditioning_frames, family.flavour.last_frame_given
    for item in items:
        x0 = torch.from_numpy(np.array(latents[item.latent_key]["latent"]))[None].to(device)  # (1, C, T, h, w)
        generator = torch.Generator().manual_seed(noise_seed(seed, item))
        noise = torch.randn(x0.shape, generator=generator).to(device)  # on CPU first: same noise on any device
        text = family.collate_text([texts[item.text_key]], device)
        text.update({k: v.to(device) for k, v in image_conditions([latents[item.latent_key]]).items()})
        for name, scale in SCALES.items():
            set_lora_scale(transformer, scale)
            for j, value in enumerate(EVAL_SIGMAS):
                sigma = torch.full((1,), value, device=device)
                prediction = family.velocity(transformer, noisy_sample(x0, noise, sigma, given, last), sigma,
                                             text)
                sums[name][j] += flow_mse(prediction, x0, noise, given, last).item()  # i2v: generated frames only
    set_lora_scale(transformer, 1.0)
    return [EvalLoss(sigma=s, timestep=round(s * 1000), **{n: float(sums[n][j] / len(items)) for n in SCALES})
            for j, s in enumerate(EVAL_SIGMAS)]


def loss_summary(rows: Sequence[EvalLoss]) -> dict[str, float]:
    """Mean over the fixed sigmas, and the LoRA's relative change (negative: the LoRA fits held-out clips better)."""
    base = float(np.mean([r.base for r in rows]))
    lora = float(np.mean([r.lora for r in rows]))
    return {"eval_loss_base": base, "eval_loss_lora": lora, "eval_loss_change": (lora - base) / base}
