"""FSDP2 on two CPU processes (gloo): the sharded run trains the LoRA one process trains, bit for bit.

Exact by construction, as in test_distributed.py: every rank gathers a block's full fp32 weights before its forward
(a copy), runs the same kernels on the same shapes as one process, and FSDP reduce-scatters each LoRA gradient once
per optimizer step as fl(g0 + g1) / 2 (halving is exact), what one process accumulating two halves computes. AdamW
is elementwise, so each rank updating its half is the whole update. The reference is one process with
`fully_shard` over a mesh of one rank (every parameter whole): FSDP's backward hooks change the order in which
autograd adds up the gradient of a tensor read by several blocks (Kandinsky 5's text stream, read by every visual
block's cross-attention), so against a process without them the text blocks' LoRA gradients differ in their last
bits (3e-8 after one step here). The gradient norm is summed per shard, then over ranks: its tolerance below is
derived; while it stays below max_grad_norm the clip factor is exactly 1 and the weights stay bit-equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from loraflow.assets.runs.launch import launch_command
from loraflow.pipelines import get_family
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.run import current_run_dir
from tests.factory import REPO, TWO_RANK_SETTINGS, make_config, run_ranks, same_lora_file, train
from tests.servers import free_port

# The reference: train_lora as one process with `fully_shard` over a mesh of one rank (the config refuses
# fsdp with num_processes 1: only a test wants this).
REFERENCE = '''
import sys
import torch.distributed as dist
from loraflow.config import load_config
from loraflow.training import loop as T
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store

config = load_config(sys.argv[1]).model_copy(update={"fsdp": True})
dist.init_process_group("gloo")
T.train_lora(config, get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names))
dist.destroy_process_group()
'''
# Runs train_lora as one rank and records what this rank holds: every parameter's local and full element count.
PROBE = '''
import json, sys
from pathlib import Path
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from loraflow.config import load_config
from loraflow.training import loop as T
from loraflow.training.launch.distributed import leave, world_from_env
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store

config_path, probe = sys.argv[1], Path(sys.argv[2])
held = {}
run_steps = T.run_steps
def count(*args, **kwargs):
    transformer = args[2].transformer  # run_steps(run, plan, trained, ...)
    params = list(transformer.parameters())
    held.update(local=sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
                full=sum(p.numel() for p in params), sharded=sum(isinstance(p, DTensor) for p in params),
                params=len(params), threads=torch.get_num_threads(),
                units=[name for name, m in transformer.named_modules() if isinstance(m, FSDPModule)])
    return run_steps(*args, **kwargs)
T.run_steps = count
config = load_config(config_path)
T.train_lora(config, get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names))
(probe / f"rank{world_from_env().rank}.json").write_text(json.dumps(held))
leave()
'''


def torchrun(*program: str, processes: int = 2, threads: int = 1) -> subprocess.CompletedProcess:
    """CPU processes under torchrun, as a GPU box launches them (`torchrun --nproc_per_node N`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
               str(free_port()), *program]
    return run_ranks(command, OMP_NUM_THREADS=str(threads))


@pytest.fixture(scope="module")
def sharded(own_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("sharded")
    config = make_config(own_caches, root / "fsdp", num_processes=2, fsdp=True, **TWO_RANK_SETTINGS)
    (root / "probe.py").write_text(PROBE)
    torchrun(str(root / "probe.py"), str(root / "fsdp.yaml"), str(root))
    return {"config": config, "yaml": root / "fsdp.yaml", "probe": root,
            "held": [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)],
            "run": current_run_dir(config, get_family(config), Store(config.cache_dir, config.manifest_names))}


