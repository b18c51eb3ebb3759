"""The tables and the numbers of README.md and docs/benchmarks.md that come from a results JSON, written from it.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` (a NAME may appear in several files: the
same table each time), and `TABLES[NAME]` writes it from `benchmarks/results/`. A number in the prose sits between
`<!-- value:NAME -->` and `<!-- /value -->` on one line (`The demo took <!-- value:demo-fresh -->252 s<!-- /value -->,
setup included`: the comments do not show in rendered Markdown), and `values()[NAME]` writes it. Rerun after a
benchmark:

    .venv/bin/python benchmarks/tables.py           # rewrites every marked table and value in place
    .venv/bin/python benchmarks/tables.py --check   # exit 1, naming each table or value whose text is not its JSON's

tests/test_docs.py fails while a marked table or value differs from what its JSON gives, or a marker has none here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "docs" / "benchmarks.md",)  # the README quotes no measured number: it links to these
MARKED = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
VALUE = re.compile(r"(<!-- value:([\w-]+) -->)(.*?)(<!-- /value -->)")  # `.`: not across a line


def results(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def markdown(header: list[str], rows: list[list[Any]], note: str = "") -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + (f"\n\n{note}" if note else "") + "\n"


def first(rows: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The first of `rows` with each of `fields` at that value."""
    return next(row for row in rows if all(row.get(key) == value for key, value in fields.items()))


def gib(value: float, host: float | None = None) -> str:
    return f"{value:.2f}" + (f" (+ {host:.2f})" if host else "")


# -- estimates_released.json ----------------------------------------------------------------------------------
GUIDES = {"000": "Kandinsky 5 Video Lite t2v 5 s (000)", "002": "Kandinsky 5 Image t2i, rank 16 (002)",
          "004": "HunyuanVideo 1.5 t2v 480p, group offload with streams (004)"}


def seed_guides() -> str:
    made = results("estimates_released.json")
    rows: dict[str, list[Any]] = {}
    for row in made["seed_guides"]:
        cells = rows.setdefault(row["guide"][:3], [GUIDES[row["guide"][:3]], row["bucket"]])
        cells.append(gib(row["peak_gib"], row["host_gib"]))
    return markdown(["seed guide, imported", "bucket", "+ `gradient_checkpointing: true`",
                     "+ `gradient_checkpointing_cpu_offload: true` (+ CPU memory)"], list(rows.values()),
                    "GiB on the accelerator, `loraflow check`'s estimate before download (fake tensors): the seed "
                    f"guides of `estimates_released.json`, commit {commit_of(made, 'seed_guides')}.")


VARIANTS = {"bf16": "no switch (bf16)", "bf16+checkpointing": "gradient checkpointing",
            "bf16+checkpointing+activation offload": "+ activation offload (+ CPU memory)",
            "fp8+checkpointing": "fp8 + checkpointing", "bf16+checkpointing+offload": "+ group offload with streams"}
FAMILIES = {("kandinsky5-video", "t2v-lite-sft-5s"): "Kandinsky 5 Lite t2v", ("kandinsky5-video", "i2v-lite-5s"):
            "Kandinsky 5 Lite i2v", ("hunyuanvideo-1.5", "t2v-480p"): "HunyuanVideo 1.5 t2v 480p",
            ("hunyuanvideo-1.5", "i2v-480p"): "HunyuanVideo 1.5 i2v 480p"}


def estimates_released() -> str:
    made = results("estimates_released.json")
    columns = {FAMILIES[r["family"], r["flavour"]]: r["size"] for r in made["rows"]}
    peaks = {(VARIANTS[r["variant"]], FAMILIES[r["family"], r["flavour"]]): gib(r["peak_gib"], r.get("host_gib"))
             for r in made["rows"]}
    rows = [[variant, *(peaks.get((variant, family), "") for family in columns)] for variant in VARIANTS.values()]
    return markdown(["lora stage, batch 1, rank 16", *(f"{f} {s}" for f, s in columns.items())], rows,
                    "GiB on the accelerator (fake tensors on this CPU, no weights): `estimates_released.json` "
                    f"`rows`, commit {commit_of(made, 'rows')}.")


RENDERS = {"t2v-720p": "HunyuanVideo 1.5 t2v 720p", "t2v-480p": "HunyuanVideo 1.5 t2v 480p",
           "i2v-480p": "HunyuanVideo 1.5 i2v 480p", "t2v-lite-sft-5s": "Kandinsky 5 Video Lite t2v",
           "t2v-pro-sft-5s-hd": "Kandinsky 5 Video Pro t2v (HD)"}


