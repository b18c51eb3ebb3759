"""Peak memory and FLOPs of each stage, before any model loads: what `loraflow check` prints.

Nothing here reads weights. A model is built from its config.json on the meta device (`fake_model`; the fake-tensor
machinery and its counter are in `loraflow/kernels/fake_tensors.py`), then every
tensor it holds is replaced by a FakeTensor of the same shape, dtype and device: ops on fake tensors compute
shapes only, so the real code (the family's `velocity`, the flow-matching loss, autograd, diffusers' gradient
checkpointing) runs at released size in seconds and allocates nothing. Each number is then computed so:

- weights, LoRA: the bytes of the fake model's own tensors, in the configured precision (`_keep_in_fp32_modules`
  as `fp32_modules_storage` stores them: fp32 as from_pretrained keeps them, bf16 or fp8; fp8-layerwise stores the
  layers diffusers casts in 1 byte); group offloading keeps only the non-block modules and the groups on the
  accelerator (one group, two with streams: the next is prefetched); `blocks_to_swap` N takes the last N blocks off
  but the one computing (`offloaded`).
- LoRA: every parameter the configured adapter trains, built by training's own `add_adapter` (LoRA, DoRA's
  magnitude vectors, LoKr, LoHa: what peft leaves requiring grad, not a name prefix).
- optimizer: AdamW's two moments per LoRA parameter, fp32 (8 bytes per parameter) or bf16 with adamw_bf16 (4).
- activations: the peak of the bytes alive during one fake forward + backward of `training.loop.step_losses` (LoRA
  gradients and the batch's device copies included), counted by `StepCounter` from the storages every op
  returns. With gradient checkpointing diffusers' own checkpointing runs, so the saved block inputs and one
  block's recompute are what is counted. Activation offload (`gradient_checkpointing_cpu_offload`) runs too,
  holding its copies of the block inputs on the meta device: the counter counts those as host memory
  (`StageEstimate.host`, the stage's "(host)" row), not in the accelerator's peak; the copies back for each
  recompute are counted on the accelerator. (For a CPU device nothing moves: a CPU tensor's copy to the CPU is
  itself, in a run as in the fake step.) Attention keeps no N x N matrix (flash kernels: output and
  log-sum-exp); what kernels allocate inside themselves is added by formula where it is large:
  `attention_workspace` (the backward's fp32 dQ accumulator, and the CPU kernel's tiles) and `conv3d_columns`
  (the CPU 3D convolution's column buffer; none on CUDA).
- TFLOP: torch's flop-counter formulas over the same fake step (matmuls and convolutions; backward = 2x forward;
  a checkpointed block's forward is counted again when it is recomputed). The CPU flash-attention kernel that SDPA
  takes on fake CPU tensors has no formula in the counter: `attention_flops` gives it the counter's SDPA one,
  4 * B * heads * N_q * N_kv * d forward (QK^T and PV, 2 flops per multiply-add) and twice that backward.
  NABLA checkpoints (flex attention at their sparsity) run dense attention plus NABLA's measured block masks
  (`_attention_stand_in`); their rows say so.
- TREAD: the fake step is routed as `train_lora` routes it (`training.loop.routing`), so the tokens a route takes out
  skip its blocks in the fake step itself: the activations those blocks keep and their FLOPs (attention included)
  shrink with the selection ratio, and the routing's gathers and scatters are counted.
- i2v and i2i: the fake batch carries what the latents stage caches (`example_image_condition`: the conditioning
  latent, HunyuanVideo 1.5's SigLIP tokens), and the family's `velocity` builds the condition channels (latent,
  mask) and the image stream from it, so they are counted as any other tensor. The latents stage's image encoder
  (SigLIP) is left out of its row.
- validation: one render as the validation stage runs it (`render_phases`, `render_plan`): the transformer in the
  training precision, one no-grad denoise call and the VAE decode (in the transformer's dtype) of its latent,
  whole and tiled with diffusers' tiling (each tile's decoder run once per tile shape: `fake_tensors.measured_once`);
  then the plan for the card (`gpu_memory_gb`, else the GPU present): the transformer and the VAE take turns on the
  card (parked), plus the least of tiling, blocks swapped, every block streamed that fits it. Without a card, what the
  config asks. The pipeline's own small tensors (latents, the two guidance predictions) are left out.

The fake step runs on the CPU: with bf16 autocast where a CUDA run uses it (`training.loop.uses_autocast`), so the
activation dtypes are those of a GPU run. What is left out is said where it is: allocator rounding and
fragmentation (CUDA rounds to 512 bytes), CUDA/cuDNN workspaces and the CUDA context (about 0.5 GiB per process):
a stage fits a card when its peak and CUDA_CONTEXT are under FIT_SHARE (90%) of it, which keeps room for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow.kernels.checkpointing import enable_checkpointing
from loraflow.kernels.fake_tensors import NotFakeable, fake_model, measured_step, meta_model, tensor_bytes

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.render_memory import RenderPlan
    from loraflow.pipelines.sources import ModelSource

GIB = 2**30
CARDS_GB = (16, 24, 32, 48, 80, 141)  # common accelerator sizes; a card's "GB" is counted as GiB here
STAGES = ("latents", "text_embeds", "lora", "validation")
# What a card holds besides the estimate: the CUDA context of the process (0.5-1 GiB: CUDA's own state, cuBLAS and
# cuDNN handles) outside the allocator, and within it the cache and fragmentation the caching allocator keeps
# (5-10% of what it serves): a stage fits a card when its peak plus CUDA_CONTEXT is under FIT_SHARE of the card,
# and is "tight" up to all of it (a run may fit, or may not).
CUDA_CONTEXT = GIB // 2
FIT_SHARE = 0.9
FIT_MARKS = (f"✓: the peak + {CUDA_CONTEXT / GIB:.2g} GiB of CUDA context is under {FIT_SHARE:.0%} of the card; "
             "tight: under all of it; ✗: over it")


@dataclass(frozen=True)
class StageEstimate:
    """One stage's estimated accelerator peak, by what holds the bytes, and the TFLOP of one step (None: not
    estimated). `note` says what the number leaves out; `host`: the peak bytes the step holds in host memory
    instead (activation offload's copies), not in the peak."""

    stage: str
    parts: dict[str, int] = field(default_factory=dict)
    tflop: float | None = None
    note: str = ""
    host: int = 0

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, card_gb: float) -> bool:
        """Fits with the margin: peak + CUDA_CONTEXT under FIT_SHARE of the card."""
        return usable_bytes(card_gb) >= self.peak_bytes

    def mark(self, card_gb: float) -> str:
        """`check`'s table cell: ✓ (fits with the margin), tight (the peak and the context fit the whole card, not
        the margin) or ✗."""
        if self.fits(card_gb):
            return "✓"
        return "tight" if self.peak_bytes + CUDA_CONTEXT <= card_gb * GIB else "✗"


