"""A dead run never blocks the next: a run whose processes are all gone is failed and its pool slots are freed.

`kill -9`, the OOM killer or a power cut stop a run's process before it can report anything: the run stays STARTED
and keeps its `gpu` slot, so every later GPU step waits for it forever. Dagster recovers the runs it launched: under
`dagster dev` the code server fails a run whose worker died, and the monitoring daemon frees the slots of finished
runs (`run_monitoring` in .dagster/dagster.yaml). A run of `dagster asset materialize` or `job execute` was launched
by nothing and is watched by nothing (nor is a run whose code server died with it), so this module does it:

- a run's processes are the pids its own events record: Dagster logs the run worker's, the executor's and each step
  worker's;
- a run all of whose recorded processes are provably gone (no such pid, a zombie, or the pid now held by a process
  started after the event: reused) is reported failed, and its slots are freed;
- a run that has recorded no pid yet is starting and is left alone;
- a run's pids are this machine's on an instance in SQLite files (one machine). On shared run storage (PostgreSQL:
  docs/scale.md) they could be any machine's, so the guard acts only on the runs tagged HOST_TAG with this machine's
  name: a step worker of the multiprocess executor tags its run when it starts (`die_with_run`: its parent, the
  run's executor, is on its machine, and so are the run's other step workers). A run killed before its first step
  started, and a run whose steps run on Celery workers, are not tagged: a UI run's code server fails it (run worker
  gone), else only its `dagster/max_runtime` tag does. Assumed: processes that share a host name share their pids (no
  container with a PID namespace of its own and the host's name), as with Dagster's default run launcher, which
  starts every run on the machine of its code server.

The guard runs in every main process that loads the code location (`loraflow.definitions.defs`: dagster's CLI, the
code server of `dagster dev`): once while it loads it, so before the CLI's own run asks for its slot, then on a
thread every WATCH_INTERVAL_S while that process lives, so a run already waiting for the slot of a run that dies goes
on too. Importing loraflow.definitions starts nothing.

Freeing a dead run's slot while another process's step asks for one can strand that step: Dagster assigns a waiting
step a slot only when the step is added while a slot is unassigned, or when an assigned step is removed, and a step
added just after the dead run's assigned step was removed gets neither (seen after repeated `kill -9`: a free slot, a
step waiting for good). So every pass also gives the free slots of each pool to its waiting steps, as Dagster would
have, under a file lock in DAGSTER_HOME so that two processes' guards never both count the same slot free.

A run a code server launched (the UI's, `dagster dev`'s: tagged `dagster/grpc_info`) is that code server's to fail:
it checks its run workers every half second and reports a dead one failed ("Run execution process ... was terminated
by signal 9"). The guard checks and reports too, and neither excludes the other: a guard pass that found the run
still STARTED, then freed its slots while the code server reported, reported it failed a second time (two failure
messages on one run: test_dead_runs_pg, 2 of 5 runs under load). So the guard fails such a run only once it has seen
it dead for CODE_SERVER_GRACE_S (a later pass): a live code server has reported it by then, and the run is skipped as
finished; a run whose code server died with it is failed a pass later than a CLI run is.

And a step worker dies with the run process that started it (`die_with_run`), so it never reports after its run
failed, nor keeps the GPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

log = logging.getLogger(__name__)
PID_EVENTS = {DagsterEventType.ENGINE_EVENT, DagsterEventType.STEP_WORKER_STARTED}
CLOCK_SLACK_S = 2.0  # /proc's boot time is whole seconds and drifts with the clock: a pid counts as reused past this
WATCH_INTERVAL_S = 15.0  # as often as a blocked step re-asks for its slot at the most (Dagster: every 15 s)
HOST_TAG = "loraflow/host"  # the machine of a run's processes, on shared run storage (PostgreSQL)
CODE_SERVER_GRACE_S = WATCH_INTERVAL_S  # a code server's dead run is its own to fail first (it checks every 0.5 s)
_watching = threading.Event()
_seen_dead: dict[str, float] = {}  # run id -> when this process first found it dead (time.monotonic)


def recorded_pids(instance: DagsterInstance, run_id: str) -> list[tuple[int, float]]:
    """(pid, when it was recorded) of every process the run's events name."""
    found = []
    for entry in instance.all_logs(run_id, of_type=PID_EVENTS):
        metadata = getattr(entry.dagster_event.event_specific_data, "metadata", None) or {}
        if "pid" in metadata:
            found.append((int(metadata["pid"].value), entry.timestamp))
    return found


def process_alive(pid: int, recorded_at: float) -> bool:
    """False only where provably gone: no such process, a zombie, or a process started after `recorded_at`."""
    if not Path("/proc/self/stat").exists():  # no /proc (macOS): existence only, a reused pid counts as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            pass
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    if fields[0] in ("Z", "X"):  # exited, not reaped yet
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
    return started <= recorded_at + CLOCK_SLACK_S


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime")


def on_this_host(instance: DagsterInstance, run: DagsterRun | None = None) -> bool:
    """Whether the run's processes are this machine's: every run on SQLite storage (files under DAGSTER_HOME, one
    host); elsewhere a run tagged with this machine's name (without `run`: whether the storage is SQLite)."""
    from dagster._core.storage.runs import SqliteRunStorage

    if isinstance(instance.run_storage, SqliteRunStorage):
        return True
    return run is not None and run.tags.get(HOST_TAG) == socket.gethostname()


