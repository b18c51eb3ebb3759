"""What one Kandinsky 5 visual block costs the CPU per training step besides its arithmetic (issue 61 item 3): the
ATen operations a block dispatches in one forward + backward (each one a kernel launch on a GPU, and Python and
dispatcher work on any device), by kind, for the training setups that change them; and what regional
`torch.compile` (`dynamo_use_regional_compilation: true`: diffusers' `compile_repeated_blocks`, one compile per block
class) costs to compile and gives per step.

Numbers: the tiny Kandinsky 5 Video transformer (loraflow/demo/tiny.py; Lite and Pro share the block class, so the
count per block is Pro's too: only the widths differ), prepared as `train_lora` prepares it
(training/model_setup.prepare_transformer: LoRA rank 16, fp32 adapter), one micro-step through `flow_terms` on a
fixed batch. Operations are counted by a TorchDispatchMode switched on by block 0's forward and backward hooks, so
only that block's own work is counted, by kind and by origin: the innermost Python frame of loraflow, peft or
diffusers that called down to it, or autograd's engine (`backward`). loraflow's own code dispatches none inside a
block (tests/training/test_block_ops.py): what a step issues per block is diffusers' block, peft's LoRA wrappers
and their backward. Step times are this CPU's at tiny widths, where a step is nearly all overhead:
compare the rows with each other, within one run.

    python benchmarks/bench_block_ops.py           # writes benchmarks/results/block_ops_cpu.json (compile: minutes)
    python benchmarks/bench_block_ops.py --quick   # the operation counts only
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = "block_ops_cpu.json"
SETUPS = {  # name -> the config keys that change a block's operations
    "lora": {},
    "lora + ffn": {"lora_include_ffn": True},
    "lora + checkpointing": {"gradient_checkpointing": True},
    "lora + ffn + checkpointing": {"lora_include_ffn": True, "gradient_checkpointing": True},
    "lora + fp8-layerwise": {"base_model_precision": "fp8-layerwise"},
}


def prepared(tiny: Path, **settings: Any) -> tuple[Any, Any, Any]:
    """(config, family, transformer) as train_lora prepares them."""
    import torch

    from loraflow.config import parse_config
    from loraflow.pipelines import get_family
    from loraflow.pipelines.base import load_component
    from loraflow.training.model_setup import base_dtype, enable_offload, prepare_transformer

    config = parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": str(tiny),
                           "datasets": [{"id": "d", "instance_data_dir": str(tiny)}], "lora_rank": 16, **settings})
    family = get_family(config)
    transformer, _ = prepare_transformer(load_component(tiny, "transformer", base_dtype(config)), config, family)
    enable_offload(transformer, config, family, torch.device("cpu"))  # nothing offloaded: it must add nothing
    transformer.train()
    return config, family, transformer


def micro_step(config: Any, family: Any, transformer: Any) -> Any:
    """One forward + backward of a fixed batch; returns a function that runs it again."""
    import torch

    from loraflow.training.batches import MicroBatch, step_draws
    from loraflow.training.step import flow_terms, uses_autocast

    generator = torch.Generator().manual_seed(0)
    shape = (1, 16, 3, 8, 8)
    text = {k: torch.randn(1, *v.shape, generator=generator)
            for k, v in family.example_text_row(transformer.config, 8).items()}
    batch = MicroBatch([], torch.randn(shape, generator=generator), text, step_draws(config, family, 0, shape))

    def run() -> None:
        flow_terms(transformer, family, batch, torch.device("cpu"), uses_autocast(config, torch.device("cpu"))
                   ).flow.backward()

    return run


def package_folders() -> dict[str, str]:
    """Whose Python code dispatched an operation: each package's own folder (a path prefix, so a checkout that sits
    in a folder named `loraflow` or holds its venv inside attributes each frame to the right package)."""
    import diffusers
    import peft
    import torch.autograd

    import loraflow

    return {name: os.path.dirname(module.__file__) + os.sep for name, module in
            (("loraflow", loraflow), ("peft", peft), ("diffusers", diffusers), ("backward", torch.autograd))}


def origin(frame: Any, folders: dict[str, str]) -> str:
    """The package whose code (innermost first) called down to an operation: `loraflow`, `peft`, `diffusers`, or
    `backward` (the autograd engine, reached from `.backward()` with no model code between), else `other`."""
    while frame is not None:
        for name, folder in folders.items():
            if frame.f_code.co_filename.startswith(folder):
                return name
        frame = frame.f_back
    return "other"


def block_ops(config: Any, family: Any, transformer: Any) -> tuple[collections.Counter, collections.Counter]:
    """The ATen operations visual block 0 dispatches in one forward + backward, by kind and by origin."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.inside, self.ops, self.origins = False, collections.Counter(), collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if self.inside:
                self.ops[func.overloadpacket.__name__] += 1
                self.origins[origin(sys._getframe(1), folders)] += 1
            return func(*args, **(kwargs or {}))

    folders = package_folders()
    counting = Counting()

    def enter(*_: Any) -> None:
        counting.inside = True

    def leave(*_: Any) -> None:
        counting.inside = False

    block = transformer.visual_transformer_blocks[0]
    hooks = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave),
             block.register_full_backward_pre_hook(enter), block.register_full_backward_hook(leave)]
    run = micro_step(config, family, transformer)
    with counting:
        run()
    for hook in hooks:
        hook.remove()
    return counting.ops, counting.origins