def renders() -> str:
    made = results("estimates_released.json")
    rows = [[RENDERS[r["flavour"]], r["render"].replace("@", "x"), f"{r['before_gib']:.2f}", f"{r['peak_gib']:.2f}",
             r["plan"].split("; NABLA")[0]] for r in made["renders"]]
    swap = made["swap"]
    return markdown(["render", "size", "before (GiB)", "now (GiB)", "plan"], rows,
                    f"Training Kandinsky 5 Pro i2v at {swap['bucket'].replace('@', 'x')} (fp8, rank 32, "
                    f"checkpointing) on a {swap['card_gb']} GB card: {swap['as_configured_gib']} GiB as configured; "
                    f"`check` proposes `{swap['proposed']}`: {swap['with_it_gib']} GiB. `estimates_released.json` "
                    f"`renders` and `swap`, commit {commit_of(made, 'renders')}.")


def commit_of(made: dict[str, Any], section: str) -> str:
    return (made.get("commits", {}).get(section) or made.get("commit") or "unknown")[:7]


# -- gpu_nvidia-h200.json -------------------------------------------------------------------------------------
H200 = {"vae_encode_hv15_256x73": "HunyuanVideo 1.5 VAE encode 256x256x73, fp32, patch conv",
        "vae_encode_hv15_768x81": "HunyuanVideo 1.5 VAE encode 768x768x81, fp32, patch conv",
        "train_k5_plain": "Kandinsky 5 Lite t2v 512x768x61, rank 16, bf16",
        "train_k5_checkpointing": "the same + gradient checkpointing",
        "train_k5_tread0.5": "the same + TREAD 0.5 (layers 2..-2)",
        "train_hv15_720p_fp8": "HunyuanVideo 1.5 t2v-720p 512x512x81, fp8, checkpointing, rank 32",
        "train_k5_pro_fp8": "Kandinsky 5 Pro t2v (SD) 256x256x17, fp8, checkpointing, rank 32 (loaded in bf16 on the "
                            "GPU: fixed since)"}


def h200() -> str:
    made = results("gpu_nvidia-h200.json")
    rows = []
    for name, label in H200.items():
        r = made["results"][name]
        time = f"{r['seconds_per_step']:.2f}" if "seconds_per_step" in r else f"{r['seconds']:.2f} s"
        rows.append([label, f"{r['peak_allocated_gib']:.2f}", f"{r['estimate']['peak_allocated_gib']:.2f}",
                     f"{r['measured_over_estimate']['peak_allocated_gib']:.2f}", time,
                     f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""])
    render = made["results"]["render_hv15_720p"]
    return markdown(["measurement", "peak measured (GiB)", "estimate", "measured / estimate", "s/step (or s)", "MFU"],
                    rows, f"{made['machine']['card']}, torch {made['machine']['torch']}, {made['machine']['date']}: "
                    f"`gpu_nvidia-h200.json` (commit {made.get('commit', 'not recorded')}); MFU over the measured "
                    f"bf16 matmul peak, {made['results']['matmul_peak']['tflops']:.1f} TFLOP/s. HunyuanVideo 1.5 "
                    f"720p render 1280x720x121, fp8: one denoise call {render['denoise_peak_gib']:.2f} GiB in "
                    f"{render['denoise_s']:.1f} s, the tiled VAE decode {render['decode_tiled_peak_gib']:.2f} GiB in "
                    f"{render['decode_tiled_s']:.1f} s; the whole-latent decode: {render['decode']}. "
                    + estimates_now(made))


def estimates_now(made: dict[str, Any]) -> str:
    """The estimates of the table's rows as `gpu_estimates.json` holds them now, where they moved since the run's."""
    now = results("gpu_estimates.json")
    moved = [f"{label.split(',')[0]} {now['estimates'][name]['peak_allocated_gib']:.2f} GiB (was "
             f"{made['results'][name]['estimate']['peak_allocated_gib']:.2f})" for name, label in H200.items()
             if f"{now['estimates'][name]['peak_allocated_gib']:.2f}"
             != f"{made['results'][name]['estimate']['peak_allocated_gib']:.2f}"]
    return (f"The estimates as the code makes them now (`gpu_estimates.json`, commit {now['commit'][:7]}): "
            + ("; ".join(moved) if moved else "as above") + ".")