def usable_bytes(card_gb: float) -> int:
    """What an estimate may take of a card and still fit: FIT_SHARE of it, less the CUDA context."""
    return int(FIT_SHARE * card_gb * GIB) - CUDA_CONTEXT


# the stages -----------------------------------------------------------------------------------------------
def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real CPU tensors made by the code under test (torch.from_numpy in collate_text) become fake constants.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _dtype(precision: str) -> torch.dtype:
    import torch

    return torch.float32 if precision in ("no_change", "fp32") else torch.bfloat16


def weights_bytes(model: torch.nn.Module) -> int:
    """The frozen weights and buffers (not the adapter, whose parameters require grad)."""
    return tensor_bytes([p for p in model.parameters() if not p.requires_grad] + list(model.buffers()))


def offloaded_bytes(transformer: torch.nn.Module, config: LoraflowConfig, family: ModelFamily) -> int:
    """Frozen block weights kept off the accelerator (`block_bytes`, then `offloaded`)."""
    return offloaded(block_bytes(transformer, family), config.enable_group_offload, config.blocks_to_swap,
                     config.group_offload_blocks_per_group if config.group_offload_type == "block_level" else 1,
                     config.group_offload_use_stream)


def block_bytes(transformer: torch.nn.Module, family: ModelFamily) -> list[int]:
    """Each block's frozen weights, in the order the transformer holds them."""
    return [weights_bytes(b) for b in getattr(transformer, family.tread_layout.blocks)]


def offloaded(blocks: list[int], every_block: bool, blocks_to_swap: int, per_group: int = 1,
              stream: bool = False) -> int:
    """Of these blocks' bytes, those kept off the accelerator. Every block (group offloading) block_level: all but the
    group computing now and, with streams, the next one (prefetched); leaf_level (`per_group` 1): every block but
    one leaf at a time, counted as one block. `blocks_to_swap` N: the last N but the one computing now
    (`kernels/offload.py`: one diffusers group each, no prefetch). The LoRA stays resident
    (`training.loop.Trainable`)."""
    from loraflow.kernels.offload import swapped

    if every_block:
        return sum(blocks) - sum(sorted(blocks, reverse=True)[:per_group * (2 if stream else 1)])
    gone = [blocks[i] for i in swapped(len(blocks), blocks_to_swap)]
    return sum(gone) - max(gone, default=0)


