"""The tables of README.md and docs/benchmarks.md that come from a results JSON, written from it.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` (a NAME may appear in several files: the
same table each time), and `TABLES[NAME]` writes it from `benchmarks/results/`. Rerun after a benchmark:

    .venv/bin/python benchmarks/tables.py           # rewrites every marked table in place
    .venv/bin/python benchmarks/tables.py --check   # exit 1, naming each table whose text is not its JSON's

tests/test_docs.py fails while a marked table differs from what its JSON gives, or a marker has no table here.
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


def results(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def markdown(header: list[str], rows: list[list[Any]], note: str) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + f"\n\n{note}\n"


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
                    f"{render['decode_tiled_s']:.1f} s; the whole-latent decode: {render['decode']}.")


# -- check_cpu.json -------------------------------------------------------------------------------------------
CHECKS = {"demo": "demo (configs/demo.yaml on the tiny checkpoint)",
          "kandinsky5-video t2v-pro-sft-5s-hd": "Kandinsky 5 Pro t2v 5 s HD, 512x512@61",
          "hunyuanvideo-1.5 t2v-720p": "HunyuanVideo 1.5 720p t2v, 512x512@61"}


def check_times() -> str:
    made = results("check_cpu.json")

    def pair(times: dict[str, Any], run: str) -> str:
        return f"{times[f'{run}_s']} / {times[f'{run}_cpu_s']}"

    before = made.get("before", "")[:7]
    rows = [[CHECKS[r["config"]], pair(r, "first"), pair(r["before"], "first") if "before" in r else "",
             pair(r, "second"), pair(r["before"], "second") if "before" in r else ""] for r in made["rows"]]
    demo = next(r for r in made["rows"] if r["config"] == "demo")
    return markdown(["config", "first check, wall / CPU (s)", f"before ({before})", "second check, wall / CPU (s)",
                     "before"], rows, f"`check_cpu.json`, commit {made['commit'][:7]}, {made['host']['cores']} "
                     f"cores; `check --no-estimates` on the demo config: {demo['no_estimates_s']} s.")


TABLES: dict[str, Callable[[], str]] = {"seed-guides": seed_guides, "estimates-released": estimates_released,
                                        "renders": renders, "h200": h200, "check-times": check_times}


def rewritten(text: str) -> str:
    """`text` with every marked table written from its JSON (an unknown NAME: KeyError naming it)."""
    def table(match: re.Match) -> str:
        if match.group(2) not in TABLES:
            raise KeyError(f"<!-- table:{match.group(2)} -->: no such table in benchmarks/tables.py "
                           f"(known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[match.group(2)]() + match.group(4)
    return MARKED.sub(table, text)


def differing(path: Path) -> list[str]:
    """The marked tables of `path` whose text is not what their JSON gives."""
    text = path.read_text()
    fresh = {m.group(2): m.group(3) for m in MARKED.finditer(rewritten(text))}
    return [m.group(2) for m in MARKED.finditer(text) if fresh[m.group(2)] != m.group(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a table differs")
    check = parser.parse_args().check
    stale = [f"{path.relative_to(ROOT)}: {name}" for path in DOCS for name in differing(path)]
    if check:
        sys.exit("tables differing from their JSON (run benchmarks/tables.py):\n" + "\n".join(stale) if stale else 0)
    for path in DOCS:
        text = path.read_text()
        if rewritten(text) != text:
            path.write_text(rewritten(text))
    print("\n".join(f"rewrote {line}" for line in stale) or "every table is its JSON's")


if __name__ == "__main__":
    main()