# -- check_cpu.json -------------------------------------------------------------------------------------------
CHECKS = {"demo": "demo (configs/demo.yaml on the tiny checkpoint)",
          "kandinsky5-video t2v-pro-sft-5s-hd": "Kandinsky 5 Pro t2v 5 s HD, 512x512@61",
          "hunyuanvideo-1.5 t2v-720p": "HunyuanVideo 1.5 720p t2v, 512x512@61"}


def pair(times: dict[str, Any], run: str) -> str:
    """`check_cpu.json`'s wall / CPU seconds of one run ("first" or "second")."""
    return f"{times[f'{run}_s']} / {times[f'{run}_cpu_s']}"


def check_times() -> str:
    made = results("check_cpu.json")
    before = made.get("before", "")[:7]
    rows = [[CHECKS[r["config"]], pair(r, "first"), pair(r["before"], "first") if "before" in r else "",
             pair(r, "second"), pair(r["before"], "second") if "before" in r else ""] for r in made["rows"]]
    demo = first(made["rows"], config="demo")
    return markdown(["config", "first check, wall / CPU (s)", f"before ({before})", "second check, wall / CPU (s)",
                     "before"], rows, f"`check_cpu.json`, commit {made['commit'][:7]}, {made['host']['cores']} "
                     f"cores; `check --no-estimates` on the demo config: {demo['no_estimates_s']} s.")


# -- the "Scripts and results" table: one row per benchmark, (benchmark, result) from its JSON -----------------
# A number that no JSON holds says where it comes from (an older JSON's commit, a commit's note, a script's default).
def decode_row(made: dict[str, Any]) -> tuple[str, str]:
    run = made["results"]
    height, width = made["keep"]["size_hw"]

    def took(name: str) -> str:
        return f"{run[name]['call_s']:.2f} s / {run[name]['peak_total_mb']:.0f} MB"
    return (f"clips: decode {made['keep']['frames']} of {made['clip']['frames']} frames of a {made['clip']['height']}p "
            f"H.264 clip, resized to {width}x{height} (CPU, medians of {made['runs']} fresh processes)",
            f"kept frames only (decord, in a worker): {run['kept_first49']['call_s']:.2f} s, "
            f"{run['kept_first49']['peak_total_mb']:.0f} MB peak (parent + worker); decode every frame then select: "
            f"{took('all_then_select_pyav')} (PyAV), {took('all_then_select_decord')} (decord); PyAV decode of all "
            f"frames without conversion: {run['full_decode_1thread']['call_s']:.2f} s")


def demo_row(made: dict[str, Any]) -> tuple[str, str]:
    fresh, setup, shift = made["make_demo_fresh_clone_s"], made["setup_s"], made["shift_px"]
    return (f"demo: `make setup` then `make demo` on a fresh clone of HEAD, then `make demo` again "
            f"({made['host']['cores']} cores, load {made['host']['load_1min_before_after'][0]:.1f})",
            f"{fresh:.0f} s the first time (setup {setup:.0f} s with pip's cache warm, the stages {fresh - setup:.0f} "
            f"s; the tiny world's weights ship, so no pre-training), {made['make_demo_again_s']:.0f} s the second; the "
            f"validation circle moves {shift['lora']:+.2f} px with the LoRA, {shift['base']:+.2f} px with the base; "
            f"eval loss {made['eval_loss']['change']:+.0%}. Before the weights shipped: 655 s "
            "(pre-training 292 s of it) at 73f459c (`demo_cpu.json` of e1c9a88)")


def patch_conv_row(made: dict[str, Any]) -> tuple[str, str]:
    hv15 = {run["max_slab_mb"]: run for run in made["runs"] if run["vae"] == "AutoencoderKLHunyuanVideo15"}
    k5 = first(made["runs"], vae="AutoencoderKLHunyuanVideo", max_slab_mb=32)
    diff = f"{hv15[32]['max_abs_diff_vs_stock']:.1e}".replace("e-0", "e-")
    return ("latents: patch conv peak memory, HunyuanVideo 1.5 VAE (real size, random weights), "
            f"{'x'.join(map(str, hv15[32]['input'][2:]))}, fp32 CPU",
            f"{hv15[32]['peak_ratio_vs_stock']:.2f}x the stock encode's peak with 32 MiB slabs "
            f"({hv15[256]['peak_ratio_vs_stock']:.2f}x at the default 256 MiB), max abs diff {diff}; HunyuanVideo VAE "
            f"(K5): {k5['peak_ratio_vs_stock']:.2f}x")