def _transformer(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any], mode: Any,
                 precision: str) -> tuple[torch.nn.Module, list, torch.nn.Module]:
    """The fake transformer as `training.loop.load_transformer` prepares it (precision, the configured adapter in
    fp32), its adapter's parameters, and the model whose tensors are its frozen weights as stored (`weights_bytes`,
    `offloaded_bytes` count them). fp8-layerwise computes as bf16 does: the fake model is bf16, its weights are
    stored as a meta model with layerwise casting stores them (1 byte each where diffusers casts); int8
    weight-only is counted the same way (its per-channel scales are left out)."""
    import torch

    from loraflow.training.adapters import add_adapter

    def adapter(model: torch.nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):  # add_adapter seeds torch's generator: the caller's is left as it was
            add_adapter(model, config, family.lora_targets(config.lora_include_ffn))

    transformer = fake_model(meta_model(transformer_config, _dtype(precision), adapter), mode)
    lora = [p for p in transformer.parameters() if p.requires_grad]
    return transformer, lora, stored_model(transformer_config, precision, config.fp32_modules_storage)


def stored_model(transformer_config: Mapping[str, Any], precision: str, kept: str) -> torch.nn.Module:
    """The transformer on the meta device with its frozen weights in the dtypes `base_model_precision` stores them
    in (fp8 and int8: 1 byte where diffusers' layerwise casting casts), its fp32-kept modules as `kept` says
    (`fp32_modules_storage`, kernels/quantize.py `store_kept`)."""
    from loraflow.kernels.quantize import ONE_BYTE_PRECISIONS, store_kept

    one_byte = precision in ONE_BYTE_PRECISIONS
    stored = meta_model(transformer_config, _dtype(precision), fp8=one_byte)
    if precision != "no_change":
        store_kept(stored, kept)
    return stored


def _velocity_call(family: ModelFamily, transformer: torch.nn.Module, latent_shape: tuple[int, ...], batch: int,
                   autocast: bool, training: LoraflowConfig | None,
                   text_tokens: int | None = None) -> Callable[[], None]:
    """One transformer call on zeros of the batch's shapes: with a `training` config, `step_losses` + backward routed
    by its TREAD as `train_lora` routes it (the routed tokens skip those blocks, in the activations and the FLOPs
    counted); without, a render's no-grad velocity. The batch is made inside, as its device copies are made in a
    run; i2v and i2i rows carry their image condition (`example_image_condition`: the conditioning latent, and
    HunyuanVideo 1.5's SigLIP tokens, which open its image stream)."""
    import torch

    from loraflow.training.loop import routing, step_losses
    from loraflow.training.batches import MicroBatch, StepDraws
    from loraflow.pipelines.base import image_conditions

    device = torch.device("cpu")  # fake tensors on the CPU stand for the accelerator's

    def call() -> None:
        shape, tokens = (batch, *latent_shape), text_tokens or family.max_text_tokens
        # collate_text's .to(device) copies the rows into fake tensors: the device copies of a GPU run
        # the model's config: the given one with every default filled in
        text = family.collate_text([family.example_text_row(transformer.config, tokens)] * batch, device)
        text.update(image_conditions([family.example_image_condition(transformer.config, latent_shape)] * batch))
        draws = StepDraws(drop_caption=False, noise=torch.zeros(shape), sigma=torch.full((batch,), 0.5), seed=0)
        micro = MicroBatch(samples=[], x0=torch.zeros(shape), text=text, draws=draws)
        if training is not None:
            with routing(transformer, family, training, draws.seed):
                step_losses(transformer, family, micro, device, autocast)[0].backward()
            return
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            family.velocity(transformer, micro.x0, draws.sigma, text)

    return call


