"""`loraflow check`'s table and what would make a stage fit: every stage's estimate for a config (`estimate`,
`stage_estimate` for the assets), the table's rows (`estimate_rows`), and each stage's switches with their estimates
(`SWITCHES`, `switches`, and `swap_to_fit`: the fewest `blocks_to_swap` that fits the card)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from loraflow.estimates.fit import CARDS_GB, GIB, StageEstimate, card_gb
from loraflow.estimates.inputs import component_configs, largest_bucket
from loraflow.estimates.render import validation
from loraflow.estimates.stages import captioner_weights, text_encoders, training_step, vae_encode
from loraflow.estimates.transformer import offloaded, stored_weights

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.sources import ModelSource

STAGES = ("latents", "text_embeds", "lora", "validation")


def stage_estimate(config: LoraflowConfig, family: ModelFamily, model: ModelSource, stage: str,
                   buckets: Iterable[str], device_type: str) -> StageEstimate:
    """One stage's estimate for the model on disk and these buckets: what the `latents` and `lora` assets show
    beside the peak they measured."""
    configs = component_configs({c: model.folder(c) for c in config.flavour.components})
    return next(e for e in estimate(config, family, configs, largest_bucket(buckets), device_type, (stage,)))


def estimate(config: LoraflowConfig, family: ModelFamily, configs: Mapping[str, Mapping[str, Any]],
             bucket: tuple[int, int, int], device_type: str = "cuda",
             stages: tuple[str, ...] | None = None) -> list[StageEstimate]:
    """`stages` (None: STAGES, and `captions` where a dataset has `caption_strategy: auto`) for the config's largest
    bucket (frames, height, width) and its validation size, from the components' config dicts only
    (`component_configs`, or a released config: no weights are read)."""
    if stages is None:
        auto = any(d.caption_strategy == "auto" for d in config.training_datasets)
        stages = ("captions", *STAGES) if auto else STAGES
    from loraflow.pipelines import plan_family
    from loraflow.stages.clips.buckets import vae_geometry

    frames, height, width = bucket
    configs = {**configs, "transformer": family.flavour.configured(configs["transformer"])}  # Pro's SD/HD mode
    geometry = vae_geometry(dict(configs["vae"]), family)
    latent = geometry.shape(frames, height, width)
    # validation renders at `validation_resolution`, else at the default or (an i2v pipeline that sizes the render
    # from its image) at that image's size bucket: the largest training bucket's size stands for it
    sized_by_image = config.validation_size is None and plan_family(config).spec.render_size is not None
    val_height, val_width = (height, width) if sized_by_image else (config.validation_size or family.flavour.size)
    val_frames = config.validation_num_video_frames or family.flavour.num_frames
    run = {"captions": lambda: captioner_weights(config, configs),
           "latents": lambda: vae_encode(config, family, configs["vae"], frames, height, width, device_type),
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
    "captions": (),  # caption_model_path: a smaller Qwen2.5-VL (the estimate's note says which it read)
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
    blocks = stored_weights(family, transformer_config, config.base_model_precision,
                            config.fp32_modules_storage).blocks
    before = offloaded(blocks, False, config.blocks_to_swap)
    for n in range(config.blocks_to_swap + 1, len(blocks) + 1):
        parts = {**now.parts, "weights": now.parts["weights"] - (offloaded(blocks, False, n) - before)}
        swapped = replace(now, parts=parts)
        if swapped.fits(card):
            return f"blocks_to_swap: {n} (of {len(blocks)})", swapped
    return None


def estimate_rows(estimates: list[StageEstimate]) -> list[tuple[str, ...]]:
    """`loraflow check`'s table: stage, peak GiB, TFLOP, then ✓ / tight / ✗ per card of CARDS_GB
    (`StageEstimate.mark`, FIT_MARKS); below a stage that holds host memory, a "(host)" row with its GiB."""
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