def patch_conv_bf16_row(made: dict[str, Any]) -> tuple[str, str]:
    run = max((run for run in made["runs"] if run["max_slab_mb"] == 4), key=lambda run: run["input"][2])
    return (f"latents: same, bf16, {'x'.join(map(str, run['input'][2:]))}",
            f"{run['peak_ratio_vs_stock']:.2f}x the stock peak with 4 MiB slabs, {run['time_ratio_vs_stock']:.1f}x the "
            "time")


def encode_latents_row(made: dict[str, Any]) -> tuple[str, str]:
    mode, distribution = made["tiny_kandinsky5_video"]["mode"], made["tiny_kandinsky5_video"]["distribution"]
    return (f"latents: `encode_latents` on the demo (tiny K5, {mode['latents']} clips, {made['machine']['threads']} "
            f"thread, medians of {len(mode['first_run_s'])})",
            f"first run {mode['first_run_latents_per_s']:.1f} latents/s (VAE load included); fully cached rerun "
            f"{1000 * mode['cached_rerun_s']:.0f} ms; `latent_sampling: distribution` as fast, "
            f"{distribution['shard_bytes'] / mode['shard_bytes']:.2f}x the shard bytes")


def store_row(made: dict[str, Any]) -> tuple[str, str]:
    way = made["store_vs_npy_k5_lite_5s_latent"]["float32"]
    store, npy, before = way["store"], way["npy"], way["store_before_raw_cells"]
    return (f"latents: store vs one `.npy` per latent, {way['items']} Kandinsky 5 Lite 5 s latents at 512x768 (float32 "
            f"{'x'.join(map(str, made['store_vs_npy_k5_lite_5s_latent']['shape']))}, {way['item_mb']:.1f} MB), random "
            "16-key batch, reads interleaved with `.npy`'s",
            f"batch read {store['read16_warm_ms']:.0f} ms from page cache = {store['read16_warm_mb_per_s'] / 1000:.1f} "
            f"GB/s, {store['read16_warm_vs_npy']:.2f}x `.npy`'s speed ({npy['read16_warm_ms']:.0f} ms); evicted "
            f"{store['read16_evicted_ms']:.0f} ms, {store['read16_evicted_vs_npy']:.2f}x `.npy` "
            f"({npy['read16_evicted_ms']:.0f} ms: a memory map faults its pages in, `read` streams them); "
            f"{store['bytes_on_disk'] / npy['bytes_on_disk']:.2f}x the bytes; write "
            f"{store['write_with_sync_mb_per_s']:.0f} MB/s with an fsync per shard (`.npy` "
            f"{npy['write_mb_per_s']:.0f} without). Raw-bytes cells, uncompressed floats, memory-mapped reads. The "
            f"layout before (fixed-shape tensor column, zstd), read by the same code: {before['read16_warm_ms']:.0f} "
            f"ms, {before['read16_warm_vs_npy']:.2f}x `.npy`. Under load 10 on 2 cores the ratio held: 1.14x `.npy` "
            "warm (`latents_cpu.json` of a8bd8ce)")


def s3_row(made: dict[str, Any]) -> tuple[str, str]:
    s3, local = made["s3"], made["local"]
    return (f"latents: a {made['batch']}-key training batch from the store on S3 vs a local store ({made['items']} "
            f"Kandinsky 5 Lite 5 s latents, {made['item_mb']:.1f} MB each; moto's S3 server on loopback through s3fs; "
            "one Store per run, index warm; interleaved, medians of 9 (`--batches`' default); load 12 on "
            f"{made['machine']['cores']} cores (noted at d7d6ac6))",
            f"S3 {s3['read16_ms'] / 1000:.2f} s per batch = {s3['read16_mb_per_s']:.1f} MB/s, "
            f"{made['s3_vs_local_time']:.1f}x the local store's {local['read16_ms']:.0f} ms "
            f"({local['read16_mb_per_s']:.0f} MB/s, memory-mapped); writes {s3['write_mb_per_s']:.1f} vs "
            f"{local['write_mb_per_s']:.1f} MB/s. moto holds objects in a Python process: a real S3's speed is not "
            "measured, the client's cost over loopback is")