def nabla_masks(transformer_config: Mapping[str, Any], latent_shape: tuple[int, ...], batch: int,
                device_type: str = "cuda") -> tuple[int, int]:
    """NABLA's block masks at this latent (C, T, h, w): (the peak bytes of building one attention's mask beyond its
    q and k, the bytes of the BlockMask it returns, which flex attention keeps for its backward). Measured by running
    diffusers' own `nablaT_v2` on fake q and k of the attention's shape with the pipeline's STA mask
    (`fast_sta_nabla`), as every self-attention of a NABLA checkpoint does."""
    import torch
    from diffusers import Kandinsky5T2VPipeline
    from diffusers.models.transformers.transformer_kandinsky import nablaT_v2

    from loraflow.kernels.fake_tensors import tensor_bytes

    config = transformer_config
    head_dim = sum(config["axes_dims"])
    _, frames, height, width = latent_shape
    t, h, w = frames, height // config["patch_size"][1], width // config["patch_size"][2]
    shape = (batch, t * h * w, config["model_dim"] // head_dim, head_dim)
    masks: list[Any] = []

    def build() -> None:
        q, k = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        sta = Kandinsky5T2VPipeline.fast_sta_nabla(t, h // 8, w // 8, config["attention_wT"], config["attention_wH"],
                                                   config["attention_wW"], device="cpu")
        with torch.no_grad():
            masks.append(nablaT_v2(q, k, sta[None, None], thr=config["attention_P"]))

    peak, _, _ = measured_step(build, _fake_mode(), torch.nn.Module(), device_type)
    mask = masks[0]
    kept = tensor_bytes([part for part in mask.as_tuple() if isinstance(part, torch.Tensor)])
    return peak - 2 * batch * shape[1] * shape[2] * head_dim * 2, kept


def _attention_stand_in(config: LoraflowConfig | None, transformer_config: Mapping[str, Any],
                        latent_shape: tuple[int, ...], batch: int,
                        device_type: str) -> tuple[Mapping[str, Any], dict[str, int], str]:
    """The transformer config the fake step runs, the bytes it leaves out, and the note saying so. NABLA (Kandinsky
    5's 10 s checkpoints, Pro in its HD mode) runs flex attention, which fake tensors cannot take a backward of: the
    step runs the same model with dense attention, whose kept tensors (output, log-sum-exp) are flex's too, and NABLA's
    block masks are added (`nabla_masks`): one being built, plus, in training, the one each block keeps for its
    backward (every visual block's without gradient checkpointing; the recomputed one's with it). TFLOP are dense:
    an upper bound (NABLA skips the blocks outside its P-CDF, a share only the real q and k decide)."""
    if transformer_config.get("attention_type") != "nabla":
        return transformer_config, {}, ""
    building, kept = nabla_masks(transformer_config, latent_shape, batch, device_type)
    blocks = transformer_config["num_visual_blocks"]
    if config is None:  # a render: no backward keeps masks
        saved = 0
    elif config.gradient_checkpointing:  # the blocks the interval leaves unchecked keep theirs, and the recomputed one
        saved = blocks - len(range(0, blocks, config.gradient_checkpointing_interval)) + 1
    else:
        saved = blocks
    note = (f"NABLA (P {transformer_config['attention_P']}): dense attention + its block masks; TFLOP dense, an upper "
            "bound")
    return {**transformer_config, "attention_type": "flash"}, {"nabla masks": building + saved * kept}, note


def training_step(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                  latent_shape: tuple[int, int, int, int], device_type: str = "cuda",
                  text_tokens: int | None = None) -> StageEstimate:
    """One optimizer step of the lora stage at the largest bucket's latent (C, T, h, w), `train_batch_size` samples,
    `text_tokens` caption tokens (default `max_text_tokens`: the longest a caption can be), on a `device_type`
    accelerator:
    weights + LoRA + AdamW moments + the fake step's activation peak (LoRA gradients included)."""
    import torch
    from peft.tuners.lycoris_utils import LycorisLayer

    from loraflow.training.loop import uses_autocast

    transformer_config, nabla, note = _attention_stand_in(config, transformer_config, latent_shape,
                                                          config.train_batch_size, device_type)
    mode = _fake_mode()
    transformer, lora, stored = _transformer(config, family, transformer_config, mode, config.base_model_precision)
    # activation offload's copies go to the meta device, which the counter counts as host memory (a CPU run's
    # offload moves nothing)
    enable_checkpointing(transformer, config, host="cpu" if device_type == "cpu" else "meta")
    transformer.train()
    # LoKr and LoHa layers read torch.rand(1) > module_dropout in each training forward, a value fake tensors lack:
    # they run as in eval, applying the adapter (the larger peak; the rank_dropout mask, a vector per layer, left out)
    for module in transformer.modules():
        if isinstance(module, LycorisLayer):
            module.training = False
    autocast = uses_autocast(config, torch.device(device_type))
    step = _velocity_call(family, transformer, latent_shape, config.train_batch_size, autocast, config,
                          text_tokens=text_tokens)
    try:
        activations, tflop, host = measured_step(step, mode, transformer, device_type)
    except NotFakeable as exc:
        return StageEstimate("lora", note=str(exc))
    weights = weights_bytes(stored)
    if config.enable_group_offload or config.blocks_to_swap:  # the blocks as stored: 1 byte per weight with fp8/int8
        weights -= offloaded_bytes(stored, config, family)
    moments = 2 * sum(p.numel() for p in lora) * (2 if config.optimizer == "adamw_bf16" else 4)
    return StageEstimate("lora", {"weights": weights, "lora": tensor_bytes(lora), "optimizer": moments,
                                  "activations": activations, **nabla}, tflop, note, host=host)


def vae_encode(config: LoraflowConfig, family: ModelFamily, vae_config: Mapping[str, Any],
               frames: int, height: int, width: int, device_type: str = "cuda") -> StageEstimate:
    """The latents stage encoding one clip of the largest bucket: fp32 VAE weights + the peak of a fake
    no-grad `family.vae_encode` with the configured patch conv / tiling / slicing (`stages.latents.latents.prepare_vae`)."""
    import torch

    from loraflow.stages.latents.latents import prepare_vae

    mode = _fake_mode()
    vae = fake_model(meta_model(vae_config, torch.float32), mode)
    prepare_vae(vae, config)

    def encode() -> None:
        with torch.no_grad():
            family.vae_encode(vae, torch.zeros((1, frames, height, width, 3), dtype=torch.uint8),
                              config.latent_sampling)

    activations, tflop, _ = measured_step(encode, mode, vae, device_type)
    note = "" if not family.image_condition_components else \
        f"{', '.join(family.image_condition_components)} left out"
    return StageEstimate("latents", {"weights": weights_bytes(vae), "activations": activations}, tflop, note)


def text_encoders(config: LoraflowConfig, family: ModelFamily,
                  component_configs: Mapping[str, Mapping[str, Any]]) -> StageEstimate:
    """The text_embeds stage: the text encoders' weights (the first in `text_encoder_1_precision`: fp32 4 bytes, bf16
    2, int8-torchao `int8_bytes`), all on the accelerator at once unless offload_during_startup (then the largest
    alone). Their activations (one prompt, no grad) are left out."""
    encoders = [c for c in family.text_components if c in component_configs]
    sizes = []
    for name in encoders:
        precision = config.text_encoder_1_precision if name == "text_encoder" else "fp32"
        model = meta_model(component_configs[name], _dtype(precision))
        sizes.append(int8_bytes(model) if precision == "int8-torchao" else weights_bytes(model))
    weights = max(sizes, default=0) if config.offload_during_startup else sum(sizes)
    return StageEstimate("text_embeds", {"weights": weights}, None, "weights only")


def int8_bytes(model: torch.nn.Module) -> int:
    """A bf16 model's bytes with every linear weight stored as `kernels/quantize.py` stores it: 1 byte per weight,
    and per output row an fp32 scale and an int8 zero point; the rest (embeddings, norms, biases) bf16."""
    import torch

    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(w.numel() + 5 * w.shape[0] for w in linear)
    return weights_bytes(model) - tensor_bytes(linear) + quantized


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
    nabla: int = 0  # NABLA's block masks during the denoise (`_attention_stand_in`)
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
                  latent_shape: tuple[int, int, int, int], device_type: str = "cuda") -> RenderPhases | StageEstimate:
    """The phases of a render at this latent size with the transformer stored in the training precision (what
    `load_renderer` does with a `RenderPlan`): a fake no-grad denoise call (bf16 compute unless fp32), and the fake
    VAE decode of its latent, whole and with diffusers' tiling. A StageEstimate with the reason where it cannot be
    estimated."""
    import torch

    from loraflow.kernels.quantize import frozen_dtype

    transformer_config, nabla, note = _attention_stand_in(None, component_configs["transformer"], latent_shape, 1,
                                                          device_type)
    mode = _fake_mode()
    precision = config.base_model_precision
    transformer, lora, stored = _transformer(config, family, transformer_config, mode, precision)
    denoise = _velocity_call(family, transformer, latent_shape, 1, precision != "no_change", None)
    try:
        denoise_peak, tflop, _ = measured_step(denoise, mode, transformer, device_type)
    except NotFakeable as exc:
        return StageEstimate("validation", note=str(exc))
    dtype = frozen_dtype(precision)  # the VAE computes in the transformer's dtype (`load_pipeline`)
    vae = fake_model(meta_model(component_configs["vae"], dtype), mode)
    moved = weights_bytes(vae) + sum(weights_bytes(meta_model(component_configs[c], torch.float32))
                                     for c in family.image_condition_components if c in component_configs)

    def decode() -> None:
        latent = torch.zeros((1, *latent_shape), dtype=dtype)
        with torch.no_grad(), blends_in_place(vae):  # an image family's VAE (Flux) is 2D: its pipeline decodes
            vae.decode(latent[:, :, 0] if family.flavour.num_frames == 1 else latent)  # (B, C, h, w)

    decode_peak, _, _ = measured_step(decode, mode, vae, device_type)
    tiled = None
    if hasattr(vae, "enable_tiling"):
        vae.enable_tiling()  # the decoder runs once per tile shape (`measured_once`): dozens of tiles at 720p
        tiled, _, _ = measured_step(decode, mode, vae, device_type, repeated=[vae.decoder])
    return RenderPhases(weights_bytes(stored), block_bytes(stored, family), tensor_bytes(lora), moved, denoise_peak,
                        decode_peak, tiled, tflop, sum(nabla.values()), note)


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
                       offload_all=config.enable_group_offload, vae_tiling=config.vae_enable_tiling)
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