def test_each_rank_holds_half_of_every_parameter(sharded: dict) -> None:
    blocks = [f"{stream}_transformer_blocks.{i}"
              for stream, count in (("text", 1), ("visual", 2)) for i in range(count)]
    for held in sharded["held"]:
        assert held["units"] == ["", *blocks]  # one FSDP unit per block, then the root (torchtitan's order of calls)
        assert held["sharded"] == held["params"]  # every parameter, frozen base and LoRA alike, is a shard
        # dim 0 split in two: a rank holds half, up to one row per odd-sized parameter
        assert held["local"] <= held["full"] / 2 + held["params"] * 64
        assert held["local"] < 0.6 * held["full"]
    assert sum(held["local"] for held in sharded["held"]) == sharded["held"][0]["full"]


def test_sharded_training_equals_one_process_accumulating_two_micro_steps(sharded: dict, own_caches: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    (threads,) = {held["threads"] for held in sharded["held"]}
    make_config(own_caches, tmp_path / "one", gradient_accumulation_steps=2, **TWO_RANK_SETTINGS)
    (tmp_path / "reference.py").write_text(REFERENCE)
    torchrun(str(tmp_path / "reference.py"), str(tmp_path / "one.yaml"), processes=1, threads=threads)
    (one,) = (tmp_path / "one" / "runs").iterdir()
    history = json.loads((one / "history.json").read_text())
    fsdp = json.loads((sharded["run"] / "history.json").read_text())
    assert [r["step"] for r in fsdp] == [1, 2, 3]
    assert [r["loss"] for r in history] == [r["loss"] for r in fsdp]
    # The gradient norm is the one sum FSDP orders differently (per shard, then over ranks). Each side computes the
    # square root of a sum of the n squared LoRA gradient elements (and of the t per-tensor norms squared): a
    # relative error within (n + t + 2) u on each, u = 2^-24 for fp32.
    lora = load_file(sharded["run"] / T.LORA_FILE)
    n, t = sum(v.numel() for v in lora.values()), len(lora)
    bound = 2 * (n + t + 2) * 2.0 ** -24
    for a, b in zip(history, fsdp):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= bound * a["grad_norm"]
        assert a["grad_norm"] < sharded["config"].max_grad_norm  # no clipping: the clip factor is exactly 1
    assert same_lora_file(one / T.LORA_FILE, sharded["run"] / T.LORA_FILE)  # bit for bit
    # The comparison can fail: one process with one micro-step per step trains other numbers.
    single = load_file(train(make_config(own_caches, tmp_path / "single", **TWO_RANK_SETTINGS)).lora_path)
    assert max((single[k] - lora[k]).abs().max().item() for k in single) > 1e-4


def documented_fsdp_accelerate_file() -> dict:
    """The accelerate file docs/multi-gpu.md documents for FSDP2, read from it: the doc and this test cannot drift."""
    doc = (REPO / "docs" / "multi-gpu.md").read_text()
    section = doc[doc.index("**FSDP2 (`fsdp: true`"):]
    block = section[section.index("```yaml\n") + len("```yaml\n"):]
    return yaml.safe_load(block[:block.index("```")])


def test_accelerate_launch_with_the_readme_fsdp_file_trains_the_torchrun_bits(
        sharded: dict, own_caches: dict[str, Path], tmp_path: Path) -> None:
    """`accelerate launch --config_file` with the documented file, as users launch FSDP2, on the sharded run's config.

    Bit-identical by construction: with `distributed_type: FSDP` accelerate starts the ranks through torchrun's own
    launcher (its multi_gpu_launcher), so the same two processes run the same train_main with the same RANK and
    WORLD_SIZE, loraflow wraps the blocks itself (accelerate's FSDP_* variables and ACCELERATE_MIXED_PRECISION are
    not read; ACCELERATE_USE_FSDP is only checked by join()), and the ranks run the same gloo collectives in the same
    order. The thread count is the one thing a launcher could change: OMP_NUM_THREADS is set to the sharded run's,
    which accelerate passes on.
    """
    accelerate = documented_fsdp_accelerate_file()
    assert accelerate["distributed_type"] == "FSDP" and accelerate["fsdp_config"]["fsdp_version"] == 2
    # The one change: the documented file is for 8 GPUs, the sharded run's config says num_processes: 2 (join()
    # refuses a launch of another size). Nothing is changed for the CPU: with FSDP accelerate starts torchrun's
    # processes whether or not there is a GPU, and CUDA_VISIBLE_DEVICES="" (run_ranks) makes them gloo on CPU.
    accelerate["num_processes"] = 2
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(accelerate))
    config = make_config(own_caches, tmp_path / "accel", num_processes=2, fsdp=True, **TWO_RANK_SETTINGS)
    (threads,) = {held["threads"] for held in sharded["held"]}
    # --main_process_port on the command line, not in the file (which sets none): accelerate's default port 29500
    # may be taken by another launch on this machine.
    run_ranks([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
               "--main_process_port", str(free_port()), "-m", "loraflow.train_main", str(tmp_path / "accel.yaml")],
              OMP_NUM_THREADS=str(threads))
    assert_trained_the_same(current_run_dir(config, get_family(config), Store(config.cache_dir)), sharded["run"])