def train_step_row(made: dict[str, Any]) -> tuple[str, str]:
    times = [ms for run in made["rounds"] for ms in (run["ours_ms"], run["bare_ms"], run["bare_prep_ms"])]
    tokens = re.search(r"(\d+) visual tokens", made["input"])[1]
    return ("lora: step time of `train_lora`'s loop vs a bare forward/backward/AdamW step (tiny K5, "
            f"{tokens} tokens, CPU, best of {len(made['rounds'])} rounds)",
            f"{made['overhead_pct']:+.1f}% (best rounds {made['best_ours_ms']:.1f} vs {made['best_bare_ms']:.1f} "
            f"ms/step; vs a bare step that rebuilds its inputs: {made['overhead_vs_prep_pct']:+.1f}%). The same "
            "benchmark gave +6.0% (10 rounds, d832181) and +8.7% (torch 2.13, f6b5eba) on earlier days: per-round "
            f"times swing {min(times):.0f}-{max(times):.0f} ms on this shared host, so the loop's overhead is below "
            f"what it can resolve; goal <= {made['goal_pct']:.0f}%")


def scale_row(made: dict[str, Any]) -> tuple[str, str]:
    small, big, growth = made["10000"], made["100000"], made["growth_per_10x"]

    def both(step: str, key: str, digits: int = 2) -> str:
        return f"{small[step][key]:.{digits}f} / {big[step][key]:.{digits}f} s"
    peaks = {(step, size): run["peak_mb"] - run["base_mb"] for size in ("10000", "100000")
             for step, run in made[size].items() if isinstance(run, dict)}
    (step, size), peak = max(peaks.items(), key=lambda item: item[1])
    return ("scale: one dataset of 10k / 100k synthetic images + captions (tiny K5, 100 distinct captions), each "
            "step in a fresh process; growth per 10x of clips",
            f"`loraflow check` {both('plan', 's', 1)} ({growth['plan']['s']}x); clips planning with a cold probe "
            f"cache {both('probe_cold', 's', 1)} ({growth['probe_cold']['s']}x), warm {both('probe_warm', 's', 1)} "
            f"({growth['probe_warm']['s']}x); clips manifest write {both('manifest', 'write_s')}, read "
            f"{both('manifest', 'read_s')}; `dataset_watch` tick ({big['sensor']['files'] // 1000}k files at 100k) "
            f"{both('sensor', 'first_tick_s')} ({growth['sensor']['first_tick_s']}x), next tick "
            f"{both('sensor', 'next_tick_s')}; text_embeds rerun (all cached) {both('text_embeds', 's')} "
            f"({growth['text_embeds']['s']}x). Peak memory over the process's imports: at most {peak} MB ({step}, "
            f"{int(size) // 1000}k rows as Python dicts).")


def estimates_row(made: dict[str, Any]) -> tuple[str, str]:
    k5 = first(made["rows"], flavour="t2v-lite-sft-5s", variant="bf16")
    hv = first(made["rows"], flavour="t2v-480p", variant="bf16")
    return ("estimates: the lora stage at released size, no weights (`benchmarks/estimates_released.py`: fake tensors "
            f"on this CPU; K5 Lite {k5['size']}, HunyuanVideo 1.5 {hv['size']}, bf16, rank 16, batch 1)",
            "[the table below](#estimates-at-released-size), written from the JSON; Kandinsky 5 Lite i2v as t2v: its "
            "condition channels are in every Lite input")


def check_row(made: dict[str, Any]) -> tuple[str, str]:
    demo, k5, hv = (first(made["rows"], config=config) for config in CHECKS)
    seconds = [row["second_s"] for row in made["rows"]]
    return ("check: `loraflow check` first and second run, fresh process, empty estimates cache "
            f"(`benchmarks/bench_check.py --before`, main {made['before'][:7]} interleaved, {made['host']['cores']} "
            "cores at load 0.0-2.0 (noted at 3313c9c))",
            f"first run, wall / CPU: demo {pair(demo, 'first')} s (before {pair(demo['before'], 'first')}), "
            f"Kandinsky 5 Pro HD 512x512@61 before download {pair(k5, 'first')} s (before "
            f"{pair(k5['before'], 'first')}), HunyuanVideo 1.5 720p {pair(hv, 'first')} s (before "
            f"{pair(hv['before'], 'first')}): under issue 41's 30 s on a quiet host (a check takes more CPU time under "
            "load: K5 Pro at 7d3505e 35.9 s at load 2.3-3.5, `check_cpu.json` of b0247b8); second run "
            f"{min(seconds)}-{max(seconds)} s; `--no-estimates` {demo['no_estimates_s']} s "
            "([below](#loraflow-checks-time-first-and-second-run))")


