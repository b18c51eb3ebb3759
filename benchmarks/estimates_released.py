"""What `loraflow check` would estimate for the lora stage of released-size transformers, without their weights.

The transformers of benchmarks/gpu/train.py (Kandinsky 5 Video Lite's released config, 2.01B; HunyuanVideo 1.5's
diffusers default, the released 8.33B) at its sizes (512x768 and 480x848, 61 frames), batch 1, LoRA rank 16 on the
family's targets, the family's longest caption, through `loraflow.estimates.training_step` for the variants of
gpu/train.py that change memory and activation offload (`gradient_checkpointing_cpu_offload`: its host memory in
`host_gib`, apart from the accelerator's peak); the seeds' folklore beside them. Then each family's i2v flavour
(Kandinsky 5 Lite i2v, HunyuanVideo 1.5 i2v 480p: the released transformer config, the conditioning latent and
SigLIP tokens in the fake batch) at the same size with checkpointing, without and with activation offload.
Estimates only, made on the CPU: gpu/train.py measures the t2v variants on a GPU (a later issue compares the two).
Then the seed guides' imports (one guide per model, imported as tests/factory.py `combine`s them) at
the bucket their datasets ask for, from the released configs, as `loraflow check` estimates them before download:
the lora stage with `gradient_checkpointing: true`, then with `gradient_checkpointing_cpu_offload: true` too
(docs/benchmarks.md's seed-guide table).
Last, one validation render of each released size users render at (issue 43), `base_model_precision: fp8-layerwise`
and `gpu_memory_gb: 24` as `loraflow check` estimates it now (`estimates.render_plan`: the plan the validation stage
renders with on that card), beside what check estimated before (`RENDERS_BEFORE`: the same configs on commit
758bf7d, which rendered in fp32 with nothing offloaded or tiled); and Kandinsky 5 Pro i2v's training at
256x256x73, fp8, rank 32, on 24 GB: the `blocks_to_swap` check proposes (`estimates.swap_to_fit`).

    python benchmarks/estimates_released.py                  # writes benchmarks/results/estimates_released.json
    python benchmarks/estimates_released.py renders swap     # only those sections (the others kept)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("estimates_released.json")
FOLKLORE = {"kandinsky5-video": "~13 GB (the seed guide, Kandinsky 5 Lite)",
            "hunyuanvideo-1.5": "24-32 GB at 480p (the seed guide)"}
VARIANTS = {
    "bf16": {"base_model_precision": "bf16"},
    "bf16+checkpointing": {"base_model_precision": "bf16", "gradient_checkpointing": True},
    "fp8+checkpointing": {"base_model_precision": "fp8-layerwise", "gradient_checkpointing": True},
    "bf16+checkpointing+offload": {"base_model_precision": "bf16", "gradient_checkpointing": True,
                                   "enable_group_offload": True, "group_offload_use_stream": True},
    "bf16+checkpointing+activation offload": {"base_model_precision": "bf16", "gradient_checkpointing": True,
                                              "gradient_checkpointing_cpu_offload": True},
}
I2V = {"kandinsky5-video": "i2v-lite-5s", "hunyuanvideo-1.5": "i2v-480p"}  # each family's i2v flavour
I2V_VARIANTS = ("bf16+checkpointing", "bf16+checkpointing+activation offload")
SECTIONS = ("rows", "seed_guides", "renders", "swap")  # of the JSON, in the order main computes them
SEED_GUIDES = ("000", "002", "004")  # Kandinsky 5 Video Lite, Kandinsky 5 Image, HunyuanVideo 1.5 (/work/shared/seeds)
# (family, flavour, WIDTHxHEIGHT, frames): the renders issue 43 measured, each at 121 frames
RENDERS = [("hunyuanvideo-1.5", "t2v-720p", "1280x720", 121), ("hunyuanvideo-1.5", "t2v-480p", "768x512", 121),
           ("hunyuanvideo-1.5", "i2v-480p", "848x480", 121), ("kandinsky5-video", "t2v-lite-sft-5s", "768x512", 121),
           ("kandinsky5-video", "t2v-pro-sft-5s-hd", "768x512", 121)]
# GiB: `estimates.estimate(..., stages=("validation",))` for these configs on commit 758bf7d (run 2026-11-28 on this
# machine; then every render was the fp32 transformer and VAE, the whole latent decoded at once, nothing offloaded)
RENDERS_BEFORE = {"t2v-720p 1280x720@121": 354.88, "t2v-480p 768x512@121": 171.95, "i2v-480p 848x480@121": 176.74,
                  "t2v-lite-sft-5s 768x512@121": 37.89, "t2v-pro-sft-5s-hd 768x512@121": 102.54}


def main(sections: tuple[str, ...] = SECTIONS) -> None:
    """Each section of the JSON computed and written in turn (`sections`: the ones to recompute; the others keep
    what the file holds): a section takes minutes of fake tensors, and one that fails loses none before it."""
    report = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    report["device"] = "CPU (fake tensors)"
    compute = {"rows": training_rows, "seed_guides": seed_rows, "renders": render_rows, "swap": swap_row}
    made_at = report.setdefault("commits", {})  # section -> the commit it was computed at
    for section in sections:
        report[section] = compute[section]()
        made_at[section] = record.commit()
        record.write(RESULTS, report, indent=1)


def training_rows() -> list[dict]:
    """gpu/train.py's t2v sizes for each variant, then each family's i2v flavour."""
    from benchmarks.gpu.train import MODELS, VAE
    from loraflow import estimates
    from loraflow.config import parse_config
    from loraflow.pipelines import get_family
    from loraflow.pipelines.released import released_config

    measured = {MODELS[name]["family"]: MODELS[name] for name in ("k5-lite", "hv15-480p")}  # gpu/train.py's sizes
    runs = [(family_name, model["flavour"], released_config(model["flavour"], "transformer"), variant)
            for family_name, model in measured.items() for variant in VARIANTS]
    runs += [(family_name, flavour, released_config(flavour, "transformer"), variant)
             for family_name, flavour in I2V.items() for variant in I2V_VARIANTS]
    rows = []
    for family_name, flavour, transformer_config, variant in runs:
        model = measured[family_name]
        (height, width), frames = model["size"], model["frames"]
        channels, spatial = VAE[family_name]
        latent = (channels, (frames - 1) // 4 + 1, height // spatial, width // spatial)
        config = parse_config({"model_family": family_name, "model_flavour": flavour,
                               "pretrained_model_name_or_path": str(ROOT),  # unused: configs are given
                               "datasets": [{"id": "d", "instance_data_dir": str(ROOT / "configs")}],
                               "lora_rank": 16, **VARIANTS[variant]})
        began = time.perf_counter()
        estimate = estimates.training_step(config, get_family(config), transformer_config, latent)
        row = {"family": family_name, "flavour": flavour, "variant": variant, "size": f"{width}x{height}@{frames}",
               "estimate_s": round(time.perf_counter() - began, 1), "folklore": FOLKLORE[family_name]}
        if not estimate.parts:  # not estimated: the note says why
            rows.append({**row, "note": estimate.note})
            continue
        rows.append({**row, "peak_gib": round(estimate.peak_gib, 2), "step_tflop": round(estimate.tflop, 1),
                     "parts_gib": {k: round(v / 2**30, 3) for k, v in estimate.parts.items()},
                     **({"host_gib": round(estimate.host / 2**30, 3)} if estimate.host else {})})
        print(rows[-1], flush=True)
    return rows


def released(family_name: str, flavour: str, **settings: object) -> tuple:
    """A config of the released checkpoint (its configs read from loraflow/pipelines/released/), its family, and the
    component configs."""
    from loraflow.config import parse_config
    from loraflow.pipelines import get_family
    from loraflow.pipelines.released import released_config

    config = parse_config({"model_family": family_name, "model_flavour": flavour,
                           "pretrained_model_name_or_path": str(ROOT),  # unused: configs are given
                           "datasets": [{"id": "d", "instance_data_dir": str(ROOT / "configs")}], **settings})
    components = [c for c in config.flavour.components if c in ("transformer", "vae", "image_encoder")]
    return config, get_family(config), {c: released_config(flavour, c) for c in components}


def render_rows() -> list[dict]:
    """One validation render per RENDERS row on a 24 GB card, fp8 base: the estimate, its parts and plan."""
    from loraflow import estimates

    rows = []
    for family_name, flavour, size, frames in RENDERS:
        config, family, configs = released(family_name, flavour, validation_resolution=size, gpu_memory_gb=24,
                                           validation_num_video_frames=frames, base_model_precision="fp8-layerwise")
        began = time.perf_counter()
        (estimate,) = estimates.estimate(config, family, configs, (frames, 64, 64), stages=("validation",))
        rows.append({"flavour": flavour, "render": f"{size}@{frames}", "card_gb": 24,
                     "before_gib": RENDERS_BEFORE.get(f"{flavour} {size}@{frames}"),
                     "peak_gib": round(estimate.peak_gib, 2), "mark_24gb": estimate.mark(24),
                     "parts_gib": {k: round(v / 2**30, 3) for k, v in estimate.parts.items()},
                     "plan": estimate.note, "estimate_s": round(time.perf_counter() - began, 1)})
        print(rows[-1], flush=True)
    return rows


def swap_row() -> dict:
    """Kandinsky 5 Pro i2v training at 256x256x73, fp8, rank 32, checkpointing, on 24 GB: as configured, and the
    smallest `blocks_to_swap` that fits (what check proposes)."""
    from loraflow import estimates
    from loraflow.stages.clips.buckets import vae_geometry

    config, family, configs = released("kandinsky5-video", "i2v-pro-sft-5s", base_model_precision="fp8-layerwise",
                                       lora_rank=32, gradient_checkpointing=True, gpu_memory_gb=24)
    began = time.perf_counter()
    latent = vae_geometry(configs["vae"], family).shape(73, 256, 256)
    now = estimates.training_step(config, family, configs["transformer"], latent)
    label, swapped = estimates.swap_to_fit(config, family, configs["transformer"], now, 24)
    row = {"flavour": "i2v-pro-sft-5s", "bucket": "256x256@73", "card_gb": 24, "as_configured_gib":
           round(now.peak_gib, 2), "proposed": label, "with_it_gib": round(swapped.peak_gib, 2),
           "estimate_s": round(time.perf_counter() - began, 1)}
    print(row, flush=True)
    return row


def seed_rows() -> list[dict]:
    """The seed guides' lora-stage estimates with checkpointing, without and with activation offload."""
    import tempfile

    from loraflow import estimates
    from loraflow.cli import main as cli
    from loraflow.config import load_config
    from loraflow.pipelines import get_family
    from loraflow.pipelines.released import released_config
    from loraflow.stages.clips.buckets import vae_geometry
    from tests.factory import GUIDES, combine

    rows = []
    for number in SEED_GUIDES:
        guide = next(g for g in GUIDES if g.name.startswith(number))
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            settings, backends = combine(guide, root, with_i2v=False)
            (root / "config.json").write_text(json.dumps(settings))
            (root / "multidatabackend.json").write_text(json.dumps(backends))
            cli(["import-simpletuner", str(root / "config.json"), str(root / "multidatabackend.json"),
                 "-o", str(root / "config.yaml")])
            config = load_config(root / "config.yaml")
        family = get_family(config)
        configs = {c: released_config(config.flavour.name, c) for c in ("transformer", "vae")}
        bucket = estimates.largest_bucket(estimates.configured_buckets(config, family,
                                                                       config.pretrained_model_name_or_path))
        latent = vae_geometry(configs["vae"], family).shape(*bucket)
        for label, offload in (("gradient_checkpointing", False), ("+ gradient_checkpointing_cpu_offload", True)):
            began = time.perf_counter()
            estimate = estimates.training_step(config.model_copy(update={
                "gradient_checkpointing": True, "gradient_checkpointing_cpu_offload": offload}), family,
                configs["transformer"], latent)
            rows.append({"guide": guide.name, "flavour": config.flavour.name, "bucket": "{2}x{1}@{0}".format(*bucket),
                         "variant": label, "estimate_s": round(time.perf_counter() - began, 1),
                         "peak_gib": round(estimate.peak_gib, 2), "host_gib": round(estimate.host / 2**30, 3),
                         "parts_gib": {k: round(v / 2**30, 3) for k, v in estimate.parts.items()}})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or SECTIONS)
