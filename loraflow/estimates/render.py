"""One validation render: what it holds on the accelerator in each phase (`RenderPhases`, measured by
`render_phases`: a denoise call and the VAE decode, whole and tiled), the plan the validation stage renders with for
a card (`render_plan`, `validation_plan`: parked, tiled, blocks swapped or streamed, the least that fits) and the
validation row of `loraflow check` (`validation`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraflow.estimates.fake_tensors import Measured, NotFakeable, fake_model, measured_step, meta_model
from loraflow.estimates.fit import StageEstimate, card_gb, usable_bytes
from loraflow.estimates.inputs import component_configs
from loraflow.estimates.transformer import (
    adapter_size,
    attention_stand_in,
    estimate_mode,
    fake_transformer,
    offloaded,
    stored_weights,
    traced_at_depth,
    velocity_call,
    weights_bytes,
)

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.render_memory import RenderPlan
    from loraflow.pipelines.sources import ModelSource


@dataclass(frozen=True)
class RenderPhases:
    """What one validation render holds on the accelerator, from which the bytes of any `RenderPlan` follow: the
    transformer as stored in the training precision (its blocks apart), its LoRA, the parts that move with the VAE
    (the VAE, HunyuanVideo 1.5 i2v's image encoder), and the activation peaks of one no-grad denoise call and of the
    VAE decode, whole and tiled (None: the VAE has no tiling)."""

    transformer: int
    blocks: list[int]
    lora: int
    vae: int
    denoise: int
    decode: int
    decode_tiled: int | None
    tflop: float
    nabla: int = 0  # NABLA's block masks during the denoise (`attention_stand_in`)
    note: str = ""

    def resident(self, plan: RenderPlan) -> int:
        """The transformer's bytes on the accelerator while it denoises (the LoRA apart)."""
        return self.transformer - offloaded(self.blocks, plan.offload_all, plan.blocks_to_swap, 1, plan.offload_all)

    def phases(self, plan: RenderPlan) -> dict[str, dict[str, int]]:
        """{"denoise": parts, "decode": parts}. Parked: the VAE is off the accelerator while the transformer runs, and
        the transformer (all of it that is resident) while the VAE runs; every block streamed leaves nothing of the
        transformer behind either."""
        transformer = self.resident(plan) + self.lora
        left = 0 if plan.park or plan.offload_all else transformer
        decode = self.decode_tiled if plan.vae_tiling and self.decode_tiled is not None else self.decode
        nabla = {"nabla masks": self.nabla} if self.nabla else {}
        return {"denoise": {"weights": transformer - self.lora + (0 if plan.park else self.vae), "lora": self.lora,
                            "activations": self.denoise, **nabla},
                "decode": {"weights": self.vae + left, "activations": decode}}

    def estimate(self, plan: RenderPlan) -> StageEstimate:
        """The larger phase's parts, and the plan in the note."""
        phases = self.phases(plan)
        phase = max(phases, key=lambda name: sum(phases[name].values()))
        note = "; ".join(n for n in (f"{plan.describe()}; peak in the {phase}", self.note) if n)
        return StageEstimate("validation", phases[phase], self.tflop, note)


def render_phases(config: LoraflowConfig, family: ModelFamily, component_configs: Mapping[str, Mapping[str, Any]],
                  latent_shape: tuple[int, int, int, int], device_type: str = "cuda",
                  extend: bool = True) -> RenderPhases | StageEstimate:
    """The phases of a render at this latent size with the transformer stored in the training precision (what
    `load_renderer` does with a `RenderPlan`): a fake no-grad denoise call (bf16 compute unless fp32), and the fake
    VAE decode of its latent, whole and with diffusers' tiling. The denoise call is traced shallow and extended to the
    transformer's depth (`traced_at_depth`; `extend` False: at its depth). A StageEstimate with the reason where it
    cannot be estimated."""
    import torch

    from loraflow.kernels.quantize import frozen_dtype

    transformer_config, nabla, note = attention_stand_in(None, component_configs["transformer"], latent_shape, 1,
                                                          device_type)
    precision = config.base_model_precision

    def denoise(shaped: Mapping[str, Any]) -> Measured:
        mode = estimate_mode()
        transformer = fake_transformer(config, family, shaped, mode, precision)
        call = velocity_call(family, transformer, latent_shape, 1, precision != "no_change", None)
        return measured_step(call, mode, transformer, device_type)

    try:  # a no-grad call: its peak is one block's, whatever the depth; its FLOPs grow by one block's per block
        denoised = Measured._make(traced_at_depth(family, transformer_config, extend, denoise))
    except NotFakeable as exc:
        return StageEstimate("validation", note=str(exc))
    _, lora = adapter_size(config, family, transformer_config, extend)
    stored = stored_weights(family, transformer_config, precision, config.fp32_modules_storage)
    mode = estimate_mode()
    dtype = frozen_dtype(precision)  # the VAE computes in the transformer's dtype (`load_pipeline`)
    vae = fake_model(meta_model(component_configs["vae"], dtype), mode)
    family.setup_vae(vae)
    moved = weights_bytes(vae) + sum(weights_bytes(meta_model(component_configs[c], torch.float32))
                                     for c in family.image_condition_components if c in component_configs)

    def decode() -> None:
        latent = torch.zeros((1, *latent_shape), dtype=dtype)
        with torch.no_grad(), blends_in_place(vae):  # an image family's VAE (Flux) is 2D: its pipeline decodes
            vae.decode(latent[:, :, 0] if family.flavour.num_frames == 1 else latent)  # (B, C, h, w)

    decode_peak = measured_step(decode, mode, vae, device_type).peak
    tiled = None
    if hasattr(vae, "enable_tiling"):
        vae.enable_tiling()  # the decoder runs once per tile shape (`measured_once`): dozens of tiles at 720p
        tiled = measured_step(decode, mode, vae, device_type, repeated=[vae.decoder]).peak
    return RenderPhases(stored.total, stored.blocks, lora, moved, denoised.peak,
                        decode_peak, tiled, denoised.tflop, sum(nabla.values()), note)


@contextmanager
def blends_in_place(vae: torch.nn.Module) -> Iterator[None]:
    """The tiled decode's seam blending (`blend_v`, `blend_h`, `blend_t` of diffusers' video and image VAEs) as the
    identity while estimating: each writes one pixel row of the next tile in place per step, a Python loop of
    thousands of ops on fake tensors at released size, holding a row's temporaries (a few MB: left out)."""
    names = [n for n in ("blend_v", "blend_h", "blend_t") if hasattr(vae, n)]
    for name in names:
        setattr(vae, name, lambda a, b, extent: b)
    try:
        yield
    finally:
        for name in names:
            delattr(vae, name)


def render_plan(config: LoraflowConfig, phases: RenderPhases | None, card_gb: float | None) -> RenderPlan:
    """How a render holds its models: what the config asks (`base_model_precision`, `vae_enable_tiling`,
    `enable_group_offload`, `blocks_to_swap`) and, for a known card, the transformer and the VAE taking turns on it
    (parked), as the peer's renderer does (musubi-tuner's kandinsky5_generate_video.py moves the DiT to the CPU and
    frees it before it loads the VAE to decode; exact, and one move of the transformer each way per render against
    minutes of denoising), plus the least added that fits the card with the margin (`usable_bytes`): nothing, then
    tiling (approximate); then each with 1, 2, ... blocks swapped, then every block streamed. None fits: the last (the
    least memory)."""
    from dataclasses import replace

    from loraflow.pipelines.render_memory import RenderPlan

    asked = RenderPlan(precision=config.base_model_precision, kept=config.fp32_modules_storage,
                       blocks_to_swap=config.blocks_to_swap,
                       offload_all=config.enable_group_offload, vae_tiling=config.vae_enable_tiling,
                       attention_backend=config.attention_backend)
    if card_gb is None or phases is None:
        return asked
    tilings = [False, True] if phases.decode_tiled is not None else [False]
    swaps = [asked] if asked.offload_all else \
        [replace(asked, blocks_to_swap=n) for n in range(asked.blocks_to_swap, len(phases.blocks) + 1)] + \
        [replace(asked, blocks_to_swap=0, offload_all=True)]
    plans = [replace(p, park=True, vae_tiling=p.vae_tiling or tiled) for p in swaps for tiled in tilings]
    usable = usable_bytes(card_gb)
    return next((p for p in plans if phases.estimate(p).peak_bytes <= usable), plans[-1])


def validation_plan(config: LoraflowConfig, family: ModelFamily, model: ModelSource, frames: int, height: int,
                    width: int) -> RenderPlan:
    """The plan the validation stage renders with at this size: `render_plan` for the card (`card_gb`) from the
    model's config files; without a card, or where the render cannot be estimated, what the config asks."""
    from loraflow.stages.clips.buckets import vae_geometry

    card, _ = card_gb(config)
    configs = component_configs({c: model.folder(c) for c in config.flavour.components}) if card else {}
    phases = None
    if configs:
        latent = vae_geometry(dict(configs["vae"]), family).shape(frames, height, width)
        configs = {**configs, "transformer": family.flavour.configured(configs["transformer"])}  # Pro's SD/HD mode
        phases = render_phases(config, family, configs, latent, "cuda")
    return render_plan(config, phases if isinstance(phases, RenderPhases) else None, card)


def validation(config: LoraflowConfig, family: ModelFamily, component_configs: Mapping[str, Mapping[str, Any]],
               latent_shape: tuple[int, int, int, int], device_type: str = "cuda",
               card: float | None = None) -> StageEstimate:
    """One validation render as the validation stage runs it: `render_phases` under the `render_plan` it chooses for
    `card` (GiB; None: what the config asks)."""
    phases = render_phases(config, family, component_configs, latent_shape, device_type)
    if isinstance(phases, StageEstimate):
        return phases
    return phases.estimate(render_plan(config, phases, card))