def text_embeds_row(made: dict[str, Any]) -> tuple[str, str]:
    tiny = made["tiny_kandinsky5_video"]
    return (f"text_embeds (tiny K5, 200 captions, {made['machine']['threads']} thread)",
            f"{tiny['encode_first_run_texts_per_s']:.0f} texts/s; Parquet {tiny['ratio_bytes_vs_padded']:.2f}x the "
            f"bytes of one padded `torch.save` per caption, {tiny['ratio_bytes_vs_same_tokens']:.2f}x of unpadded "
            f"ones; 16-key batch load {tiny['load_batch16_store_get_ms']:.0f} ms (`torch.load` of 16 files: "
            f"{tiny['load_batch16_torch_load_ms']:.0f} ms)")


def text_precision_row(made: dict[str, Any]) -> tuple[str, str]:
    fp32, bf16, int8 = (first(made["rows"], precision=name) for name in ("fp32", "bf16", "int8-torchao"))
    return ("text_embeds: `text_encoder_1_precision` on one real-size Qwen2.5-VL-7B decoder layer (random weights, "
            f"{made['tokens']} tokens, CPU)",
            f"weights {fp32['layer_weight_mb']:.0f} MB fp32, {bf16['layer_weight_mb']:.0f} MB bf16, "
            f"{int8['layer_weight_mb']:.0f} MB int8-torchao ({made['int8_vs_bf16_bytes']:.2f}x bf16; 28 layers: "
            f"{fp32['layers_x28_gb']} / {bf16['layers_x28_gb']} / {int8['layers_x28_gb']} GB, plus the "
            f"{made['token_embedding_gb_bf16']} GB bf16 token embedding); output cosine vs fp32 "
            f"{bf16['cosine_vs_fp32']} bf16, {int8['cosine_vs_fp32']} int8; CPU forward "
            f"{fp32['forward_ms'] / 1000:.1f} s fp32, {bf16['forward_ms'] / 1000:.1f} s bf16 and "
            f"{int8['forward_ms'] / 1000:.1f} s int8 (no fast bf16/int8 path on this CPU)")


def imports_row(made: dict[str, Any]) -> tuple[str, str]:
    median = {(row["tree"].split()[0], row["entry_point"].split(" (")[0]): row["median_s"] for row in made["rows"]}
    planning, steps = "loraflow check, clips stage: planning", "Dagster step process / code server"
    load = made["load_average_1min_per_round"]
    return ("imports: what each entry point imports before any work, fresh interpreter each, this tree beside c2246c0 "
            f"(before `plan_family`), interleaved, medians of {made['rounds']} ({made['cpu_count']} cores, load "
            f"{min(load):.0f}-{max(load):.0f})",
            f"`loraflow check`'s and the clips stage's planning {median['this', planning]:.2f} s (was "
            f"{median['before', planning]:.2f} s: `get_family` imported torch, diffusers, transformers); "
            f"`loraflow.definitions`, every Dagster step process, {median['this', steps]:.2f} s (was "
            f"{median['before', steps]:.2f} s); `loraflow.cli` {median['this', 'loraflow CLI']:.2f} s; a stage that "
            f"loads a model still pays {median['this', 'a stage that loads a model: get_family']:.1f} s for the "
            "family module")


SCRIPTS: list[tuple[str, Callable[[dict[str, Any]], tuple[str, str]]]] = [
    ("decode_cpu.json", decode_row), ("demo_cpu.json", demo_row), ("patch_conv_cpu.json", patch_conv_row),
    ("patch_conv_cpu_bf16.json", patch_conv_bf16_row), ("latents_cpu.json", encode_latents_row),
    ("latents_cpu.json", store_row), ("s3_read_cpu.json", s3_row), ("train_step_cpu.json", train_step_row),
    ("scale_cpu.json", scale_row), ("estimates_released.json", estimates_row), ("check_cpu.json", check_row),
    ("text_embeds_cpu.json", text_embeds_row), ("text_precision_cpu.json", text_precision_row),
    ("imports_cpu.json", imports_row)]