def step_ms(run: Any, rounds: int = 5, steps: int = 4) -> float:
    """The fastest of `rounds` means of `steps` steps, in ms: a shared host's load only adds time."""
    run()  # warm
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        means.append((time.perf_counter() - start) / steps * 1000)
    return min(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the counts only (no timing, no compile)")
    args = parser.parse_args()
    # the compile row times a cold compile: inductor's cache of earlier runs (in /tmp) would make it a cache read
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor = tempfile.mkdtemp(prefix="bench-block-ops-inductor-")
    atexit.register(shutil.rmtree, inductor, ignore_errors=True)
    import torch

    from benchmarks import record
    from loraflow.demo.tiny import build_tiny

    torch.manual_seed(0)
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "setups": {}}
    with tempfile.TemporaryDirectory() as folder:
        tiny = build_tiny("kandinsky5-video", Path(folder) / "k5")
        for name, settings in SETUPS.items():
            config, family, transformer = prepared(tiny, **settings)
            ops, origins = block_ops(config, family, transformer)
            row: dict[str, Any] = {"settings": settings, "ops_per_block": sum(ops.values()),
                                   "by_origin": dict(origins.most_common()), "by_kind": dict(ops.most_common())}
            if not args.quick:
                row["step_ms"] = round(step_ms(micro_step(config, family, transformer)), 2)
            result["setups"][name] = row
            print(f"{name}: {row['ops_per_block']} ops per block fwd+bwd ({row['by_origin']})"
                  + (f", {row['step_ms']} ms per step" if "step_ms" in row else ""), flush=True)
        if not args.quick:
            config, family, transformer = prepared(tiny, dynamo_use_regional_compilation=True)
            run = micro_step(config, family, transformer)
            start = time.perf_counter()
            run()  # the first step compiles the block class (forward and backward)
            first = time.perf_counter() - start
            compiled = step_ms(run)
            eager = result["setups"]["lora"]["step_ms"]
            result["regional_compile"] = {"first_step_s": round(first, 1), "step_ms": round(compiled, 2),
                                          "eager_step_ms": eager, "eager_over_compiled": round(eager / compiled, 2)}
            print(f"regional compile: first step {first:.1f} s, then {compiled:.2f} ms per step (eager {eager} ms)")
    out = record.results_path(RESULTS)
    record.write(out, result, indent=1, quick=args.quick)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
