"""The assets, in the order one video travels: file (`dataset_files`, observed) -> clips -> latents + text_embeds
(+ teacher_features, for CREPA; + audio_latents, for a config that trains sound) -> lora -> validation.

Each asset: load the config, call its op (heavy imports happen there, not at code-location load), and return
a MaterializeResult whose data version is a hash of the content it stands for.

`clips` and `latents` are partitioned by dataset (partitions.py): a run caches one dataset, and its data version
is that dataset's content. `text_embeds`, `lora` and `validation` are not: each reads every dataset's manifest part
(Dagster's default for an unpartitioned asset downstream of a partitioned one is all partitions).
"""


# No `from __future__ import annotations` here: Dagster inspects the real annotation of `context`.
from dataclasses import asdict
from pathlib import Path

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    AutomationCondition,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from loraflow.assets import metadata as md
from loraflow.assets.dataset_files import dataset_files
from loraflow.assets.partitions import DATASETS, existing_partition
from loraflow.assets.resources import LoraflowResource
from loraflow.contracts.reports import ClipsReport

# Declarative automation, for Dagster's `default_automation_condition_sensor` (off until switched on, like
# dataset_watch): once upstream is new, text_embeds re-embeds (a dataset the sensor or `recache` re-cached) and
# validation renders (a LoRA trained from the CLI, a new validation prompt). The same follow-ups train_and_validate
# runs in one go; `lora` is never automated, because starting a training run is the user's call.
AFTER_UPSTREAM = AutomationCondition.eager()

def _log_waiting(context: AssetExecutionContext, dataset: str) -> None:
    # Runs of one dataset from the queue never overlap (`dagster/partition` limit in .dagster/dagster.yaml); these
    # are CLI runs, which bypass the queue: the store's part lock makes them write one after the other.
    context.log.info(f"waiting for another process writing dataset '{dataset}' to this store")


@asset(deps=[dataset_files], partitions_def=DATASETS, group_name="loraflow",
       description="One dataset: probe videos/images, choose clips, bucket, decode only the kept frames.")
def clips(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.contracts.clip_rows import stored_clips
    from loraflow.media.previews import PREVIEW_CLIPS, clip_preview
    from loraflow.pipelines import plan_family
    from loraflow.stages.clips.bucket_plan import human_bytes
    from loraflow.stages.clips.clips import build_clips

    config = loraflow.load()
    store = loraflow.store(config)
    dataset = loraflow.dataset(config, existing_partition(context.instance, context.partition_key))
    with store.part_lock(dataset, on_wait=lambda: _log_waiting(context, dataset)):
        report = build_clips(config, plan_family(config), loraflow.model(config), store, datasets=[dataset])
    for row in report.quarantined:
        context.log.warning(f"quarantined {row.file}: {row.reason} ({row.detail})")
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={
            "dataset": dataset,
            **md.counts(report),
            "clips": report.clips,
            # est_latent_bytes: what the latents stage will write (float32, the VAE's factors), before it runs
            "buckets": md.md_table([{"dataset": r.dataset, "bucket": r.bucket, "clips": r.clips,
                                     "frames_bytes": human_bytes(r.frames_bytes),
                                     "est_latent_bytes": human_bytes(r.latent_bytes)} for r in report.buckets]),
            "est_latent_bytes": human_bytes(report.est_latent_bytes),
            "dropped": md.md_table(report.dropped),
            "quarantined": len(report.quarantined),
            "quarantine": md.md_table(report.quarantined),
            "preview": md.md_image(clip_preview(stored_clips(store.only_parts([dataset]), PREVIEW_CLIPS)),
                                  "first frame of each clip (i2i: its source image below)"),
            **_scene_metadata(report),
        },
    )


def _scene_metadata(report: ClipsReport) -> dict[str, MetadataValue]:
    """`video.scene_cuts: detect`: per file the scenes found and used, and the frames on both sides of each cut."""
    from loraflow.media.previews import cut_strips

    if not report.scenes:
        return {}
    return {"scenes": md.md_table([{"file": r.file, "scenes_found": r.scenes, "scenes_used": r.used,
                                    "cuts_at_frames": ", ".join(map(str, r.cuts)) or "none"} for r in report.scenes]),
            "scene_cuts": md.md_image(cut_strips(report.scenes), "the frames before and after each scene cut")}


@asset(deps=[clips], partitions_def=DATASETS, pool="gpu", group_name="loraflow",
       description="One dataset: VAE latents of every clip, cached by content.")
