"""The fake transformer the training step and a render both run (`fake_transformer`: as training loads it, its
adapter included), the call they count (`velocity_call`), its weights as stored and as offloaded (`stored_model`,
`weights_bytes`, `offloaded`), and NABLA's stand-in (`attention_stand_in`: dense attention plus its measured block
masks)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraflow.estimates.fake_tensors import fake_model, measured_step, meta_model, tensor_bytes

if TYPE_CHECKING:
    import torch

    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily

def estimate_mode() -> Any:
    """The FakeTensorMode the estimates run in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real CPU tensors made by the code under test (torch.from_numpy in collate_text) become fake constants.
    return FakeTensorMode(allow_non_fake_inputs=True)


def model_dtype(precision: str) -> torch.dtype:
    """The dtype a model is built in for a precision setting: fp32, else bf16."""
    import torch

    return torch.float32 if precision in ("no_change", "fp32") else torch.bfloat16


def weights_bytes(model: torch.nn.Module) -> int:
    """The frozen weights and buffers (not the adapter, whose parameters require grad)."""
    return tensor_bytes([p for p in model.parameters() if not p.requires_grad] + list(model.buffers()))


def offloaded_bytes(blocks: list[int], config: LoraflowConfig) -> int:
    """Of the blocks' frozen weights (`StoredWeights.blocks`), those kept off the accelerator (`offloaded`)."""
    return offloaded(blocks, config.enable_group_offload, config.blocks_to_swap,
                     config.group_offload_blocks_per_group if config.group_offload_type == "block_level" else 1,
                     config.group_offload_use_stream)


@dataclass(frozen=True)
class StoredWeights:
    """The frozen weights of a transformer as stored (`stored_model`): all of them, and each block's, in the order
    the transformer holds them."""

    total: int
    blocks: list[int]


def stored_weights(family: ModelFamily, transformer_config: Mapping[str, Any], precision: str,
                   kept: str) -> StoredWeights:
    """The `StoredWeights` of this transformer in this precision, remembered for the process: the meta model of a
    released transformer takes seconds to build, and a check's switch list asks for the same ones again and again."""
    import json

    return _stored_weights(family.tread_layout.blocks, json.dumps(transformer_config, sort_keys=True), precision,
                           kept)


@functools.lru_cache(maxsize=8)
def _stored_weights(blocks: str, transformer_config: str, precision: str, kept: str) -> StoredWeights:
    import json

    stored = stored_model(json.loads(transformer_config), precision, kept)
    return StoredWeights(weights_bytes(stored), [weights_bytes(b) for b in getattr(stored, blocks)])


def offloaded(blocks: list[int], every_block: bool, blocks_to_swap: int, per_group: int = 1,
              stream: bool = False) -> int:
    """Of these blocks' bytes, those kept off the accelerator. Every block (group offloading) block_level: all but the
    group computing now and, with streams, the next one (prefetched); leaf_level (`per_group` 1): every block but
    one leaf at a time, counted as one block. `blocks_to_swap` N: the last N but the one computing now
    (`kernels/offload.py`: one diffusers group each, no prefetch). The LoRA stays resident
    (`training.model_setup.Trainable`)."""
    from loraflow.kernels.offload import swapped

    if every_block:
        return sum(blocks) - sum(sorted(blocks, reverse=True)[:per_group * (2 if stream else 1)])
    gone = [blocks[i] for i in swapped(len(blocks), blocks_to_swap)]
    return sum(gone) - max(gone, default=0)


# The depths a transformer call is traced at: what a training step or a render's denoise call allocates at its peak,
# its FLOPs and its host bytes are a + b * depth from 3 blocks up (measured: Kandinsky 5 Lite's training step at 3,
# 4, 5 and 32 blocks, to the byte; tests/estimates/ holds each family to it at 6), so two shallow traces give
# the real depth's in a fraction of the time.
SHALLOW = (3, 4)


def traced_at_depth(family: ModelFamily, transformer_config: Mapping[str, Any], extend: bool,
                    trace: Callable[[Mapping[str, Any]], tuple]) -> tuple:
    """`trace(transformer_config)`'s numbers (bytes and TFLOP, in a tuple): with `extend`, traced at the `SHALLOW`
    depths (the family's `tread_layout.depth` key) and extended to the config's by one block's difference per block
    more (bytes rounded to whole ones); else, or for a transformer no deeper than that, traced as it is."""
    key = family.tread_layout.depth
    depth = transformer_config.get(key, 0) if key else 0
    if not extend or depth <= SHALLOW[-1]:
        return trace(transformer_config)
    low, high = (trace({**transformer_config, key: d}) for d in SHALLOW)
    more = (depth - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0])
    extended = (a + more * (b - a) for a, b in zip(low, high, strict=True))
    return tuple(round(x) if isinstance(a, int) else x for a, x in zip(low, extended))


