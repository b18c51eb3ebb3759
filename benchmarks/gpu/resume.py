"""A training run killed after its first checkpoint and resumed trains the LoRA an uninterrupted run trains.

The clips, latents and text_embeds stages write the caches (the tiny demo model and data: real-size checkpoints
are not built here); `python -m loraflow.train_main` then trains them twice, in two output folders: once through,
once SIGKILLed as soon as the checkpoint at step 2 is on disk and started again. The two LoRA files must be equal
bit for bit (same device, same kernels). Records the seconds of each launch and where the killed one resumed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from offload import demo_config

from loraflow.pipelines.sources import model_source

STEPS, CHECKPOINT_AT = 4, 2


def measure(work: Path, smoke: bool) -> dict[str, Any]:
    import yaml

    from loraflow.config import load_config
    from loraflow.pipelines import get_family
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.store import Store

    root = work / "demo"
    base = yaml.safe_load(((root / "config.yaml") if (root / "config.yaml").is_file() else demo_config(root))
                          .read_text())
    configs = {}
    for run in ("through", "killed"):
        configs[run] = root / f"resume-{run}.yaml"
        configs[run].write_text(yaml.safe_dump({**base, "cache_dir": str(work / "resume-cache"),
                                                "output_dir": str(work / f"resume-{run}"),
                                                "max_train_steps": STEPS, "checkpointing_steps": CHECKPOINT_AT}))
    config = load_config(configs["through"])
    family, store = get_family(config), Store(config.cache_dir)
    began = time.perf_counter()
    build_clips(config, family, model_source(config), store)
    encode_latents(config, family, model_source(config), store)
    encode_texts(config, family, model_source(config), store)
    caches_s = time.perf_counter() - began

    through, through_s = train_main(configs["through"])
    killed_at = kill_after_checkpoint(configs["killed"], work / "resume-killed")
    resumed, resumed_s = train_main(configs["killed"])
    return {"steps": STEPS, "checkpoint_at": CHECKPOINT_AT, "caches_s": round(caches_s, 2),
            "through_s": round(through_s, 2), "resumed_s": round(resumed_s, 2), "killed_at_checkpoint": killed_at,
            "resumed_at_step": resumed["resumed_at_step"],
            "same_lora_bits": same_tensors(Path(through["lora_path"]), Path(resumed["lora_path"]))}


def train_main(config: Path) -> tuple[dict[str, Any], float]:
    """One launch of the lora stage's process; its printed summary and its seconds."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "loraflow.train_main", str(config)], capture_output=True, text=True,
                          check=True)
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line), time.perf_counter() - began


def kill_after_checkpoint(config: Path, out: Path, tries: int = 5) -> str:
    """Start train_main, SIGKILL it once a checkpoint folder is published; the checkpoint's name. A tiny model's
    steps can outrun the 50 ms poll (the run saved a later checkpoint or finished before the kill landed): such a
    launch is not the kill this measures, so it is started again from an empty output folder."""
    from loraflow.training.checkpoints import LORA_FILE

    for _ in range(tries):
        shutil.rmtree(out, ignore_errors=True)
        process = subprocess.Popen([sys.executable, "-m", "loraflow.train_main", str(config)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not (seen := sorted(out.glob("runs/*/checkpoints/step-???????"))):
                if process.poll() is not None:
                    raise RuntimeError(f"train_main ended (exit {process.returncode}) before its first checkpoint")
                time.sleep(0.05)
            process.send_signal(signal.SIGKILL)
        finally:
            process.wait()
        left = sorted(out.glob("runs/*/checkpoints/step-???????"))
        if left == seen[:1] and not list(out.glob(f"runs/*/{LORA_FILE}")):
            return seen[0].name
    raise RuntimeError(f"train_main saved past its first checkpoint before the kill in {tries} launches")


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)