def latents(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.pipelines import get_family
    from loraflow.stages.latents.latents import encode_latents

    config = loraflow.load()
    dataset = loraflow.dataset(config, existing_partition(context.instance, context.partition_key))
    store, family, model = loraflow.store(config), get_family(config), loraflow.model(config)
    with store.part_lock(dataset, on_wait=lambda: _log_waiting(context, dataset)):  # it reads the clips part too
        report = encode_latents(config, family, model, store, datasets=[dataset])
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={"dataset": dataset, **md.counts(report), "latents": report.computed + report.reused,
                  "device": report.device, "peak_gib": report.peak_gib,
                  **md.estimated_peak(config, family, model, "latents", store, report.device, [dataset]),
                  "quarantined": len(report.quarantined),
                  "quarantine": md.md_table(report.quarantined), "oom_fallbacks": md.md_table(report.oom_fallbacks)},
    )


# In the code location only where its config has `train_audio` (jobs.graph): every other config's graph, runs and UI
# stay the six assets they were; there, the `cache_dataset` job caches it too (jobs.graph).
@asset(deps=[clips], partitions_def=DATASETS, pool="gpu", group_name="loraflow",
       description="One dataset: each clip's sound over its time span as audio VAE latents (Kandinsky 6 with "
                   "train_audio), cached by content; a row says why a clip has none; nothing while train_audio is "
                   "off.")
def audio_latents(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.stages.audio.audio_latents import encode_audio

    config = loraflow.load()
    dataset = loraflow.dataset(config, existing_partition(context.instance, context.partition_key))
    if not config.train_audio:  # one version while off, as teacher_features
        return MaterializeResult(data_version=DataVersion("off"), metadata={
            "dataset": dataset, "computed": 0, "reused": 0, "status": "off: train_audio is false"})
    store = loraflow.store(config)
    with store.part_lock(dataset, on_wait=lambda: _log_waiting(context, dataset)):  # it reads the clips part too
        report = encode_audio(config, loraflow.model(config), store, datasets=[dataset])
    for row in report.quarantined:
        context.log.warning(f"no audio latent for {row.source} (clip {row.clip_key}): {row.reason}: {row.detail}")
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={"dataset": dataset, **md.counts(report), "device": report.device,
                  "without_audio": len(report.quarantined), "clips_without_audio": config.clips_without_audio,
                  "reasons": md.md_table(report.quarantined), "clipped": len(report.clipped),
                  "clipped_sound": md.md_table(report.clipped)},
    )


# In the code location only where a dataset has `caption_strategy: auto` (jobs.graph), as audio_latents: every other
# config's graph stays as it was; there, `cache_dataset` captions the dataset too and text_embeds reads the captions.
@asset(deps=[clips], partitions_def=DATASETS, pool="gpu", group_name="loraflow",
       description="One dataset (caption_strategy auto): each clip without a user caption, captioned from its frames "
                   "by a Qwen2.5-VL (caption_model_path, else the checkpoint's own), cached by content.")
def captions(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.stages.captions.captions import build_captions

    config = loraflow.load()
    store = loraflow.store(config)
    dataset = loraflow.dataset(config, context.partition_key)
    with store.part_lock(dataset, on_wait=lambda: _log_waiting(context, dataset)):  # it reads the clips part too
        report = build_captions(config, loraflow.model(config), store, datasets=[dataset])
    made = store.read_manifest("captions", parts=[dataset])
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={"dataset": dataset, **md.counts(report), "captioned_clips": len(made), "captioner": report.captioner,
                  "prompt": report.prompt,
                  "captions": md.md_table([{"clip": r["clip"][:12], "caption": r["caption"]} for r in made], limit=20)},
    )


def _text_asset(deps: list[AssetsDefinition]) -> AssetsDefinition:
    """The `text_embeds` asset reading `deps`: a config with `caption_strategy: auto` reads the captions too."""
    @asset(name="text_embeds", deps=deps, pool="gpu", group_name="loraflow", automation_condition=AFTER_UPSTREAM,
           description="Text embeddings of every distinct text of every dataset.")
    def text_embeds(loraflow: LoraflowResource) -> MaterializeResult:
        return _embed(loraflow)

    return text_embeds


def _embed(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.pipelines import get_family
    from loraflow.stages.text.text_embeds import encode_texts

    config = loraflow.load()
    report = encode_texts(config, get_family(config), loraflow.model(config), loraflow.store(config))
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={**md.counts(report), "distinct_texts": report.distinct_texts,
                  "truncated_texts": report.truncated_texts, "device": report.device,
                  "text_encoder_1_precision": report.text_encoder_1_precision, "bytes_on_disk": report.bytes_on_disk,
                  "seconds": report.seconds, "texts_per_s": report.texts_per_s,
                  "tokens_histogram": md.md_table(report.tokens_histogram),
                  "truncated": md.md_table(report.truncated)},
    )


