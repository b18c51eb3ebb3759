"""A dead run never blocks the next: real `dagster asset materialize` processes and a real `dagster dev`, SIGKILLed.

Every run here uses the project's .dagster/dagster.yaml (the `gpu` pool of one slot, the queue's one run per dataset
partition, run monitoring) in a DAGSTER_HOME of its own. A killed run's step worker must die with it and report
nothing, its `gpu` slot must come free, and the next materialization must finish with every clip's latent listed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRun, DagsterRunStatus, materialize
from dagster._core.events import EngineEventData
from dagster._core.storage.tags import GRPC_INFO_TAG

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.runs.dead_runs import CODE_SERVER_GRACE_S, WATCH_INTERVAL_S, reap_dead_runs
from loraflow.assets.stages import clips
from loraflow.store import Store
from tests.dagster_dev import (
    FINISHED,
    PARTITION,
    dagster_dev,
    executor_pid,
    gpu_claims,
    materialization_keys,
    materializations,
    run_s,
    status,
    step_worker,
    time_a_latents_run,
    wait_until,
)
from tests.factory import REPO, demo_dict, forget_latents, write_config

CLAIM_RETRY_S = 15  # a blocked step asks for its slot again at most this far apart (Dagster's MAX_CONCURRENCY_...)


@pytest.fixture(scope="module")
def cached(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(DAGSTER_HOME with the project's dagster.yaml, config): the dataset's partition added and its clips cached."""
    root = tmp_path_factory.mktemp("dead_runs")
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, demo_data, root))
    home = root / "home"
    home.mkdir()
    shutil.copyfile(REPO / ".dagster" / "dagster.yaml", home / "dagster.yaml")
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("datasets", [PARTITION])
        result = materialize([clips], partition_key=PARTITION, instance=instance,
                             resources={"loraflow": LoraflowResource(config_path=str(config))})
        assert result.success
    print(f"an unobstructed latents run: {time_a_latents_run(home, config, root / 'timed.log'):.1f} s")
    return home, config


@pytest.fixture
def spawn(cached: tuple[Path, Path], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a command with the test's DAGSTER_HOME and config, in a process group of its own (its log under
    tmp_path); every group started is SIGKILLed at the end, so no orphan outlives a failed test."""
    home, config = cached
    env = {**os.environ, "DAGSTER_HOME": str(home), "LORAFLOW_CONFIG": str(config), "CUDA_VISIBLE_DEVICES": ""}
    started: list[subprocess.Popen] = []

    def start(name: str, *command: str) -> subprocess.Popen:
        log = (tmp_path / f"{name}.log").open("wb")
        started.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True))
        started[-1].log_path = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
        return started[-1]

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def materialize_latents(spawn: Callable[..., subprocess.Popen], name: str) -> subprocess.Popen:
    dagster = str(Path(sys.executable).with_name("dagster"))
    return spawn(name, dagster, "asset", "materialize", "-m", "loraflow.definitions", "--select", "latents",
                 "--partition", PARTITION)


def instance_of(cached: tuple[Path, Path]) -> DagsterInstance:
    return DagsterInstance.from_config(str(cached[0]))


def running_latents(instance: DagsterInstance, spawn: Callable[..., subprocess.Popen],
                    name: str) -> tuple[subprocess.Popen, str, int]:
    """(process, run id, latents step worker pid) of a CLI latents materialization whose latents step has started."""
    before = {r.run_id for r in instance.get_runs()}
    process = materialize_latents(spawn, name)
    (run_id,) = wait_until(f"run of `{name}` created", lambda: new_runs(instance, before), run_s(), process.log_path)
    pid = wait_until(f"latents step of `{name}` started", lambda: step_worker(instance, run_id, "latents"), run_s(),
                     process.log_path)
    return process, run_id, pid


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


def stop_step_kill_run(process_pid: int, step_pid: int) -> None:
    """SIGSTOP the step worker, SIGKILL the run's process alone, and wait for the worker to be gone: stopped, it can
    neither finish its step nor report, so only the signal its run's death sends it (`die_with_run`) ends it."""
    os.kill(step_pid, signal.SIGSTOP)
    os.kill(process_pid, signal.SIGKILL)
    wait_until(f"step worker {step_pid} (stopped) gone after its run was killed", lambda: not alive(step_pid), run_s())


