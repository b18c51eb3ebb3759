"""Latent rows: the `latents` manifest's typed row, how the latents stage stores a clip's VAE posterior, and how
training draws from it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: contracts stay free of torch at import
    import numpy as np
    import torch

    from loraflow.store import Store


@dataclass(frozen=True)
class LatentRow:
    """A row of the store's `latents` manifest: the current latent of one clip. The fields are its Parquet columns,
    in order; `to_row`/`from_row` are the only crossings to and from the store."""

    key: str
    clip_key: str
    bucket: str
    dataset: str
    approximate: bool = False  # encoded with tiling after running out of memory, under its tiled key

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LatentRow:
        # a manifest written before the out-of-memory fallback has no `approximate` column: none of its rows is
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


def read_latent_rows(store: Store, parts: Iterable[str] | None = None) -> list[LatentRow]:
    """The `latents` manifest (of `parts`; None: all), typed."""
    return [LatentRow.from_row(row) for row in store.read_manifest("latents", parts=parts)]


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