def assert_trained_the_same(run: Path, reference: Path) -> None:
    """The LoRA file bit for bit, and the logged steps, losses and gradient norms (not the timings)."""
    assert same_lora_file(run / T.LORA_FILE, reference / T.LORA_FILE)
    computed = [[(r["step"], r["loss"], r["grad_norm"]) for r in json.loads((d / "history.json").read_text())]
                for d in (run, reference)]
    assert computed[0] == computed[1]


def test_the_lora_assets_launch_trains_the_torchrun_bits(sharded: dict, own_caches: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """The `lora` asset's launch of an fsdp config (launch_command: torchrun's launcher on loopback, no accelerate
    file, README: "Launch it as data-parallel runs are launched") shards as torchrun and the README's file do: the
    same bits. A launch that trained unsharded would differ in the text block's last bits (the module docstring)."""
    config = make_config(own_caches, tmp_path / "asset", num_processes=2, fsdp=True, **TWO_RANK_SETTINGS)
    (threads,) = {held["threads"] for held in sharded["held"]}
    run_ranks(launch_command(str(tmp_path / "asset.yaml"), config.num_processes), OMP_NUM_THREADS=str(threads))
    assert_trained_the_same(current_run_dir(config, get_family(config), Store(config.cache_dir)), sharded["run"])


def test_a_sharded_run_resumes_from_its_gathered_checkpoint(sharded: dict) -> None:
    """The checkpoint holds the full LoRA and AdamW moments; a new launch reshards them and ends on the same bits."""
    run = sharded["run"]
    (checkpoint,) = (run / "checkpoints").iterdir()
    moments = load_file(checkpoint / "optimizer.safetensors")
    lora = load_file(checkpoint / "lora.safetensors")
    assert len(moments) == 3 * len(lora)  # step, exp_avg, exp_avg_sq per LoRA tensor
    shapes = sorted(tuple(v.shape) for v in lora.values())
    assert sorted(tuple(v.shape) for k, v in moments.items() if k.endswith(".exp_avg")) == shapes  # full, not halves
    finished = run.parent / "finished.safetensors"
    (run / T.LORA_FILE).rename(finished)  # as if killed after the checkpoint at step 2
    (run / "history.json").unlink()
    done = torchrun("-m", "loraflow.train_main", str(sharded["yaml"]))
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]  # rank 0 only
    report = json.loads(line)
    assert report["resumed_at_step"] == 2 and report["computed"] == 1
    assert same_lora_file(run / T.LORA_FILE, finished)  # bit for bit


def test_fsdp_needs_more_than_one_process(own_caches: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`fsdp: true` shards the model over the training processes but "
                                         "num_processes is 1"):
        make_config(own_caches, tmp_path / "one", fsdp=True)
    with pytest.raises(ValueError, match="`enable_group_offload` is not supported with `fsdp: true`"):
        make_config(own_caches, tmp_path / "off", fsdp=True, num_processes=2, enable_group_offload=True)
