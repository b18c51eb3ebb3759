"""What `loraflow check` prints beside the problems: aligned tables, the sigma shifts, the estimates per stage."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraflow.config import LoraflowConfig
    from loraflow.pipelines import FamilyPlan
    from loraflow.pipelines.sources import ModelSource


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Plain aligned columns; numbers right-aligned."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(str(row[i]).replace(".", "", 1).isdigit() for row in rows) if rows else False
               for i in range(len(header))]
    return "\n".join("  " + "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in
                                      enumerate(zip(r, widths))).rstrip() for r in cells)


def print_shifts(config: LoraflowConfig, family: FamilyPlan, source: ModelSource | None) -> None:
    """The sigma shift training draws with and the one renders sample with, each with its source; a warning when
    they differ (`contracts.shifts`: one rule for every family)."""
    from loraflow.contracts.shifts import render_shift, shifts_warning, training_shift

    training, render = training_shift(config, family.flavour, source), render_shift(config, family.flavour, source)
    shown = "per batch" if training.value is None else f"{training.value:g}"
    print(f"\nsigma shift: training {shown} ({training.source}); renders {render.value:g} ({render.source})")
    if warning := shifts_warning(training, render):
        print(f"warning: {warning}")


def print_estimates(config: LoraflowConfig, plan: FamilyPlan, source: ModelSource | None,
                    buckets: list) -> list[str]:
    """`_print_estimates`, and the problems it found: a component's config.json its class will not build (a value
    the library rejects: it raised from inside transformers)."""
    from loraflow.estimates.fake_tensors import ConfigRefused

    try:
        _print_estimates(config, plan, source, buckets)
    except ConfigRefused as exc:
        print("  left out: a component's config.json is refused by its own class (below)")
        from loraflow.estimates import component_configs

        folders = {c: source.folder(c) for c in config.flavour.components} if source is not None else {}
        named = [c for c, found in component_configs(folders).items()
                 if exc.class_name in (found.get("_class_name"), *(found.get("architectures") or [])[:1])]
        where = folders[named[0]] / "config.json" if named else "a component's config.json"
        return [f"{where}: {exc}: fix the value it names, or download or copy that component again"]
    return []


def _print_estimates(config: LoraflowConfig, plan: FamilyPlan, source: ModelSource | None, buckets: list) -> None:
    """Estimated accelerator peak and TFLOP per stage for the largest bucket (loraflow/estimates/: how each is
    computed), which common cards it fits, and, where training does not fit the user's card, the switches that
    would, each with its estimate. No weights are read. The family module (torch, diffusers: seconds to import) is
    imported only to compute an estimate: one remembered (`estimates.remembered`, a check of an unchanged config) is
    found from the config, the model's config files and `plan`. `check --no-estimates` leaves this out."""
    import functools

    from loraflow import estimates
    from loraflow.kernels.attention_backend import describe_choice
    from loraflow.pipelines import family_spec, get_family
    from loraflow.pipelines.released import FOLDER, released_config

    print("\nestimates (no model loads; loraflow/estimates/ says how each is computed):")
    released = estimates.released_configs(config) if source is None else None
    if source is not None:
        configs = estimates.component_configs({c: source.folder(c) for c in config.flavour.components})
    elif released:  # the released model, not downloaded yet: its config files as loraflow holds them
        configs = {c: released_config(config.flavour.name, c) for c in released}
        print(f"  from the released config files in {FOLDER.relative_to(Path(estimates.__file__).parents[2])}/ "
              f"({', '.join(released.values())}), not from the model: it is not on disk")
    else:
        print("  estimate needs the model's config files: the components' config.json on disk (download the model, "
              "which the first stage does, or point `pretrained_model_name_or_path` at a local folder)")
        return
    family = functools.cache(lambda: get_family(config))
    labels = [b.bucket for b in buckets]
    if not labels:
        labels = estimates.configured_buckets(config, plan, source or config.pretrained_model_name_or_path)
        print(f"  no clips yet: estimated at the bucket{'s' * (len(labels) > 1)} the datasets ask for "
              f"({', '.join(labels)}: a square source at `resolution`, `video.num_frames` frames)")
    bucket = estimates.largest_bucket(labels)
    frames, height, width = bucket
    card, named = estimates.card_gb(config)
    inputs = {"configs": configs, "bucket": bucket, "card": card}
    stages, reused = estimates.remembered(config, "stages", inputs,
                                          lambda: estimates.estimate(config, family(), configs, bucket))
    if reused is not None:
        print(f"  reused from {reused}: this config, model configs, bucket and card, with this loraflow, were "
              "estimated before (delete the file to estimate again)")
    print(f"  largest bucket {width}x{height}@{frames}, batch {config.train_batch_size}, "
          f"{plan.max_text_tokens} text tokens; GiB peak on the accelerator, TFLOP of one step (lora: forward + "
          "backward; latents: one clip; validation: one denoise call)")
    if config.train_audio:
        print("  train_audio: the picture only; the sound's tokens (hundreds beside the picture's thousands), the "
              "audio VAE and the vocoder are not counted (docs/families.md)")
    print(f"  fit: {estimates.FIT_MARKS}")
    print(table(estimates.estimate_rows(stages),
                ("stage", "peak GiB", "TFLOP", *(f"{gb}GB" for gb in estimates.CARDS_GB), "note")))
    nabla = config.flavour.configured(configs["transformer"]).get("attention_type") == "nabla"  # K5 Pro: its mode's
    print(f"  attention kernel: {describe_choice(config.attention_backend, nabla)}")
    attention_note = family_spec(config.model_family).attention_note
    if attention_note is not None:
        print(f"  {attention_note(config.flavour, configs['transformer'], bucket, plan.max_text_tokens)}")
    if card is None:
        return
    for stage in stages:
        if not stage.parts:
            continue
        if stage.fits(card):
            print(f"  {stage.stage} fits {card:.3g} GB ({named}): {stage.peak_gib:.3g} GiB")
            continue
        print(f"  {stage.stage} needs {stage.peak_gib:.3g} GiB; {card:.3g} GB ({named}) is short. Switches, each with "
              f"its estimated peak{SMALLER.get(stage.stage, '')}:")
        rows, _ = estimates.remembered(config, f"switches-{stage.stage}", inputs, lambda: estimates.switches(
            config, family(), configs, bucket, stage.stage, now=stage))
        for label, changed in rows:
            host = f" (+ {changed.host / estimates.GIB:.3g} GiB of CPU memory)" if changed.host else ""
            fits = "fits" if changed.fits(card) else "tight" if changed.mark(card) == "tight" else "does not fit"
            print(f"    {label:<40} {changed.peak_gib:.3g} GiB{host} {fits}")
        if not rows:
            print("    none left to switch")


# what else lowers a stage's peak, beside its switches
SMALLER = {"latents": " (smaller buckets: `resolution` of the dataset)",
           "lora": " (smaller buckets: `resolution` of the dataset)",
           "validation": " (the render's own offload and tiling are already chosen for the card; smaller renders: "
                         "`validation_resolution`, `validation_num_video_frames`)"}
