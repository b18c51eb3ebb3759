"""The five assets, in the order one video travels: file -> clips -> latents + text_embeds -> lora -> validation.

Each asset: load the config, call its op (heavy imports happen there, not at code-location load), and return
a MaterializeResult whose data version is a hash of the content it stands for.
"""


# No `from __future__ import annotations` here: Dagster inspects the real annotation of `context`.
from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue, asset

from loraflow.assets import metadata as md
from loraflow.assets.resources import LoraflowResource


@asset(group_name="loraflow", description="Probe videos/images, choose clips, bucket, decode only the kept frames.")
def clips(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.ops.clips import build_clips
    from loraflow.ops.previews import clip_preview
    from loraflow.pipelines import get_family

    config = loraflow.load()
    store = loraflow.store(config)
    report = build_clips(config, get_family(config), store)
    for row in report.quarantined:
        context.log.warning(f"quarantined {row['file']}: {row['reason']} ({row['detail']})")
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={
            **md.counts(report),
            "buckets": md.md_table(report.tables["buckets"]),
            "quarantined": len(report.quarantined),
            "quarantine": md.md_table(report.quarantined),
            "preview": md.md_image(clip_preview(store), "first frame of each clip"),
        },
    )


@asset(deps=[clips], pool="gpu", group_name="loraflow", description="VAE latents of every clip, cached by content.")
def latents(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.ops.latents import encode_latents
    from loraflow.pipelines import get_family

    config = loraflow.load()
    report = encode_latents(config, get_family(config), loraflow.store(config))
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={**md.counts(report), **report.facts, "quarantine": md.md_table(report.quarantined)},
    )


@asset(deps=[clips], pool="gpu", group_name="loraflow", description="Text embeddings of every distinct text.")
def text_embeds(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.ops.text_embeds import encode_texts
    from loraflow.pipelines import get_family

    config = loraflow.load()
    report = encode_texts(config, get_family(config), loraflow.store(config))
    return MaterializeResult(data_version=DataVersion(report.data_version), metadata={**md.counts(report), **report.facts})


@asset(deps=[latents, text_embeds], pool="gpu", group_name="loraflow", description="Flow-matching LoRA training.")
def lora(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.ops.train import train_lora
    from loraflow.pipelines import get_family

    config = loraflow.load()
    report = train_lora(config, get_family(config), loraflow.store(config))
    history = report.tables["history"]
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={
            **md.counts(report),
            "lora_path": MetadataValue.path(report.facts["lora_path"]),
            "final_loss": history[-1]["loss"] if history else float("nan"),
            "loss_curve": md.md_image(md.loss_curve(history), "loss per step"),
            "inputs": MetadataValue.json(report.facts["inputs"]),
        },
    )


@asset(deps=[lora], pool="gpu", group_name="loraflow", description="Base vs LoRA renders of the validation prompt.")
def validation(loraflow: LoraflowResource) -> MaterializeResult:
    from PIL import Image

    from loraflow.ops.train import current_lora_path
    from loraflow.ops.validate import validate
    from loraflow.pipelines import get_family

    config = loraflow.load()
    store = loraflow.store(config)
    report = validate(config, get_family(config), store, current_lora_path(config, store))
    sheet = Image.open(report.facts["contact_sheet"])
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={
            **md.counts(report),
            "video": MetadataValue.path(report.facts["video"]),
            "base_video": MetadataValue.path(report.facts["base_video"]),
            "preview": md.md_image(sheet, "base (top) vs LoRA (bottom)"),
            **{k: v for k, v in report.facts.items() if k not in ("video", "base_video", "contact_sheet")},
        },
    )


ALL_ASSETS = [clips, latents, text_embeds, lora, validation]