def fake_transformer(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any], mode: Any,
                     precision: str) -> torch.nn.Module:
    """The fake transformer as `training.model_setup.load_transformer` prepares it (precision, the configured adapter
    in fp32). fp8-layerwise computes as bf16 does: the fake model is bf16 (its weights as stored: `stored_weights`);
    int8 weight-only is counted the same way (its per-channel scales are left out)."""
    return fake_model(meta_model(transformer_config, model_dtype(precision), adapter(config, family)), mode)


def adapter(config: LoraflowConfig, family: ModelFamily) -> Callable[[torch.nn.Module], None]:
    """What adds the configured adapter to a model, as training adds it (`training.options.adapters.add_adapter`)."""
    import torch

    from loraflow.training.options.adapters import add_adapter

    def add(model: torch.nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):  # add_adapter seeds torch's generator: the caller's is left as it was
            add_adapter(model, config, family)

    return add


def adapter_size(config: LoraflowConfig, family: ModelFamily, transformer_config: Mapping[str, Any],
                 extend: bool) -> tuple[int, int]:
    """(parameters, bytes) the configured adapter trains on this transformer, counted on the meta device: with
    `extend`, on the two shallow copies and extended to its depth (each block holds the same adapter), as
    `traced_at_depth` does."""
    def count(shaped: Mapping[str, Any]) -> tuple[int, float, int]:
        model = meta_model(shaped, model_dtype(config.base_model_precision), adapter(config, family))
        trained = [p for p in model.parameters() if p.requires_grad]
        return sum(p.numel() for p in trained), 0.0, tensor_bytes(trained)

    parameters, _, nbytes = traced_at_depth(family, transformer_config, extend, count)
    return parameters, nbytes


def stored_model(transformer_config: Mapping[str, Any], precision: str, kept: str) -> torch.nn.Module:
    """The transformer on the meta device with its frozen weights in the dtypes `base_model_precision` stores them
    in (fp8 and int8: 1 byte where diffusers' layerwise casting casts), its fp32-kept modules as `kept` says
    (`fp32_modules_storage`, kernels/quantize.py `store_kept`)."""
    from loraflow.kernels.quantize import ONE_BYTE_PRECISIONS, store_kept

    one_byte = precision in ONE_BYTE_PRECISIONS
    stored = meta_model(transformer_config, model_dtype(precision), fp8=one_byte)
    if precision != "no_change":
        store_kept(stored, kept)
    return stored


def velocity_call(family: ModelFamily, transformer: torch.nn.Module, latent_shape: tuple[int, ...], batch: int,
                   autocast: bool, training: LoraflowConfig | None,
                   text_tokens: int | None = None) -> Callable[[], None]:
    """One transformer call on zeros of the batch's shapes: with a `training` config, `flow_terms` + backward routed
    by its TREAD as `train_lora` routes it (the routed tokens skip those blocks, in the activations and the FLOPs
    counted); without, a render's no-grad velocity. The batch is made inside, as its device copies are made in a
    run; i2v and i2i rows carry their image condition (`example_image_condition`: the conditioning latent, and
    HunyuanVideo 1.5's SigLIP tokens, which open its image stream)."""
    import torch

    from loraflow.pipelines.base import image_conditions
    from loraflow.training.batches import MicroBatch, StepDraws
    from loraflow.training.step import flow_terms, routing

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
                flow_terms(transformer, family, micro, device, autocast).flow.backward()
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

    peak = measured_step(build, estimate_mode(), torch.nn.Module(), device_type).peak
    mask = masks[0]
    kept = tensor_bytes([part for part in mask.as_tuple() if isinstance(part, torch.Tensor)])
    return peak - 2 * batch * shape[1] * shape[2] * head_dim * 2, kept


@functools.lru_cache(maxsize=8)
def _nabla_masks(transformer_config: str, latent_shape: tuple[int, ...], batch: int,
                 device_type: str) -> tuple[int, int]:
    """`nabla_masks`, remembered for the process: the training rows of a check's switch list ask for the same ones."""
    import json

    return nabla_masks(json.loads(transformer_config), latent_shape, batch, device_type)


def attention_stand_in(config: LoraflowConfig | None, transformer_config: Mapping[str, Any],
                        latent_shape: tuple[int, ...], batch: int,
                        device_type: str) -> tuple[Mapping[str, Any], dict[str, int], str]:
    """The transformer config the fake step runs, the bytes it leaves out, and the note saying so. NABLA (Kandinsky
    5's 10 s checkpoints, Pro in its HD mode) runs flex attention, which fake tensors cannot take a backward of: the
    step runs the same model with dense attention, whose kept tensors (output, log-sum-exp) are flex's too, and NABLA's
    block masks are added (`nabla_masks`): one being built, plus, in training, the one each block keeps for its
    backward (every visual block's without gradient checkpointing; the recomputed one's with it). TFLOP are dense:
    an upper bound (NABLA skips the blocks outside its P-CDF, a share only the real q and k decide)."""
    import json

    if transformer_config.get("attention_type") != "nabla":
        return transformer_config, {}, ""
    building, kept = _nabla_masks(json.dumps(transformer_config, sort_keys=True), tuple(latent_shape), batch,
                                  device_type)
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
