"""One micro-step's loss: the flow-matching terms of one forward (`flow_terms`: video, audio, CREPA), scheduled
sampling's rollout as its input (`rolled_out`), TREAD's routing around the forward and backward (`routing`), and
whether the forward runs under bf16 autocast (`uses_autocast`).

The training loop (training/loop.py) calls these once per micro-step; `loraflow.estimates` runs the same step on fake
tensors to measure its memory and FLOPs, without the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch

from loraflow.config import LoraflowConfig
from loraflow.kernels.flow_matching import flow_mse, noisy_sample
from loraflow.kernels.losses import LossType
from loraflow.kernels.scheduled_sampling import roll_out
from loraflow.kernels.tread import tread_routing
from loraflow.pipelines.base import ModelFamily
from loraflow.training.options.crepa_training import capturing

if TYPE_CHECKING:
    from loraflow.training.batches import MicroBatch
    from loraflow.training.options.crepa_training import Crepa


def uses_autocast(config: LoraflowConfig, device: torch.device) -> bool:
    """Whether the forward runs under bf16 autocast (mixed_precision; `auto`: on CUDA, or with bf16 weights)."""
    auto = device.type == "cuda" or config.base_model_precision != "no_change"  # bf16 weights need bf16 compute
    return config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and auto)


class FlowTerms(NamedTuple):
    """A micro-step's loss terms: the video's flow-matching term, the audio's (a batch with sound; else None) and
    CREPA's weighted term (None when off)."""
    video: torch.Tensor
    audio: torch.Tensor | None
    crepa: torch.Tensor | None

    @property
    def flow(self) -> torch.Tensor:
        """The flow-matching loss trained: the video term plus the audio term, each its stream's own mean, so each
        stream weighs the same however many latent elements it has (a released 5 s clip: 16 x 31 x 64 x 96 video
        against 40 x 218 audio; one mean over both would leave the sound 0.3% of the loss). Lightricks' LTX-2
        trainer sums its two streams' means alike (Lightricks/LTX-2@4e277dd, packages/ltx-trainer/src/ltx_trainer/
        training_strategies/flexible.py `compute_loss`); no Kandinsky 6 trainer is released."""
        return self.video if self.audio is None else self.video + self.audio


def flow_terms(
    transformer: torch.nn.Module, family: ModelFamily, batch: MicroBatch, device: torch.device, autocast: bool,
    crepa: Crepa | None = None, loss: LossType = LossType(),
) -> FlowTerms:
    """MSE between the predicted velocity and noise - x0 at x_t = (1 - sigma) x0 + sigma noise (fp32); i2v: frame 0
    of x_t is x0's (the image) and the loss covers the generated frames only (`noisy_sample`, `flow_mse`),
    each element weighted by the batch's loss masks when it has them (`flow_mse`'s `mask`).
    Scheduled sampling replaces x_t by the model's own rollout (the target stays); with CREPA, also its weighted
    term. `loss`: the config's loss_type (kernels/losses.py).

    A batch with sound (`batch.audio`): its audio latents are noised at the same sigma as its video (the
    transformer takes one timestep for both, as the pipeline steps both with one; pipelines/kandinsky6/family.py),
    both are predicted in one call, and the audio term is the same loss against its own noise - x0, unmasked."""
    x0, noise, sigma = batch.x0.to(device), batch.draws.noise.to(device), batch.draws.sigma.to(device)
    text = {k: v.to(device) for k, v in batch.text.items()}
    given, last = family.flavour.conditioning_frames, family.flavour.last_frame_given
    x_t = noisy_sample(x0, noise, sigma, given, last)
    if batch.draws.rollout is not None:
        x_t = rolled_out(transformer, family, x_t, x0, noise, sigma, batch.draws.rollout, text, autocast)
    sound = None if batch.audio is None else (batch.audio.x0.to(device), batch.audio.noise.to(device))
    joint = {} if sound is None else {"audio": noisy_sample(*sound, sigma)}
    with capturing(crepa, transformer) as capture, torch.autocast(device.type, dtype=torch.bfloat16,
                                                                  enabled=autocast):
        prediction = family.velocity(transformer, x_t, sigma, text, **joint)
    audio = None
    if sound is not None:
        prediction, heard = prediction
        audio = flow_mse(heard, *sound, loss=loss, sigma=sigma)
    term = None if crepa is None else crepa.term(transformer, capture, batch.teacher, tuple(x0.shape[2:]))
    return FlowTerms(flow_mse(prediction, x0, noise, given, last, loss, sigma, batch.mask), audio, term)


def rolled_out(transformer: torch.nn.Module, family: ModelFamily, x_t: torch.Tensor, x0: torch.Tensor,
               noise: torch.Tensor, sigma: torch.Tensor, offsets: torch.Tensor, text: dict[str, torch.Tensor],
               autocast: bool) -> torch.Tensor:
    """Scheduled sampling's input: the current model's no-grad Euler rollout from the later sigma. In eval mode:
    LoRA dropout off, so the rollout is the model's own prediction and draws nothing from the global RNG."""
    def predict(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            return family.velocity(transformer, x, at, text).float()

    transformer.eval()
    try:
        return roll_out(predict, x_t, x0, noise, sigma, offsets.to(x_t.device), family.flavour.conditioning_frames,
                        family.flavour.last_frame_given)
    finally:
        transformer.train()


def routing(transformer: torch.nn.Module, family: ModelFamily, config: LoraflowConfig,
            seed: int) -> AbstractContextManager:
    """TREAD for one forward + backward (a checkpoint recompute reuses the subset), or nothing."""
    if config.tread_config is None:
        return nullcontext()
    return tread_routing(transformer, family.tread_layout, config.tread_config.routes,
                         torch.Generator().manual_seed(seed))
