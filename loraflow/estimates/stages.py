"""The estimates of the stages that are not a render: the lora stage's optimizer step (`training_step`), the
latents stage's VAE encode (`vae_encode`), the text_embeds stage's encoders (`text_encoders`) and the captions
stage's captioner (`captioner_weights`, with `caption_strategy: auto`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loraflow.estimates.fake_tensors import Measured, NotFakeable, fake_model, measured_step, meta_model, tensor_bytes
from loraflow.estimates.fit import StageEstimate
from loraflow.estimates.transformer import (
    adapter_size,
    attention_stand_in,
    estimate_mode,
    fake_transformer,
    model_dtype,
    offloaded_bytes,
    stored_weights,
    traced_at_depth,
    velocity_call,
    weights_bytes,
)
from loraflow.kernels.checkpointing import enable_checkpointing

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily


def training_step(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                  latent_shape: tuple[int, int, int, int], device_type: str = "cuda",
                  text_tokens: int | None = None, extend: bool = True) -> StageEstimate:
    """One optimizer step of the lora stage at the largest bucket's latent (C, T, h, w), `train_batch_size` samples,
    `text_tokens` caption tokens (default `max_text_tokens`: the longest a caption can be), on a `device_type`
    accelerator:
    weights + LoRA + AdamW moments + the fake step's activation peak (LoRA gradients included). The step is traced
    shallow and extended to the real depth (`traced_at_depth`) where it is linear in the depth (`linear_in_depth`);
    `extend` False: traced at the real depth. A config whose step the fake model computes alike (`step_key`) reuses
    the trace made for another: a check's switch rows that change only what is added around it, and activation
    offload on or off (one trace counts both: `traced_step`)."""
    transformer_config, nabla, note = attention_stand_in(config, transformer_config, latent_shape,
                                                          config.train_batch_size, device_type)
    extend = extend and linear_in_depth(config)
    import torch

    threads = torch.get_num_threads() if device_type == "cpu" else None  # the CPU attention's workspace asks them
    key = step_key(config, transformer_config, latent_shape, device_type, text_tokens, extend, threads)
    if key not in _TRACED_STEPS:
        try:
            _TRACED_STEPS[key] = (Measured._make(traced_at_depth(
                family, transformer_config, extend,
                lambda shaped: traced_step(config, family, shaped, latent_shape, device_type, text_tokens))),
                *adapter_size(config, family, transformer_config, extend))
        except NotFakeable as exc:
            _TRACED_STEPS[key] = str(exc)
    if isinstance(_TRACED_STEPS[key], str):
        return StageEstimate("lora", note=_TRACED_STEPS[key])
    traced, parameters, lora = _TRACED_STEPS[key]
    tflop = traced.tflop
    activations, host = (traced.peak, traced.host) if config.gradient_checkpointing_cpu_offload else \
        (traced.peak_in_place, traced.host_in_place)
    stored = stored_weights(family, transformer_config, config.base_model_precision, config.fp32_modules_storage)
    weights = stored.total
    if config.enable_group_offload or config.blocks_to_swap:  # the blocks as stored: 1 byte per weight with fp8/int8
        weights -= offloaded_bytes(stored.blocks, config)
    moments = 2 * parameters * (2 if config.optimizer == "adamw_bf16" else 4)
    return StageEstimate("lora", {"weights": weights, "lora": lora, "optimizer": moments,
                                  "activations": activations, **nabla}, tflop, note, host=host)


# The settings a training step's fake model never reads: what `training_step` adds around its trace (the optimizer's
# moments, the weights offloaded or stored apart).
UNTRACED = frozenset({"optimizer", "enable_group_offload", "group_offload_type", "group_offload_blocks_per_group",
                      "group_offload_use_stream", "blocks_to_swap", "fp32_modules_storage"})
# step_key -> (the traced step, adapter parameters, adapter bytes), or why it cannot be traced
_TRACED_STEPS: dict[str, tuple[Measured, int, int] | str] = {}


def step_key(config: LoraflowConfig, *inputs: Any) -> str:
    """What one fake training step of `config` (with these other inputs) traces: every setting but `UNTRACED` and
    activation offload (traced on, counted both ways: `traced_step`), the precision as the fake model computes in it
    (`model_dtype`: fp8 and int8 storage compute as bf16; and whether it is `no_change`, which `uses_autocast`
    asks)."""
    import json

    settings = config.model_dump(mode="json", exclude={*UNTRACED, "gradient_checkpointing_cpu_offload"})
    precision = settings.pop("base_model_precision")
    return json.dumps([settings, str(model_dtype(precision)), precision == "no_change", *inputs], sort_keys=True)


def linear_in_depth(config: LoraflowConfig) -> bool:
    """Whether the step's activations, FLOPs and host bytes grow by the same amount with each block: not where the
    blocks differ by their index (TREAD's routes, checkpointing every Nth block, LyCORIS presets by module name)."""
    return config.tread_config is None and config.gradient_checkpointing_interval <= 1 and \
        config.lycoris_config is None


def traced_step(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                latent_shape: tuple[int, int, int, int], device_type: str,
                text_tokens: int | None) -> Measured:
    """One fake training step of this transformer, counted (`measured_step`). With gradient checkpointing it is
    traced with activation offload on, whatever the config says: counted in place (`Measured.peak_in_place`), the
    same trace is the step without offload, so one trace answers both."""
    import torch
    from peft.tuners.lycoris_utils import LycorisLayer

    from loraflow.training.step import uses_autocast

    mode = estimate_mode()
    transformer = fake_transformer(config, family, transformer_config, mode, config.base_model_precision)
    # activation offload's copies go to the meta device, which the counter counts as host memory (a CPU run's
    # offload moves nothing)
    offloaded = config.model_copy(update={"gradient_checkpointing_cpu_offload": config.gradient_checkpointing})
    enable_checkpointing(transformer, offloaded, host="cpu" if device_type == "cpu" else "meta")
    transformer.train()
    # LoKr and LoHa layers read torch.rand(1) > module_dropout in each training forward, a value fake tensors lack:
    # they run as in eval, applying the adapter (the larger peak; the rank_dropout mask, a vector per layer, left out)
    for module in transformer.modules():
        if isinstance(module, LycorisLayer):
            module.training = False
    autocast = uses_autocast(config, torch.device(device_type))
    step = velocity_call(family, transformer, latent_shape, config.train_batch_size, autocast, config,
                         text_tokens=text_tokens)
    return measured_step(step, mode, transformer, device_type)


def vae_encode(config: LoraflowConfig, family: ModelFamily, vae_config: Mapping[str, Any],
               frames: int, height: int, width: int, device_type: str = "cuda") -> StageEstimate:
    """The latents stage encoding one clip of the largest bucket: fp32 VAE weights + the peak of a fake no-grad
    `family.vae_encode` with the configured patch conv / tiling / slicing (`stages.latents.latents.prepare_vae`).
    The encoder, and each of its down blocks, runs once per distinct input shape (`measured_once`): the tiles of a
    tiled encode and Kandinsky 5's framewise chunks of 17 frames share a handful of shapes, and so do the chunks of
    frames patch conv streams HunyuanVideo 1.5's encoder in (`kernels.patch_conv`: each later chunk goes through the
    down blocks with the same state, the last frames of the chunk before)."""
    import torch

    from loraflow.stages.latents.latents import prepare_vae

    mode = estimate_mode()
    vae = fake_model(meta_model(vae_config, torch.float32), mode)
    prepare_vae(vae, config, family)

    def encode() -> None:
        with torch.no_grad():
            family.vae_encode(vae, torch.zeros((1, frames, height, width, 3), dtype=torch.uint8),
                              config.latent_sampling)

    activations, tflop, *_ = measured_step(encode, mode, vae, device_type,
                                           repeated=[vae.encoder, *vae.encoder.down_blocks])
    note = "" if not family.image_condition_components else \
        f"{', '.join(family.image_condition_components)} left out"
    return StageEstimate("latents", {"weights": weights_bytes(vae), "activations": activations}, tflop, note)


def text_encoders(config: LoraflowConfig, family: ModelFamily,
                  component_configs: Mapping[str, Mapping[str, Any]]) -> StageEstimate:
    """The text_embeds stage: the text encoders' weights (the first in `text_encoder_1_precision`: fp32 4 bytes, bf16
    2, int8-torchao `int8_bytes`), all on the accelerator at once unless offload_during_startup (then the largest
    alone). Their activations (one prompt, no grad) are left out."""
    import json

    encoders = [c for c in family.text_components if c in component_configs]
    sizes = [_encoder_bytes(json.dumps(component_configs[name], sort_keys=True),
                           config.text_encoder_1_precision if name == "text_encoder" else "fp32")
             for name in encoders]
    weights = max(sizes, default=0) if config.offload_during_startup else sum(sizes)
    return StageEstimate("text_embeds", {"weights": weights}, None, "weights only")


def captioner_weights(config: LoraflowConfig, component_configs: Mapping[str, Mapping[str, Any]]) -> StageEstimate:
    """The captions stage (`caption_strategy: auto`): the captioner's weights in bf16, as it loads on an accelerator
    (stages/captions/captions.py), from `caption_model_path`'s config.json or the checkpoint's text encoder's. Its
    activations (a few frames' vision tokens, a short greedy decode, no grad) are left out."""
    import json
    from pathlib import Path

    from loraflow.stages.captions.captions import CAPTIONER_CLASS

    if config.caption_model_path:
        file = Path(config.caption_model_path) / "config.json"
        if not file.is_file():
            return StageEstimate("captions", note="caption_model_path is no local folder (a Hub id?): not estimated")
        captioner = json.loads(file.read_text())
    else:
        captioner = component_configs.get("text_encoder") or {}
        if CAPTIONER_CLASS not in captioner.get("architectures", []):
            return StageEstimate("captions", note="the text encoder is no full Qwen2.5-VL: set caption_model_path")
    weights = _encoder_bytes(json.dumps(captioner, sort_keys=True), "bf16")
    return StageEstimate("captions", {"weights": weights}, None, "weights only (bf16)")


@functools.lru_cache(maxsize=16)
def _encoder_bytes(component_config: str, precision: str) -> int:
    """A text encoder's weights (its config.json as JSON) stored in this precision, remembered for the process: the
    meta model of a 7B encoder takes a fraction of a second to build, and a check's switch rows ask for each
    precision again."""
    import json

    model = meta_model(json.loads(component_config), model_dtype(precision))
    return int8_bytes(model) if precision == "int8-torchao" else weights_bytes(model)


def int8_bytes(model: torch.nn.Module) -> int:
    """A bf16 model's bytes with every linear weight stored as `kernels/quantize.py` stores it: 1 byte per weight,
    and per output row an fp32 scale and an int8 zero point; the rest (embeddings, norms, biases) bf16."""
    import torch

    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(w.numel() + 5 * w.shape[0] for w in linear)
    return weights_bytes(model) - tensor_bytes(linear) + quantized