def finished(process: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until the process exited 0; fails (with its log) if it did not, or not within timeout_s."""
    start = time.monotonic()
    wait_until(f"{process.args[-5:]} finished", lambda: process.poll() is not None, timeout_s, process.log_path)
    assert process.returncode == 0, process.log_path.read_text(errors="replace")[-3000:]
    return time.monotonic() - start


def assert_nothing_missing(instance: DagsterInstance, config: Path) -> None:
    """No run holds a `gpu` slot, and the latents part lists a latent for every clip of the clips part."""
    assert gpu_claims(instance) == []
    from loraflow.config import load_config

    store = Store(load_config(config).cache_dir)
    clip_keys = {r["key"] for r in store.read_manifest("clips", parts=[PARTITION])}
    listed = {r["clip_key"] for r in store.read_manifest("latents", parts=[PARTITION])}
    assert len(clip_keys) >= 5 and listed == clip_keys, f"clips without a latent: {sorted(clip_keys - listed)}"


def new_runs(instance: DagsterInstance, before: set[str]) -> list[str]:
    return [r.run_id for r in instance.get_runs() if r.run_id not in before]


def blocked(instance: DagsterInstance, run_id: str) -> bool:
    return any("blocked by limit for pool gpu" in (e.user_message or "")
               for e in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT))


def waiting_for_writer(instance: DagsterInstance, run_id: str) -> bool:
    return any("waiting for another process writing dataset" in (e.user_message or "")
               for e in instance.all_logs(run_id))


def project_instance(tmp_path: Path) -> DagsterInstance:
    """A real instance in a DAGSTER_HOME of its own with the project's dagster.yaml (the `gpu` pool of one slot)."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(REPO / ".dagster" / "dagster.yaml", home / "dagster.yaml")
    return DagsterInstance.from_config(str(home))


def test_a_step_that_asked_while_a_dead_runs_slot_was_freed_gets_it_at_the_next_pass(tmp_path: Path) -> None:
    """The field's interleaving, call by call on a real SQLite instance: the new run's claim finds no unassigned
    slot, the guard (on another thread) frees the dead run's, then the claim adds its step unassigned. Dagster alone
    never assigns that step; the guard's next pass does."""
    with project_instance(tmp_path) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default("gpu")  # what a step's first claim does: the pool's slot
        assert storage.claim_concurrency_slot("gpu", "dead-run", "latents").is_claimed
        assert not storage.has_unassigned_slots("gpu")  # the new run's claim_concurrency_slot: should_assign False
        storage.free_concurrency_slots_for_run("dead-run")  # the guard, between the claim's two calls
        storage.add_pending_step("gpu", "new-run", "latents", should_assign=False)  # the claim goes on
        for _ in range(3):  # its retries: blocked for good, with the slot free
            assert not storage.claim_concurrency_slot("gpu", "new-run", "latents").is_claimed
        assert gpu_claims(instance) == []
        reap_dead_runs(instance)
        assert storage.claim_concurrency_slot("gpu", "new-run", "latents").is_claimed


def test_the_guard_gives_a_free_slot_to_one_waiting_step_only(tmp_path: Path) -> None:
    """Two steps stranded behind one free slot: a pass assigns one, and another pass nothing more (the slot is the
    assigned step's until it ends); when it ends, Dagster gives the slot to the other."""
    with project_instance(tmp_path) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default("gpu")
        for run in ("one", "other"):
            storage.add_pending_step("gpu", run, "latents", should_assign=False)
        for _ in range(2):
            reap_dead_runs(instance)
            (first,) = [s.run_id for s in storage.get_concurrency_info("gpu").pending_steps if s.assigned_timestamp]
        (second,) = {"one", "other"} - {first}
        assert not storage.claim_concurrency_slot("gpu", second, "latents").is_claimed
        assert storage.claim_concurrency_slot("gpu", first, "latents").is_claimed
        storage.free_concurrency_slot_for_step(first, "latents")
        assert storage.claim_concurrency_slot("gpu", second, "latents").is_claimed


def failure_messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [e.message for e in instance.all_logs(run_id, of_type={DagsterEventType.RUN_FAILURE})]


def test_a_code_servers_dead_run_is_left_to_it_so_it_fails_once(tmp_path: Path) -> None:
    """test_dead_runs_pg's doubled failure, call by call on a real SQLite instance: a UI run (launched by a code
    server, `dagster/grpc_info`) whose recorded process is gone. The guard's pass leaves it to its code server, which
    reports it failed (as `_check_for_orphaned_runs` does), and a pass after the grace skips it as finished: one
    failure. A CLI run (no tag) dead alike is failed at once; a code server's run that nobody reported, a pass after
    the grace. Before, the first pass failed the UI run too: with the code server's report, two failures."""
    with project_instance(tmp_path) as instance:
        def dead_run(tags: dict[str, str]) -> DagsterRun:
            run = instance.add_run(DagsterRun(job_name="cache_dataset", run_id=str(uuid.uuid4()),
                                              status=DagsterRunStatus.STARTED, tags=tags))
            process = subprocess.Popen([sys.executable, "-c", ""])
            process.wait()  # exited and reaped: the pid is gone
            instance.report_engine_event("Started process for run", run, EngineEventData.in_process(process.pid))
            return run

        ui, cli, orphan = dead_run({GRPC_INFO_TAG: "{}"}), dead_run({}), dead_run({GRPC_INFO_TAG: "{}"})
        assert reap_dead_runs(instance, now=100.0) == [cli.run_id]
        assert status(instance, ui.run_id) == status(instance, orphan.run_id) == DagsterRunStatus.STARTED
        instance.report_run_failed(ui)  # its code server, between the guard's passes
        assert reap_dead_runs(instance, now=100.0 + CODE_SERVER_GRACE_S) == [orphan.run_id]
        assert [len(failure_messages(instance, run.run_id)) for run in (ui, cli, orphan)] == [1, 1, 1]


def test_a_killed_cli_run_frees_its_slot_and_its_step_dies_with_it(cached, spawn) -> None:
    """`kill -9` of `dagster asset materialize --select latents`, then the same command again (the issue's case)."""
    forget_latents(cached[1])
    with instance_of(cached) as instance:
        killed, run_id, step_pid = running_latents(instance, spawn, "killed")
        stop_step_kill_run(killed.pid, step_pid)
        killed.wait()
        assert materializations(instance, run_id) == []  # stopped mid-step, then gone: nothing reported
        # Loading the code location (as Dagster's CLI calls `defs`) reaps before returning, so before a CLI run's step
        # asks for the slot.
        finished(spawn("load", sys.executable, "-c", "from loraflow.definitions import defs; defs()"), run_s())
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE
        assert gpu_claims(instance) == []
        print(f"the next run finished in {finished(materialize_latents(spawn, 'again'), run_s()):.1f} s")
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE  # reported by the next process
        assert_nothing_missing(instance, cached[1])


def test_a_run_waiting_for_the_slot_of_a_killed_run_goes_on(cached, spawn) -> None:
    """The next run was already waiting for the `gpu` slot when the run holding it was killed."""
    forget_latents(cached[1])
    with instance_of(cached) as instance:
        killed, run_id, step_pid = running_latents(instance, spawn, "killed")
        os.kill(step_pid, signal.SIGSTOP)  # it keeps the slot however slowly the next run starts on busy cores
        before = {r.run_id for r in instance.get_runs()}
        waiting = materialize_latents(spawn, "waiting")
        (waiting_id,) = wait_until("the waiting run created", lambda: new_runs(instance, before), run_s(),
                                   waiting.log_path)
        wait_until("the waiting run blocked by the gpu pool", lambda: blocked(instance, waiting_id), run_s(),
                   waiting.log_path)
        stop_step_kill_run(killed.pid, step_pid)
        # its guard looks again within WATCH_INTERVAL_S, and its step asks for the slot again within CLAIM_RETRY_S
        waiting_s = finished(waiting, WATCH_INTERVAL_S + CLAIM_RETRY_S + run_s())
        print(f"the waiting run finished {waiting_s:.1f} s after the kill")
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(waiting_id).status == DagsterRunStatus.SUCCESS
        assert_nothing_missing(instance, cached[1])


@pytest.mark.filterwarnings("ignore:Using variable_values:DeprecationWarning")  # dagster_graphql's call into gql
def test_under_dagster_dev_a_killed_run_worker_frees_the_slot_and_the_queued_run_of_its_dataset_goes_on(
        cached, tmp_path: Path) -> None:
    """Two runs of one dataset launched as the UI launches them: the second waits in the queue while the first runs;
    the first's worker is killed in its latents step; the second then runs and finishes."""
    from dagster_graphql import DagsterGraphQLClient

    forget_latents(cached[1])
    with dagster_dev(*cached, tmp_path / "dagster_dev.log") as url, instance_of(cached) as instance:
        client = DagsterGraphQLClient("127.0.0.1", port_number=int(url.rsplit(":", 1)[1]))
        first = client.submit_job_execution("cache_dataset", tags={"dagster/partition": PARTITION})
        wait_until("the first run started", lambda: status(instance, first) == DagsterRunStatus.STARTED, run_s())
        second = client.submit_job_execution("cache_dataset", tags={"dagster/partition": PARTITION})

        def first_in_latents_second_queued() -> int | None:
            assert status(instance, second) == DagsterRunStatus.QUEUED, "two runs of one dataset at once"
            return step_worker(instance, first, "latents")

        step_pid = wait_until("the first run's latents step started", first_in_latents_second_queued, run_s())
        killed = time.monotonic()
        stop_step_kill_run(executor_pid(instance, first), step_pid)  # the run worker, started by the code server
        wait_until("the killed run reported failed", lambda: status(instance, first) == DagsterRunStatus.FAILURE, 30)
        # the daemon looks every poll_interval_seconds (10 s) for runs ended free_slots_after_run_end_seconds (5) ago
        wait_until("its gpu slot freed", lambda: not gpu_claims(instance), 60)
        slot_s = time.monotonic() - killed
        wait_until("the queued run finished", lambda: status(instance, second) in FINISHED, run_s())
        done_s = time.monotonic() - killed
        print(f"dagster dev: slot free {slot_s:.1f} s, queued run done {done_s:.1f} s after the kill")
        assert [e.asset_key.path[-1] for e in materialization_keys(instance, first)] == ["clips"]  # no latents
        assert status(instance, second) == DagsterRunStatus.SUCCESS
        assert_nothing_missing(instance, cached[1])


def test_a_cli_run_waits_for_another_writer_of_its_dataset_and_a_killed_writer_frees_it(cached, spawn) -> None:
    """CLI runs bypass the queue: a writer of the dataset's parts (a process holding the store's part lock, as a
    clips or latents step does) makes a clips run wait; SIGKILLed, it lets the run go on."""
    from loraflow.config import load_config

    cache_dir = load_config(cached[1]).cache_dir
    holder = spawn("holder", sys.executable, "-c", "import time\nfrom loraflow.store import Store\n"
                   f"with Store({cache_dir!r}).part_lock({PARTITION!r}):\n    print('held', flush=True)\n"
                   "    time.sleep(600)\n")
    wait_until("the lock held", lambda: "held" in holder.log_path.read_text(), run_s(), holder.log_path)
    with instance_of(cached) as instance:
        before = {r.run_id for r in instance.get_runs()}
        dagster = str(Path(sys.executable).with_name("dagster"))
        run = spawn("clips", dagster, "asset", "materialize", "-m", "loraflow.definitions", "--select", "clips",
                    "--partition", PARTITION)
        (run_id,) = wait_until("the clips run created", lambda: new_runs(instance, before), run_s(), run.log_path)
        wait_until("the clips run waiting for the writer", lambda: waiting_for_writer(instance, run_id), run_s(),
                   run.log_path)
        time.sleep(2)  # still waiting a while later: nothing it does goes past the lock
        assert run.poll() is None and materializations(instance, run_id) == []
        os.killpg(holder.pid, signal.SIGKILL)
        print(f"the clips run finished {finished(run, run_s()):.1f} s after the writer was killed")
        assert [e.asset_key.path[-1] for e in materialization_keys(instance, run_id)] == ["clips"]





SOAK_KILLS = 20
SOAK_SEED = 35  # issue 35: any seed gives other moments; this one is the suite's
FIELD_KILL_S = (4.0, 25.0)  # the field's kills: this long after the command started
IN_STEP_KILL_S = (0.0, 5.0)  # the others: this long after the run's latents step started, so with the slot held
# The last run encodes every clip the killed ones left and runs the checks: 273 s on 2 cores at load 14


def holders_when_asked(instance: DagsterInstance, run_id: str) -> set[str] | None:
    """Once `run_id`'s step is in the `gpu` pool (waiting for the slot or holding it): the other runs holding a slot
    of it; None before."""
    info = instance.event_log_storage.get_concurrency_info("gpu")
    holders = {s.run_id for s in info.claimed_slots}
    if run_id not in holders | {s.run_id for s in info.pending_steps}:
        return None
    return holders - {run_id}


@pytest.mark.soak
def test_reruns_after_many_kills_at_random_moments_always_get_the_slot(cached, spawn) -> None:
    """The field's soak: `dagster asset materialize --select latents` again and again, each process group SIGKILLed at
    a random moment (seeded): half at 4-25 s after the command started, as in the field, half 0-5 s into its latents
    step (the `gpu` slot held, whatever the machine's speed). Each run's step asks for the slot only after the runs
    killed before it were reaped (its guard's first pass comes first: no slot held when it asks), and a run's latents
    step must start within run_s(). After SOAK_KILLS kills, a last run must finish with every clip's latent listed."""
    rng = random.Random(SOAK_SEED)
    forget_latents(cached[1])
    kills, to_step = {"field": 0, "in step": 0}, []
    with instance_of(cached) as instance:

        def step_started(name: str, before: set[str], started: float) -> float | None:
            """Seconds from the command's start to its latents step's start, once started; fails if its step asked for
            the slot while a killed run held it."""
            now = time.monotonic()
            run_ids = new_runs(instance, before)
            if not run_ids:
                return None
            holders = holders_when_asked(instance, run_ids[0])
            assert not holders, f"{name}: its latents step asked for the gpu slot while dead runs {holders} held it"
            return now - started if step_worker(instance, run_ids[0], "latents") else None

        while sum(kills.values()) < SOAK_KILLS:
            mode = rng.choice(sorted(kills))
            moment = rng.uniform(*(FIELD_KILL_S if mode == "field" else IN_STEP_KILL_S))
            before, name = {r.run_id for r in instance.get_runs()}, f"run{sum(kills.values())}"
            process = materialize_latents(spawn, name)
            started = time.monotonic()
            if mode == "in step":
                to_step.append(wait_until(f"{name}: latents step started",
                                          lambda: step_started(name, before, started), run_s(), process.log_path))
            deadline = time.monotonic() + moment if mode == "in step" else started + moment
            while time.monotonic() < deadline and process.poll() is None:
                step_started(name, before, started)
                time.sleep(0.1)
            if process.poll() is not None:  # it finished first: start again from no latents
                assert process.returncode == 0, process.log_path.read_text(errors="replace")[-3000:]
                forget_latents(cached[1])
                continue
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            kills[mode] += 1
        last_s = finished(materialize_latents(spawn, "last"), 2 * run_s())
        print(f"soak (seed {SOAK_SEED}): kills {kills}; the in-step runs reached their latents step "
              f"{min(to_step):.1f}-{max(to_step):.1f} s after their command started; the last run took {last_s:.1f} s")
        assert_nothing_missing(instance, cached[1])