# 3. a config's table, and what would make it fit ------------------------------------------------------------
def component_configs(folders: Mapping[str, Path]) -> dict[str, dict]:
    """Each model component's config.json (tokenizers and schedulers have none), read from its folder."""
    files = {name: Path(folder) / "config.json" for name, folder in folders.items()}
    return {name: json.loads(f.read_text()) for name, f in files.items() if f.is_file()}


def released_configs(config: LoraflowConfig) -> dict[str, str] | None:
    """{component: file in loraflow/pipelines/released/} for a config whose model is its flavour's own released
    repository (the default source), for estimates before it is downloaded; None for any other model."""
    from loraflow.pipelines import released

    flavour = config.flavour
    if config.pretrained_model_name_or_path != flavour.repo or flavour.name not in released.FLAVOURS:
        return None
    return {c: released.file_name(flavour.name, c) for c in flavour.components if c in released.FLAVOURS[flavour.name]}


def configured_buckets(config: LoraflowConfig, family: ModelFamily, model: ModelSource | str) -> list[str]:
    """The bucket label each training dataset asks for before it has clips: a square source at its `resolution`
    (bucketed as `stages.clips.clips.plan_clips` buckets one: in multiples of 128 px for a NABLA transformer) and its
    `video.num_frames` (1 for an image dataset)."""
    from loraflow.pipelines import bucket_multiple
    from loraflow.stages.clips.buckets import bucket_label, bucket_size

    labels = []
    multiple = bucket_multiple(family, model)
    for d in config.training_datasets:
        height, width = bucket_size(d.resolution, d.resolution, d.resolution, multiple,
                                    d.resolution_type, d.crop_aspect, d.crop_aspect_buckets)
        labels.append(bucket_label(height, width, 1 if d.dataset_type == "image" else d.video.num_frames))
    return labels