def reap_dead_runs(instance: DagsterInstance, now: float | None = None) -> list[str]:
    """Fail the in-progress runs whose recorded processes are all gone (a code server's: gone for
    CODE_SERVER_GRACE_S before `now`, time.monotonic) and free their pool slots, then give free slots to the steps
    waiting for them; return the dead runs' ids."""
    from dagster._core.storage.tags import GRPC_INFO_TAG

    now = time.monotonic() if now is None else now
    dead, found = [], set()
    with _guard_lock(instance):
        for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTING, DagsterRunStatus.STARTED])):
            if not on_this_host(instance, run):
                continue
            pids = recorded_pids(instance, run.run_id)
            if not pids or any(process_alive(pid, at) for pid, at in pids):
                continue
            found.add(run.run_id)
            if GRPC_INFO_TAG in run.tags and now - _seen_dead.setdefault(run.run_id, now) < CODE_SERVER_GRACE_S:
                continue  # its code server's to report (module docstring)
            again = instance.get_run_by_id(run.run_id)  # read again: its code server may have reported it since
            if again is None or again.is_finished:
                continue
            # Slots first: a crash between the two leaves a STARTED run with dead pids, which the next pass finds.
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            instance.report_run_failed(run, f"every process of this run is gone (pids {sorted({p for p, _ in pids})}: "
                                            "killed, out of memory or a power cut); its pool slots were freed")
            dead.append(run.run_id)
        for run_id in set(_seen_dead) - (found - set(dead)):  # reaped, finished or alive again: forgotten
            del _seen_dead[run_id]
        assign_free_slots(instance)
    return dead


def assign_free_slots(instance: DagsterInstance) -> None:
    """Assign each pool's waiting steps to its slots that no step holds or was assigned, in Dagster's order and by
    its count (`assign_pending_steps`, `has_unassigned_slots`: slots minus assigned steps)."""
    storage = instance.event_log_storage
    for pool, info in storage.get_concurrency_infos(sorted(storage.get_concurrency_keys())).items():
        waiting = sum(step.assigned_timestamp is None for step in info.pending_steps)
        count = min(waiting, info.slot_count - (len(info.pending_steps) - waiting))
        if count > 0:
            storage.assign_pending_steps([pool] * count)  # one step per entry
            log.warning("pool %s: %d step(s) waited with a slot free; assigned", pool, count)


@contextlib.contextmanager
def _guard_lock(instance: DagsterInstance) -> Iterator[None]:
    """One guard pass at a time per instance, across processes (flock: a killed holder's lock is released)."""
    with open(Path(instance.root_directory) / "loraflow-dead-runs.lock", "a") as f:  # released when closed
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def watch_dead_runs(interval_s: float = WATCH_INTERVAL_S) -> bool:
    """Reap dead runs of the DAGSTER_HOME instance now and every `interval_s`, on a daemon thread; return whether
    it started. Only in a main process (the CLI, a code server): a multiprocessing child's ancestor runs one."""
    if multiprocessing.parent_process() is not None or not os.environ.get("DAGSTER_HOME") or _watching.is_set():
        return False
    _watching.set()
    instance = _guard_pass(None)  # here, not on the thread: done before this process's run asks for a slot
    threading.Thread(target=_watch, args=(interval_s, instance), name="loraflow-dead-runs", daemon=True).start()
    return True


def _watch(interval_s: float, instance: DagsterInstance | None) -> None:
    while True:
        time.sleep(interval_s)
        instance = _guard_pass(instance)


def _guard_pass(instance: DagsterInstance | None) -> DagsterInstance | None:
    """One reaping pass, logged; the instance it used (None if it could not get one)."""
    try:
        instance = instance or DagsterInstance.get()
        for run_id in reap_dead_runs(instance):
            log.warning("run %s: every process of it is gone; reported failed, its pool slots freed", run_id)
    except Exception as exc:  # a busy database, say: never the importing process's failure; the next pass retries
        log.warning("dead-run guard: %s: %s", type(exc).__name__, exc)
    return instance


def die_with_run(instance: DagsterInstance | None, run_id: str | None) -> bool:
    """In a step worker of the multiprocess executor: SIGKILL this process when the run process that started it
    dies (SIGKILL: no step failure, no materialization reported after the run failed). Return whether it was set.

    Only where the parent is a process the run recorded (its executor): a code server's run worker is a
    multiprocessing child too, and tied to the code server's request thread it would die when that thread ends.
    On shared run storage it also tags the run with this machine's name (HOST_TAG): its executor is here."""
    from loraflow.lifetime import die_with_parent

    parent = multiprocessing.parent_process()
    if parent is None or instance is None or run_id is None:
        return False
    if parent.pid not in {pid for pid, _ in recorded_pids(instance, run_id)}:
        return False
    if not on_this_host(instance):
        instance.add_run_tags(run_id, {HOST_TAG: socket.gethostname()})
    return die_with_parent(signal.SIGKILL, parent=parent.pid)
