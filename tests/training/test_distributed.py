"""Two CPU processes (gloo), launched as the `lora` asset launches them, train the tiny real Kandinsky 5 Video from
real caches.

The honest check: with one sample per rank and micro-step, two processes compute what one process computes with
gradient_accumulation_steps 2 (the same batches and random draws), bit for bit. That holds by construction, not by
luck of the CPU: each micro-step runs the same kernels on the same shapes, backward of loss / 2 is exactly half of
backward of loss (scaling by a power of two commutes with rounding), and fl(g0 + g1) / 2 is the same float whether
two ranks all-reduce it or one process accumulates it. What the CPU can change is a kernel's summation order with
its thread count (MKL and ATen split reductions by thread), and the launcher gives each rank OMP_NUM_THREADS=1:
so the one-process reference trains with the ranks' thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from loraflow.assets.runs.launch import launch_command
from loraflow.pipelines import get_family
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.launch.distributed import World, join
from loraflow.training.run import current_run_dir
from tests.factory import REPO, TWO_RANK_SETTINGS, make_config, run_ranks, same_lora_file, train

# Runs train_lora as one rank, recording what this rank writes and keeping its trained LoRA for the test.
PROBE = '''
import sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from loraflow.config import load_config
from loraflow.training import loop as T
from loraflow.training.checkpoints import lora_state
from loraflow.training.launch.distributed import leave, world_from_env
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.store import Store

config_path, probe = sys.argv[1], Path(sys.argv[2])
writes, kept = [], {}
def spy(name, fn):
    def wrapped(*args, **kwargs):
        writes.append(name)
        return fn(*args, **kwargs)
    return wrapped
for name in ("save_checkpoint", "export_lora", "write_json", "open_sink"):
    setattr(T, name, spy(name, getattr(T, name)))
run_steps = T.run_steps
def keep_transformer(*args, **kwargs):
    kept["transformer"] = args[2].transformer  # run_steps(run, plan, trained, ...)
    return run_steps(*args, **kwargs)
T.run_steps = keep_transformer
config = load_config(config_path)
T.train_lora(config, get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names))
rank = world_from_env().rank
(probe / f"rank{rank}.threads").write_text(str(torch.get_num_threads()))
save_file(lora_state(kept["transformer"]), probe / f"rank{rank}.safetensors")
(probe / f"rank{rank}.writes").write_text(" ".join(writes))
leave()
'''


def launch(config_path: Path, *program: str) -> subprocess.CompletedProcess:
    """The launch of two processes the lora asset builds, with `program` instead of train_main."""
    command = launch_command(str(config_path), 2)
    assert command[-3:-1] == ["-m", "loraflow.train_main"]
    if program:
        command = command[:-3] + list(program)
    return run_ranks(command)


@pytest.fixture(scope="module")
def two_ranks(own_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("two_ranks")
    config = make_config(own_caches, root / "two", num_processes=2, **TWO_RANK_SETTINGS)
    (root / "probe.py").write_text(PROBE)
    launch(root / "two.yaml", str(root / "probe.py"), str(root / "two.yaml"), str(root))
    return {"config": config, "yaml": root / "two.yaml", "probe": root,
            "run": current_run_dir(config, get_family(config), Store(config.cache_dir, config.manifest_names))}


def test_ranks_hold_identical_weights_and_only_rank_0_writes(two_ranks: dict) -> None:
    probe, run = two_ranks["probe"], two_ranks["run"]
    rank0, rank1 = (load_file(probe / f"rank{r}.safetensors") for r in (0, 1))
    assert sorted(rank0) == sorted(rank1) and len(rank0) == 40
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_B" in k)  # it trained
    exported = load_file(run / T.LORA_FILE)
    assert all(torch.equal(exported[f"transformer.{k}"], v) for k, v in rank0.items())
    writes = {r: (probe / f"rank{r}.writes").read_text().split() for r in (0, 1)}
    assert writes[1] == []
    # write_json: the run's attention.json, then its history.json
    assert sorted(writes[0]) == ["export_lora", "open_sink", "save_checkpoint", "write_json", "write_json"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000002"]


def test_two_processes_equal_one_process_accumulating_two_micro_steps(two_ranks: dict, own_caches: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    threads = {int((two_ranks["probe"] / f"rank{r}.threads").read_text()) for r in (0, 1)}
    assert len(threads) == 1
    with torch_threads(threads.pop()):  # the ranks' kernels, summation orders included
        one = train(make_config(own_caches, tmp_path / "one", gradient_accumulation_steps=2, **TWO_RANK_SETTINGS))
    two = json.loads((two_ranks["run"] / "history.json").read_text())
    assert [r["step"] for r in two] == [1, 2, 3]
    assert [(r.loss, r.grad_norm) for r in one.history] == [(r["loss"], r["grad_norm"]) for r in two]
    assert same_lora_file(Path(one.lora_path), two_ranks["run"] / T.LORA_FILE)  # bit for bit
    # The comparison can fail: one process with one micro-step per step trains other numbers.
    single = load_file(train(make_config(own_caches, tmp_path / "single", **TWO_RANK_SETTINGS)).lora_path)
    trained = load_file(two_ranks["run"] / T.LORA_FILE)
    assert max((single[k] - trained[k]).abs().max().item() for k in single) > 1e-4


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_rank_r_takes_every_other_batch_of_the_plan() -> None:
    worlds = [World(rank, 2) for rank in (0, 1)]
    assert [[w.micro_step(j) for j in range(3)] for w in worlds] == [[0, 2, 4], [1, 3, 5]]
    assert [World().micro_step(j) for j in range(3)] == [0, 1, 2]  # one process: the plan in order


def test_a_two_process_run_resumes_from_its_checkpoint_through_the_cli(two_ranks: dict) -> None:
    """train_main without Dagster: rank 0 prints the report; the run continues at step 2 to the same bits."""
    run = two_ranks["run"]
    finished = run.parent / "finished.safetensors"
    (run / T.LORA_FILE).rename(finished)  # as if killed after the checkpoint at step 2
    (run / "history.json").unlink()
    done = launch(two_ranks["yaml"])
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]  # rank 0 only
    report = json.loads(line)
    assert report["resumed_at_step"] == 2 and report["computed"] == 1 and report["data_version"] == run.name
    assert same_lora_file(run / T.LORA_FILE, finished)  # bit for bit
    assert "rank 1 INFO" not in done.stderr and "rank 0 INFO" in done.stderr
    assert np.isfinite(report["final_loss"])



def test_a_launch_that_does_not_match_the_config_fails_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="`num_processes` is 2 but this launch has 4 process"):
        join(2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="asks for FSDP but the loraflow config has fsdp: false"):
        join(1)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="asks for DEEPSPEED, which loraflow does not implement"):
        join(1, fsdp=True)


def test_ranks_that_disagree_fail_together(tmp_path: Path) -> None:
    """The guard on run folder, samples and trained weights: each rank raises when their fingerprints differ."""
    script = tmp_path / "disagree.py"
    script.write_text(
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from loraflow.training.launch.distributed import check_same_everywhere, join, leave\n"
        "world, device = join(2)\n"
        "check_same_everywhere('a', lambda: 'ab' * 8, world, device)  # equal: passes\n"
        "try:\n"
        "    check_same_everywhere('the samples', lambda: str(world.rank) * 16, world, device)\n"
        "except RuntimeError as err:\n"
        "    Path(sys.argv[1], f'rank{world.rank}').write_text(str(err))\n"
        "leave()\n")
    launch(tmp_path / "unused.yaml", str(script), str(tmp_path))
    assert all("the ranks disagree on the samples" in (tmp_path / f"rank{r}").read_text() for r in (0, 1))


def listening_sockets(root: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the process tree under `root`, from /proc: the kernel's view
    (IPv4 and IPv6; an address of zeros is every interface)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:  # exited meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    sockets = set()
    for pid in tree:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        sockets |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in sockets:  # state LISTEN, owned by the tree
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from Linux's /proc")
def test_the_launched_ranks_listen_on_loopback_only(tmp_path: Path) -> None:
    """Two ranks as the `lora` asset launches them: while they are joined, every socket their launch listens on
    (the rendezvous store, the collectives') is on 127.0.0.1. Under `accelerate launch` the store listened on `::`
    (every interface) for the whole run."""
    script = tmp_path / "joined.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from loraflow.training.launch.distributed import barrier, join, leave\n"
        "world, device = join(2)\n"
        "barrier(world)\n"
        "Path(sys.argv[1], f'rank{world.rank}').touch()\n"
        "for _ in range(6000):  # 600 s at most: a rank whose test died does not wait forever\n"
        "    if Path(sys.argv[1], 'done').exists():\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "leave()\n")
    command = launch_command(str(tmp_path / "unused.yaml"), 2)
    launched = subprocess.Popen([*command[:-3], str(script), str(tmp_path)], cwd=REPO,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
            assert launched.poll() is None and time.monotonic() < deadline, "the ranks did not join"
            time.sleep(0.2)
        sockets = listening_sockets(launched.pid)
    finally:
        (tmp_path / "done").touch()
        assert launched.wait(timeout=120) == 0
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them
    assert len(sockets) >= 3  # the store, and each rank's own
    assert all(address in loopback for address, _ in sockets), sockets