def scripts() -> str:
    return markdown(["benchmark", "result", "file"], [[*row(results(name)), f"`{name}`"] for name, row in SCRIPTS])



# -- the numbers in the prose: `<!-- value:NAME -->TEXT<!-- /value -->` ---------------------------------------------
def demo_values() -> dict[str, str]:
    made = results("demo_cpu.json")
    host, shift = made["host"], made["shift_px"]
    return {"demo-cores": f"{host['cores']} cores",
            "demo-at": f"commit {made['commit'][:7]}, load {host['load_1min_before_after'][0]:.1f}",
            "demo-lora-px": f"{shift['lora']:+.2f} px", "demo-base-px": f"{shift['base']:+.2f} px",
            "demo-loss-drop": f"{-made['eval_loss']['change']:.0%}",
            "demo-fresh": f"{made['make_demo_fresh_clone_s']:.0f} s", "demo-setup": f"{made['setup_s']:.0f} s",
            "demo-again": f"{made['make_demo_again_s']:.0f} s"}


def scale_values() -> dict[str, str]:
    made = results("scale_cpu.json")
    big = made["100000"]
    # every timed step's growth but text_embeds' first run (the same 103 texts encoded cold at both sizes)
    growth = [times[key] for step, times in made["growth_per_10x"].items() for key in times
              if (key == "s" or key.endswith("_s")) and (step, key) != ("text_embeds", "first_s")]

    def per_clip(step: str) -> str:
        return f"{1000 * big[step]['s'] / big[step]['clips']:.1f} ms"
    return {"scale-growth": f"{min(growth):.0f}-{max(growth):.0f}x",
            "scale-tick": f"{big['sensor']['first_tick_s']:.1f} s at 100k images ({big['sensor']['files'] // 1000}k "
                          "files with captions)",
            "scale-check-probe": f"{per_clip('plan')} each: {big['plan']['s']:.0f} s at 100k",
            "scale-cold-probe": per_clip("probe_cold")}


def check_values() -> dict[str, str]:
    made = results("check_cpu.json")
    pro = first(made["rows"], config="kandinsky5-video t2v-pro-sft-5s-hd")
    return {"check-before": made["before"][:7], "check-commit": made["commit"][:7],
            "check-cores": f"{made['host']['cores']}-core", "check-pro-before": f"{pro['before']['first_cpu_s']} s CPU"}


RENDER_STEPS, CALLS_PER_STEP, LATENT_CLIPS = 50, 2, 6  # as the prose says: 50 steps, CFG's two calls; run.py's 6 clips


def h200_values() -> dict[str, str]:
    made = results("gpu_nvidia-h200.json")
    run, machine, now = made["results"], made["machine"], results("gpu_estimates.json")["estimates"]
    render, pro, lite = run["render_hv15_720p"], run["train_k5_pro_fp8"], run["train_k5_checkpointing"]
    # each measurement's worst memory ratio; the sentence says "within X% but one": X is the second worst
    worst = sorted(max(abs(ratio - 1) for key, ratio in r["measured_over_estimate"].items() if key.endswith("_gib"))
                   for r in run.values() if any(key.endswith("_gib") for key in r["measured_over_estimate"]))
    card_mib = int(re.search(r"(\d+) MiB", machine["card"])[1])
    peak = run["matmul_peak"]
    return {"h200-machine": machine["card"],
            "h200-software": f"torch {machine['torch']}, diffusers {machine['diffusers']}, transformers "
                             f"{machine['transformers']}, peft {machine['peft']}, {machine['date']}",
            "h200-estimates-at": re.search(r"commit (\w+)", machine["estimates"])[1],
            "h200-matmul": f"**{peak['tflops']:.1f} TFLOP/s**", "h200-matmul-size": f"{peak['size']}³",
            "h200-within": f"{100 * worst[-2]:.0f}%",
            "h200-pro-load": f"{pro['load']['load_peak_gib']:.1f} GiB",
            "h200-pro-after": f"{pro['load']['after_load_gib']:.1f}",
            "h200-pro-weights": f"{pro['estimate']['parts_gib']['weights']:.1f}",
            "h200-pro-estimate": f"{now['train_k5_pro_fp8']['peak_allocated_gib']:.1f} GiB",
            "h200-card-gib": f"{card_mib / 1024:.0f} GiB",
            "h200-decode-activations": f"{render['estimate']['decode_activations_gib']:.1f} GiB",
            "h200-tiled": f"{render['decode_tiled_peak_gib']:.0f} GiB",
            "h200-denoise-s": f"{render['denoise_s']:.1f} s",
            "h200-render-minutes": f"about {RENDER_STEPS * CALLS_PER_STEP * render['denoise_s'] / 60:.0f} minutes",
            "h200-denoise-peak": f"{render['denoise_peak_gib']:.1f} GiB",
            "h200-decode-tiled-peak": f"{render['decode_tiled_peak_gib']:.1f} GiB",
            "h200-vae-256": f"{run['vae_encode_hv15_256x73']['peak_allocated_gib']:.1f} GiB",
            "h200-mfu-plain": f"{run['train_k5_plain']['mfu']:.0%}", "h200-mfu-checkpointing": f"{lite['mfu']:.1%}",
            "h200-tread-speedup": f"{lite['seconds_per_step'] / run['train_k5_tread0.5']['seconds_per_step']:.1f}x",
            "h200-mfu-tread": f"{run['train_k5_tread0.5']['mfu']:.0%}", "h200-mfu-pro": f"{pro['mfu']:.0%}",
            "h200-pro-tokens": f"{pro['visual_tokens']:,}",
            "h200-budget": f"{made['budget_s'] / 60:.0f} minutes",
            "h200-encode-one": f"{run['vae_encode_hv15_768x81']['seconds']:.1f} s",
            "h200-encode-six": f"about {LATENT_CLIPS * run['vae_encode_hv15_768x81']['seconds']:.0f} s"}


