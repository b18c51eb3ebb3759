"""A latents row's tensors: how the latents stage stores a clip's VAE posterior, and how training draws from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: contracts stay free of torch at import
    import numpy as np
    import torch


def latent_columns(encoded: torch.Tensor, sampling: str) -> dict[str, np.ndarray]:
    """A stored row's tensors from one clip's `vae_encode` output (C, T, h, w) or (2C, T, h, w).

    `latent` is always what training uses without sampling (the mode, which is the mean): the shape check
    and a training loop that ignores `latent_logvar` read it alike.
    """
    if sampling == "mode":
        return {"latent": encoded.numpy()}
    mean, logvar = encoded.chunk(2, dim=0)  # (C, T, h, w) each
    return {"latent": mean.contiguous().numpy(), "latent_logvar": logvar.contiguous().numpy()}


def draw_latents(mean: torch.Tensor, logvar: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample of cached posteriors: mean + exp(logvar / 2) * eps, eps ~ N(0, 1) drawn from `generator`.

    mean and logvar are already scaled (`scaled_posterior`), so the sample is too. eps is drawn as diffusers'
    `latent_dist.sample(generator)` draws it (one randn of mean's shape and dtype), so for the same generator
    state the result equals that sample times the family's scaling. Pure: the generator carries all state.
    """
    import torch

    eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + torch.exp(0.5 * logvar) * eps