def largest_bucket(labels: Iterable[str]) -> tuple[int, int, int]:
    """(frames, height, width) of the largest of these bucket labels (WIDTHxHEIGHT@FRAMES, `stages.clips.buckets`)."""
    sizes = [tuple(int(n) for n in label.replace("@", "x").split("x")) for label in labels]
    width, height, frames = max(sizes, key=lambda s: s[0] * s[1] * s[2])
    return frames, height, width


def stage_estimate(config: LoraflowConfig, family: ModelFamily, model: ModelSource, stage: str,
                   buckets: Iterable[str], device_type: str) -> StageEstimate:
    """One stage's estimate for the model on disk and these buckets: what the `latents` and `lora` assets show
    beside the peak they measured."""
    configs = component_configs({c: model.folder(c) for c in config.flavour.components})
    return next(e for e in estimate(config, family, configs, largest_bucket(buckets), device_type, (stage,)))


def estimate(config: LoraflowConfig, family: ModelFamily, configs: Mapping[str, Mapping[str, Any]],
             bucket: tuple[int, int, int], device_type: str = "cuda",
             stages: tuple[str, ...] = STAGES) -> list[StageEstimate]:
    """`stages` for the config's largest bucket (frames, height, width) and its validation size, from the
    components' config dicts only (`component_configs`, or a released config: no weights are read)."""
    from loraflow.stages.clips.buckets import vae_geometry
    from loraflow.pipelines import plan_family

    frames, height, width = bucket
    configs = {**configs, "transformer": family.flavour.configured(configs["transformer"])}  # Pro's SD/HD mode
    geometry = vae_geometry(dict(configs["vae"]), family)
    latent = geometry.shape(frames, height, width)
    # validation renders at `validation_resolution`, else at the default or (an i2v pipeline that sizes the render
    # from its image) at that image's size bucket: the largest training bucket's size stands for it
    sized_by_image = config.validation_size is None and plan_family(config).spec.render_size is not None
    val_height, val_width = (height, width) if sized_by_image else (config.validation_size or family.flavour.size)
    val_frames = config.validation_num_video_frames or family.flavour.num_frames
    run = {"latents": lambda: vae_encode(config, family, configs["vae"], frames, height, width, device_type),
           "text_embeds": lambda: text_encoders(config, family, configs),
           "lora": lambda: training_step(config, family, configs["transformer"], latent, device_type),
           "validation": lambda: validation(config, family, configs, geometry.shape(val_frames, val_height, val_width),
                                            device_type, card_gb(config)[0])}
    return [run[stage]() for stage in stages]