def values() -> dict[str, str]:
    """Every value NAME's text, from the JSONs as they are now."""
    return {**demo_values(), **scale_values(), **check_values(), **h200_values()}


TABLES: dict[str, Callable[[], str]] = {"seed-guides": seed_guides, "estimates-released": estimates_released,
                                        "renders": renders, "h200": h200, "check-times": check_times,
                                        "scripts": scripts}


def rewritten(text: str) -> str:
    """`text` with every marked table and value written from its JSON (an unknown NAME: KeyError naming it; a value
    whose closing marker is not on its line: ValueError)."""
    def table(match: re.Match) -> str:
        if match.group(2) not in TABLES:
            raise KeyError(f"<!-- table:{match.group(2)} -->: no such table in benchmarks/tables.py "
                           f"(known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[match.group(2)]() + match.group(4)

    fresh = values()

    def value(match: re.Match) -> str:
        if match.group(2) not in fresh:
            raise KeyError(f"<!-- value:{match.group(2)} -->: no such value in benchmarks/tables.py "
                           f"(known: {', '.join(fresh)})")
        return match.group(1) + fresh[match.group(2)] + match.group(4)
    for n, line in enumerate(text.split("\n"), 1):
        if line.count("<!-- value:") != len(VALUE.findall(line)):
            raise ValueError(f"line {n}: a <!-- value:NAME --> without its <!-- /value --> on the same line")
        if re.match(r"\s*(?:[-*] +)?<!-- value:", line):  # CommonMark opens an HTML block there: shown raw
            raise ValueError(f"line {n}: a <!-- value:NAME --> begins the line: put a word of the text before it")
    return VALUE.sub(value, MARKED.sub(table, text))


def differing(path: Path) -> list[str]:
    """The marked tables of `path` whose text is not what their JSON gives, then its values (`value:NAME`)."""
    text = path.read_text()
    fresh = {m.group(2): m.group(3) for m in MARKED.finditer(rewritten(text))}
    now = values()
    return [m.group(2) for m in MARKED.finditer(text) if fresh[m.group(2)] != m.group(3)] + \
        [f"value:{m.group(2)}" for m in VALUE.finditer(text) if now[m.group(2)] != m.group(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a table or value differs")
    check = parser.parse_args().check
    stale = [f"{path.relative_to(ROOT)}: {name}" for path in DOCS for name in differing(path)]
    if check:
        sys.exit("tables and values differing from their JSON (run benchmarks/tables.py):\n" + "\n".join(stale)
                 if stale else 0)
    for path in DOCS:
        text = path.read_text()
        if rewritten(text) != text:
            path.write_text(rewritten(text))
    print("\n".join(f"rewrote {line}" for line in stale) or "every table and value is its JSON's")


if __name__ == "__main__":
    main()
