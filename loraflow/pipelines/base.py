"""The family protocol and the machinery every family shares (component loading, fingerprints).

Tensor layouts used across the protocol:
    frames   uint8 (B, F, H, W, 3) RGB
    latents  float32 (B, C, T, h, w), already multiplied by the family's VAE scaling
    text     a dict of per-sample tensors from `encode_text`, batched by the caller
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from loraflow.keys import content_key, directory_fingerprint
from loraflow.pipelines.flavours import Flavour

TextRow = dict[str, np.ndarray]


class ModelFamily(Protocol):
    """What a stage may ask of a model family. One implementation per module in `pipelines/`."""

    name: str
    flavour: Flavour
    spatial_multiple: int  # pixel sizes must be multiples of this (VAE factor x patch size)
    vae_temporal_factor: int
    text_components: tuple[str, ...]
    default_negative_prompt: str
    text_signature: str  # hash of template, token limits: part of every text key

    def encode_text(self, components: Mapping[str, Any], texts: list[str]) -> list[TextRow]:
        """One row per text: the valid tokens only (padding is rebuilt at batch time)."""

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        """Batch text rows for the transformer (padding, masks)."""

    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor) -> torch.Tensor:
        """uint8 (B, F, H, W, 3) -> scaled latents (B, C, T, h, w)."""

    def velocity(
        self, transformer: torch.nn.Module, noisy: torch.Tensor, sigma: torch.Tensor, text: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's flow-matching prediction for noisy latents (B, C, T, h, w) at sigma (B,)."""

    def lora_targets(self, include_ffn: bool) -> list[str]:
        """peft target-module suffixes."""

    def save_lora(self, state_dict: dict[str, torch.Tensor], out_dir: str | Path) -> None:
        """Write the adapter in the format the family's diffusers loader reads."""

    def render(
        self, model_path: str, lora_dir: str | None, prompt: TextRow, negative: TextRow, settings: RenderSettings
    ) -> np.ndarray:
        """A video from cached embeddings: uint8 (F, H, W, 3)."""


class RenderSettings(Protocol):
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance: float
    seed: int
    flow_shift: float


def model_index(path: str | Path) -> dict[str, Any]:
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{path} is not a diffusers checkpoint folder (no model_index.json). "
            "Point `pretrained_model_name_or_path` at a local folder laid out like the Hugging Face repo."
        )
    return json.loads(index.read_text())


def check_layout(path: str | Path, flavour: Flavour) -> None:
    """Fail early, naming what is missing, when a checkpoint does not hold what the flavour needs."""
    index = model_index(path)
    missing = [c for c in flavour.components if not (Path(path) / c).is_dir() or index.get(c, [None])[0] is None]
    if missing:
        raise FileNotFoundError(
            f"{path} lacks component(s) {', '.join(missing)} that flavour '{flavour.name}' needs "
            f"(expected sub-folders: {', '.join(flavour.components)})"
        )


def load_component(path: str | Path, name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """Load one component with its real class's from_pretrained, as model_index.json names it.

    from_pretrained applies each model's `_keep_in_fp32_modules` (Kandinsky 5's modulation layers crash
    under a plain .to(bfloat16)), so dtype goes through it rather than through .to().
    """
    library, class_name = model_index(path)[name]
    cls = getattr(importlib.import_module(library), class_name)
    folder = str(Path(path) / name)
    if not hasattr(cls, "to"):  # tokenizers, schedulers, processors
        return cls.from_pretrained(folder)
    model = cls.from_pretrained(folder, torch_dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def component_fingerprint(path: str | Path, name: str) -> str:
    return content_key(component=name, files=directory_fingerprint(Path(path) / name))