KEPT = {"fp32_modules_storage": "bf16"}  # what a config that switches to a bf16/fp8 base gets (its validator)
# Per stage, the settings that lower its peak, by name as the config takes them: each alone, then all together.
# Validation renders in training's precision and chooses its offload and tiling itself (`render_plan`); what is left
# to switch is the precision, which training shares.
SWITCHES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "latents": (
        ("vae_enable_tiling: true", {"vae_enable_tiling": True}),
        ("vae_enable_patch_conv: true", {"vae_enable_patch_conv": True}),
    ),
    "text_embeds": (
        ("text_encoder_1_precision: bf16", {"text_encoder_1_precision": "bf16"}),
        ("text_encoder_1_precision: int8-torchao", {"text_encoder_1_precision": "int8-torchao"}),
        ("offload_during_startup: true", {"offload_during_startup": True}),
    ),
    "lora": (
        ("gradient_checkpointing: true", {"gradient_checkpointing": True}),
        ("gradient_checkpointing_cpu_offload: true", {"gradient_checkpointing": True,
                                                      "gradient_checkpointing_cpu_offload": True}),
        ("base_model_precision: fp8-layerwise", {"base_model_precision": "fp8-layerwise", **KEPT}),
        ("enable_group_offload: true", {"enable_group_offload": True, "blocks_to_swap": 0}),
        ("optimizer: adamw_bf16", {"optimizer": "adamw_bf16"}),
        ("train_batch_size: 1", {"train_batch_size": 1}),
    ),
    "validation": (
        ("base_model_precision: bf16", {"base_model_precision": "bf16", **KEPT}),
        ("base_model_precision: fp8-layerwise", {"base_model_precision": "fp8-layerwise", **KEPT}),
    ),
}


def switches(config: LoraflowConfig, family: ModelFamily, configs: Mapping[str, Mapping[str, Any]],
             bucket: tuple[int, int, int], stage: str = "lora", device_type: str = "cuda",
             now: StageEstimate | None = None) -> list[tuple[str, StageEstimate]]:
    """The stage's estimate with each of its SWITCHES the config does not use yet, then with all of them; for the
    lora stage with a card (`card_gb`) also the smallest `blocks_to_swap` that fits it (on top of the config, else
    of gradient checkpointing), from `now` (the stage's estimate as configured) where given."""
    unused = [(label, change) for label, change in SWITCHES[stage]
              if any(getattr(config, k) != v for k, v in change.items())]
    if len(unused) > 1:
        unused.append(("all of the above", {k: v for _, change in unused for k, v in change.items()}))
    rows = [(label, next(iter(estimate(config.model_copy(update=change), family, configs, bucket, device_type,
                                       (stage,))))) for label, change in unused]
    card, _ = card_gb(config)
    if stage == "lora" and card is not None and not config.enable_group_offload:
        now = now or next(iter(estimate(config, family, configs, bucket, device_type, ("lora",))))
        checkpointed = dict(rows).get("gradient_checkpointing: true")
        for prefix, base in (("", now), ("gradient_checkpointing: true + ", checkpointed)):
            swap = swap_to_fit(config, family, configs["transformer"], base, card) if base else None
            if swap is not None:
                rows.append((f"{prefix}{swap[0]}", swap[1]))
                break
    return rows


