"""Dagster as tests run and watch it: `dagster dev` on a free loopback port, in its own process group, ended as a
group; what a run's events and the instance say (its step workers' pids, its status, the `gpu` pool's claims); the
webserver's GraphQL answers; polling with a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus

from tests.factory import REPO
from tests.servers import free_port


@contextlib.contextmanager
def dagster_dev(home: Path, config: Path, log_path: Path) -> Iterator[str]:
    """The URL of `dagster dev -m loraflow.definitions` on DAGSTER_HOME `home` and LORAFLOW_CONFIG `config`."""
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "LORAFLOW_CONFIG": str(config)}
    dagster = str(Path(sys.executable).with_name("dagster"))
    with log_path.open("wb") as log:
        process = subprocess.Popen([dagster, "dev", "-m", "loraflow.definitions", "-h", "127.0.0.1", "-p", str(port)],
                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(url, process, log_path)
            yield url
        finally:
            kill_group(process)


def wait_for(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"dagster dev exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"dagster dev did not answer on {url} within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def kill_group(process: subprocess.Popen) -> None:
    """dagster dev starts a webserver, a daemon and code servers in its process group: end them all."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=3)  # it rarely exits on TERM alone; nothing in it needs a clean stop
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # children outliving the leader, or a leader ignoring TERM
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


# -- watching runs ----------------------------------------------------------------------------------------------------

PARTITION = "demo-videos"  # the demo dataset's partition
# A wait for a run's next event (created, its step started, finished) may take RUN_FACTOR times what one unobstructed
# latents run took from its command to its exit in the same module (`time_a_latents_run`, at its start: the host's
# load scales both), at least MIN_RUN_S; a run blocked for good takes forever. Not a fixed limit that a loaded host
# reaches (it was 180 s, met under load with the tests going right).
RUN_FACTOR, MIN_RUN_S = 4, 60.0
HANG_S = 1800  # the timed run itself: a guard against a hang only
_timed_run_s: list[float] = []


def time_a_latents_run(home: Path, config: Path, log: Path) -> float:
    """Seconds of one `dagster asset materialize --select latents` of PARTITION with nothing in its way (its latents
    are forgotten after: each test starts without them); run_s() is derived from it from then on."""
    from tests.factory import forget_latents

    env = {**os.environ, "DAGSTER_HOME": str(home), "LORAFLOW_CONFIG": str(config), "CUDA_VISIBLE_DEVICES": ""}
    command = [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "loraflow.definitions",
               "--select", "latents", "--partition", PARTITION]
    began = time.monotonic()
    with log.open("wb") as out:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=HANG_S)
    seconds = time.monotonic() - began
    assert done.returncode == 0, log.read_text(errors="replace")[-3000:]
    forget_latents(config)
    _timed_run_s[:] = [seconds]
    return seconds


def run_s() -> float:
    """How long a wait for one run's next event may take here (RUN_FACTOR times the timed run)."""
    if not _timed_run_s:
        pytest.fail("no latents run timed yet: the module's fixture calls time_a_latents_run first")
    return max(MIN_RUN_S, RUN_FACTOR * _timed_run_s[0])


def wait_until(what: str, condition: Callable[[], Any], timeout_s: float, log: Path | None = None) -> Any:
    """condition()'s first truthy value, polled every 0.1 s; fails naming `what` (and the log's tail) past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{tail}")


def step_worker(instance: DagsterInstance, run_id: str, step: str) -> int | None:
    """The pid of the run's step worker for `step` once that step has started, else None."""
    entries = instance.all_logs(run_id, of_type={DagsterEventType.STEP_WORKER_STARTED, DagsterEventType.STEP_START})
    if not any(e.dagster_event.event_type == DagsterEventType.STEP_START and e.step_key == step for e in entries):
        return None
    (worker,) = [e for e in entries if e.dagster_event.event_type == DagsterEventType.STEP_WORKER_STARTED
                 and e.step_key == step]
    return int(worker.dagster_event.event_specific_data.metadata["pid"].value)


def executor_pid(instance: DagsterInstance, run_id: str) -> int | None:
    """The pid of the run's process that starts its step workers (Dagster's multiprocess executor logs it)."""
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        if (entry.user_message or "").startswith("Executing steps using multiprocess executor"):
            return int(entry.dagster_event.event_specific_data.metadata["pid"].value)
    return None


def materializations(instance: DagsterInstance, run_id: str) -> list[Any]:
    return instance.all_logs(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)


def gpu_claims(instance: DagsterInstance) -> list[Any]:
    return instance.event_log_storage.get_concurrency_info("gpu").claimed_slots


FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


def status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus:
    return instance.get_run_by_id(run_id).status


def materialization_keys(instance: DagsterInstance, run_id: str) -> list[Any]:
    return [e.dagster_event.event_specific_data.materialization for e in materializations(instance, run_id)]


def graphql(url: str, query: str) -> dict[str, Any]:
    """The webserver's answer to a GraphQL query, as the UI's pages ask for it."""
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert "errors" not in answer, answer
    return answer["data"]