text_embeds = _text_asset([clips])
text_embeds_captioned = _text_asset([clips, captions])  # with caption_strategy auto


@asset(deps=[latents], pool="gpu", group_name="loraflow",
       description="CREPA's teacher (DINOv2) patch features of every clip, cached by content; nothing while CREPA is "
                   "off.")
def teacher_features(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.pipelines import get_family
    from loraflow.stages.teacher.teacher_features import cache_teacher_features

    config = loraflow.load()
    if not config.crepa_enabled:  # one version while off: lora is not made stale by a stage it does not read
        return MaterializeResult(data_version=DataVersion("off"), metadata={
            "computed": 0, "reused": 0, "status": "off: crepa_enabled is false", "crepa_enabled": False})
    report = cache_teacher_features(config, get_family(config), loraflow.store(config))
    return MaterializeResult(data_version=DataVersion(report.data_version),
                             metadata={**md.counts(report), "crepa_enabled": True, "teacher": report.teacher,
                                       "image_size": report.image_size})


def _training_asset(deps: list[AssetsDefinition]) -> AssetsDefinition:
    """The `lora` asset reading `deps`: a config that trains sound reads the audio latents too (`lora_with_sound`)."""
    @asset(name="lora", deps=deps, pool="gpu", group_name="loraflow", description="Flow-matching LoRA training.")
    def lora(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
        return _train(context, loraflow)

    return lora


def _train(context: AssetExecutionContext, loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.assets.runs.launch import run_training
    from loraflow.config.adapter_kinds import adapter_summary
    from loraflow.config.training_options import trained_with
    from loraflow.contracts.clip_rows import changed_sources, changed_sources_warning
    from loraflow.contracts.masks import masked_loss_metadata
    from loraflow.media.previews import loss_plot
    from loraflow.pipelines import get_family
    from loraflow.training.options.progress_renders import progress_sheet_path

    config = loraflow.load()  # in-process on one CPU; launched processes under Pipes for N processes or CUDA
    store, family, model = loraflow.store(config), get_family(config), loraflow.model(config)
    changed = changed_sources(store, config.dataset_folders)  # trained on as cached, said here and in metadata
    if changed:
        context.log.warning(changed_sources_warning(changed))
    report = run_training(context, config, family, model, loraflow.config_path, store)
    sheet = progress_sheet_path(report.run_dir)  # validation_steps: renders during training
    history = [asdict(step) for step in report.history]
    return MaterializeResult(
        data_version=DataVersion(report.data_version),
        metadata={
            **md.counts(report),
            "lora_path": MetadataValue.path(report.lora_path),  # diffusers' load_lora_weights
            **({"comfyui_lora_path": MetadataValue.path(report.comfyui_lora_path)}  # ComfyUI's models/loras
               if report.comfyui_lora_path else {}),
            **({"musubi_lora_path": MetadataValue.path(report.musubi_lora_path)}  # musubi-tuner's --lora_weight
               if report.musubi_lora_path else {}),
            "final_loss": md.number(float("nan") if report.final_loss is None else report.final_loss),
            "peak_gib": md.number(report.peak_gib),  # CUDA only: 0 on the CPU
            **md.estimated_peak(config, family, model, "lora", store, "cuda" if report.peak_gib else "cpu"),
            # training/flops.py: model TFLOP/s (recompute left out) and MFU over the card's peak (None on the CPU)
            **({"attention_backend": report.attention_backend} if report.attention_backend else {}),
            **({"tflops": md.number(report.tflops)} if report.tflops is not None else {}),
            **({"mfu": md.number(report.mfu)} if report.mfu is not None else {}),
            "loss": md.loss_words(history),
            **masked_loss_metadata(config),  # with a mask dataset: which datasets, how often
            "loss_curve": md.md_image(loss_plot(history), "training loss per step"),
            "history": MetadataValue.path(str(Path(report.run_dir) / "history.json")),  # every digit
            "inputs": MetadataValue.json(report.inputs),
            # source files replaced or deleted after caching: the run trained on their old clips
            "changed_sources": len(changed),
            "changed_sources_table": md.md_table(changed),
            "adapter": MetadataValue.json(adapter_summary(config)),  # kind, size, init_lora, EMA
            **trained_with(config),  # which optimizer and loss trained it
            **({"renders_during_training": md.md_image(sheet, "first validation prompt, per step")} if sheet else {}),
        },
    )


# teacher_features: training computes what it lacks itself too (a `loraflow train` run without Dagster)
lora = _training_asset([latents, text_embeds, teacher_features])
lora_with_sound = _training_asset([latents, audio_latents, text_embeds, teacher_features])  # with `train_audio`


# text_embeds too: a new validation prompt is embedded without retraining (lora's version stays), and validation
# must then show as stale and render it.
@asset(deps=[lora, text_embeds], pool="gpu", group_name="loraflow", automation_condition=AFTER_UPSTREAM,
       description="Base vs LoRA renders of every validation prompt, and eval loss on held-out clips.")
def validation(loraflow: LoraflowResource) -> MaterializeResult:
    from loraflow.pipelines import get_family
    from loraflow.training.options.ema import trained_adapters
    from loraflow.training.run import current_lora_path
    from loraflow.validation.validate import validate

    config = loraflow.load()
    store, family, model = loraflow.store(config), get_family(config), loraflow.model(config)
    adapters = trained_adapters(config, current_lora_path(config, family, store))  # ema_validation
    reports = {name: validate(config, family, model, store, path) for name, path in adapters.items()}
    report = next(iter(reports.values()))
    metadata = {**md.counts(report), "prompts": len(report.prompts), "adapter": MetadataValue.path(
        next(iter(adapters.values())))}
    if len(reports) > 1 and reports["ema"].prompts:  # comparison: the EMA adapter's renders beside the LoRA's
        metadata |= {"ema_mean_abs_pixel_change": md.number(reports["ema"].mean_abs_pixel_change),
                     "ema_preview": md.md_image(reports["ema"].prompts[0].contact_sheet, "base frames over EMA frames")}
    if report.prompts:
        sheets = [f"**{p.name}**: {p.prompt}\n\n"
                  + (md.md_image(p.animation, "base and LoRA, playing").value + "\n\n" if p.animation else "")
                  + md.md_image(p.contact_sheet, "base frames over LoRA frames").value for p in report.prompts]
        if report.condition_image:  # i2v's first frame, i2i's source image
            start = md.md_image(report.condition_image, "the conditioning image").value
            sheets.insert(0, f"**every render starts from**\n\n{start}")
        flat = {p.name: p.flat for p in report.prompts if p.flat}
        if flat:  # all one value: a NaN model, LoRA or adapter rendered a black video, and the step succeeded
            metadata["flat_renders"] = MetadataValue.json(flat)
        metadata |= {"video": MetadataValue.path(report.prompts[0].lora),
                     "base_video": MetadataValue.path(report.prompts[0].base),
                     "preview": MetadataValue.md("\n\n".join(sheets))}
    if report.eval_loss:
        table = [{**asdict(r), "base": f"{r.base:.4g}", "lora": f"{r.lora:.4g}"} for r in report.eval_loss]
        metadata |= {"eval_loss": md.md_table(table),
                     "eval_loss_plot": md.md_image(report.eval_plot, "eval loss per sigma")}
    summary = {"mean_abs_pixel_change": report.mean_abs_pixel_change, "eval_loss_base": report.eval_loss_base,
               "eval_loss_lora": report.eval_loss_lora, "eval_loss_change": report.eval_loss_change}
    facts = {**asdict(report.settings), "fps": report.fps, "eval_clips": report.eval_clips,
             **{name: value for name, value in summary.items() if value is not None}}  # None: no prompts/clips
    return MaterializeResult(data_version=DataVersion(report.data_version), metadata={**metadata, **md.readable(facts)})


ALL_ASSETS = [dataset_files, clips, latents, text_embeds, teacher_features, lora, validation]
# with `train_audio`: the sound's asset, and the lora asset that reads it (one `lora` key either way)
SOUND_ASSETS = [lora_with_sound if asset is lora else asset for asset in ALL_ASSETS] + [audio_latents]


def assets_for(sound: bool, auto_captions: bool) -> list[AssetsDefinition]:
    """The code location's assets: ALL_ASSETS, with `train_audio` SOUND_ASSETS; with a `caption_strategy: auto`
    dataset also the captions asset, and the text_embeds asset that reads it (one `text_embeds` key either way)."""
    chosen = SOUND_ASSETS if sound else ALL_ASSETS
    if not auto_captions:
        return chosen
    return [text_embeds_captioned if asset is text_embeds else asset for asset in chosen] + [captions]