def swap_to_fit(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                now: StageEstimate, card: float) -> tuple[str, StageEstimate] | None:
    """`blocks_to_swap: N`, the smallest N that makes `now` (a training estimate of `config`) fit `card`, with its
    estimate: the weights it takes off the accelerator (`offloaded`, the blocks as stored), the rest unchanged."""
    from dataclasses import replace

    if not now.parts:
        return None
    stored = stored_model(transformer_config, config.base_model_precision, config.fp32_modules_storage)
    blocks = block_bytes(stored, family)
    before = offloaded(blocks, False, config.blocks_to_swap)
    for n in range(config.blocks_to_swap + 1, len(blocks) + 1):
        parts = {**now.parts, "weights": now.parts["weights"] - (offloaded(blocks, False, n) - before)}
        swapped = replace(now, parts=parts)
        if swapped.fits(card):
            return f"blocks_to_swap: {n} (of {len(blocks)})", swapped
    return None


# 4. remembered: a check of an unchanged config answers from its last estimate ----------------------------------

@cache
def code_version() -> str:
    """What the estimates' numbers depend on besides their inputs: the loraflow package's source and the versions of
    the libraries that build and trace the models."""
    import hashlib
    from importlib.metadata import version

    digest = hashlib.sha256()
    package = Path(__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for library in ("torch", "diffusers", "transformers", "peft"):
        digest.update(f"{library}=={version(library)}".encode())
    return digest.hexdigest()[:16]


def estimates_cache() -> Path:
    """Where `remembered` keeps estimates: $LORAFLOW_ESTIMATES_CACHE, else the XDG user cache (as huggingface_hub
    keeps its own)."""
    import os

    if os.environ.get("LORAFLOW_ESTIMATES_CACHE"):
        return Path(os.environ["LORAFLOW_ESTIMATES_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loraflow" / "estimates"


def remembered(config: LoraflowConfig, what: str, inputs: Mapping[str, Any],
               compute: Callable[[], list]) -> tuple[list, Path | None]:
    """`compute()` (a list of StageEstimates, or of (label, StageEstimate)), or the list a call with the same config,
    `inputs` and `code_version` stored (JSON, written atomically) in the user's cache folder (`estimates_cache`:
    `$XDG_CACHE_HOME/loraflow/estimates`, default ~/.cache; check writes nothing into the project's caches); and
    the file it was read from (None: computed now). The fake-tensor traces take minutes at released size: a second
    `check` of an unchanged config takes seconds."""
    from dataclasses import asdict

    from loraflow.keys import content_key
    from loraflow.store import write_json

    key = content_key(what=what, config=config.model_dump(mode="json"), inputs=inputs, code=code_version())
    path = estimates_cache() / f"{what}-{key}.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        rows = None
    if isinstance(rows, list):
        return [(label, StageEstimate(**row)) if label is not None else StageEstimate(**row) for label, row in rows], \
            path
    result = compute()
    rows = [[item[0], asdict(item[1])] if isinstance(item, tuple) else [None, asdict(item)] for item in result]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, rows)
    except OSError:  # a read-only cache folder: the estimate stands, unremembered
        pass
    return result, None


def card_gb(config: LoraflowConfig) -> tuple[float | None, str]:
    """The accelerator to fit: `gpu_memory_gb`, else the CUDA GPU this machine has, else none."""
    if config.gpu_memory_gb is not None:
        return config.gpu_memory_gb, "gpu_memory_gb"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    return None, ""


def estimate_rows(estimates: list[StageEstimate]) -> list[tuple[str, ...]]:
    """`loraflow check`'s table: stage, peak GiB, TFLOP, then ✓ / tight / ✗ per card of CARDS_GB (`StageEstimate.mark`,
    FIT_MARKS); below a stage that holds host memory, a "(host)" row with its GiB."""
    rows = []
    for e in estimates:
        if not e.parts:
            rows.append((e.stage, "-", "-", *("-" for _ in CARDS_GB), e.note))
            continue
        tflop = "-" if e.tflop is None else f"{e.tflop:.4g}"
        rows.append((e.stage, f"{e.peak_gib:.3g}", tflop, *(e.mark(gb) for gb in CARDS_GB), e.note))
        if e.host:
            rows.append((f"{e.stage} (host)", f"{e.host / GIB:.3g}", "-", *("-" for _ in CARDS_GB),
                         "CPU memory, not the accelerator's: activation offload's copies of the blocks' inputs"))
    return rows
