"""A dead run never blocks the next on PostgreSQL either (docs/scale.md, "Failures"): real runs launched as the UI
launches them against `dagster dev` on a PostgreSQL instance (deploy/dagster.yaml as it is, its own database on the
session's server), their run worker SIGKILLed at two moments; and loraflow's dead-run guard on that storage, which
acts only on the runs of its own machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, materialize
from dagster._core.events import EngineEventData

from loraflow.assets.resources import LoraflowResource
from loraflow.assets.runs.dead_runs import HOST_TAG, reap_dead_runs
from loraflow.assets.stages import clips
from loraflow.config import load_config
from loraflow.store import Store
from tests.dagster_dev import (
    FINISHED,
    PARTITION,
    dagster_dev,
    executor_pid,
    gpu_claims,
    graphql,
    materialization_keys,
    run_s,
    status,
    step_worker,
    time_a_latents_run,
    wait_until,
)
from tests.factory import REPO, demo_dict, forget_latents, write_config
from tests.servers import new_database


@pytest.fixture(scope="module")
def pg_home(tiny_k5: Path, demo_data: Path, postgres_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(DAGSTER_HOME with deploy/dagster.yaml on a database of its own, config of a one-video dataset): the `gpu`
    pool set to one slot (`dagster instance concurrency set gpu 1`: one GPU), the partition added, its clips cached."""
    root = tmp_path_factory.mktemp("dead_runs_pg")
    data = root / "data"
    data.mkdir()
    for name in ("clip_01.mp4", "clip_01.txt"):  # one video: each run's latents step encodes a few frames
        shutil.copyfile(demo_data / name, data / name)
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, data, root))
    home = root / "home"
    home.mkdir()
    shutil.copyfile(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DAGSTER_PG_URL", new_database(postgres_url, f"dead_runs_{uuid.uuid4().hex[:8]}"))
        with DagsterInstance.from_config(str(home)) as instance:
            instance.event_log_storage.set_concurrency_slots("gpu", 1)
            instance.add_dynamic_partitions("datasets", [PARTITION])
            assert materialize([clips], partition_key=PARTITION, instance=instance,
                               resources={"loraflow": LoraflowResource(config_path=str(config))}).success
        print(f"an unobstructed latents run: {time_a_latents_run(home, config, root / 'timed.log'):.1f} s")
        yield home, config


LAUNCH = """mutation {
  launchPipelineExecution(executionParams: {
    selector: {repositoryLocationName: "loraflow.definitions", repositoryName: "__repository__",
               pipelineName: "cache_dataset", assetSelection: [{path: ["latents"]}], assetCheckSelection: []}
    executionMetadata: {tags: [{key: "dagster/partition", value: "%s"}]}
  }) { __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } }
}""" % PARTITION


def launch_latents(url: str) -> str:
    """The UI's "Materialize" of the dataset's latents (its checks deselected): the new run's id (it is queued)."""
    answer = graphql(url, LAUNCH)["launchPipelineExecution"]
    assert answer["__typename"] == "LaunchRunSuccess", answer
    return answer["run"]["runId"]


def why_failed(instance: DagsterInstance, run_id: str) -> list[str]:
    """The messages saying a run's processes were killed: the code server's, or the dead-run guard's."""
    return [e.message for e in instance.all_logs(run_id) if "was terminated by signal 9 (SIGKILL)" in e.message
            or "every process of this run is gone" in e.message]


def test_a_ui_run_whose_worker_is_killed_never_blocks_the_next_on_postgres(pg_home, tmp_path: Path) -> None:
    """Three latents runs of one dataset launched through GraphQL, each queued behind the one before (one run per
    partition). The first's run worker is SIGKILLed as soon as its executor started (it holds the dataset's run limit,
    no step yet), the second's in its latents step (it also holds the one `gpu` slot); the third must run and finish.
    No `dagster/max_runtime` tag: the code server reports each dead worker's run failed, the daemon frees its slot."""
    forget_latents(pg_home[1])
    log = tmp_path / "dagster_dev.log"
    with dagster_dev(*pg_home, log) as url, DagsterInstance.from_config(str(pg_home[0])) as instance:
        runs = [launch_latents(url), launch_latents(url)]
        for i, moment in enumerate(("its executor started", "its latents step started")):
            worker = wait_until(f"run {i}: its executor started", lambda: executor_pid(instance, runs[i]), run_s(), log)
            if moment == "its latents step started":
                step = wait_until(f"run {i}: {moment}", lambda: step_worker(instance, runs[i], "latents"), run_s(), log)
                os.kill(step, signal.SIGSTOP)  # mid-step, holding the slot, however fast the step would be
            assert status(instance, runs[i + 1]) == DagsterRunStatus.QUEUED, "two runs of one dataset at once"
            os.kill(worker, signal.SIGKILL)
            if i == 0:
                runs.append(launch_latents(url))
        wait_until("the last run finished", lambda: status(instance, runs[-1]) in FINISHED, run_s(), log)
        assert status(instance, runs[-1]) == DagsterRunStatus.SUCCESS
        killed = runs[:2]
        assert [status(instance, run_id) for run_id in killed] == [DagsterRunStatus.FAILURE] * 2
        # each says why it failed, once: the code server's message (the dead-run guard leaves a code server's run to
        # it for CODE_SERVER_GRACE_S; before, both reported the second run in 2 of 5 runs under load)
        assert [len(why_failed(instance, run_id)) for run_id in killed] == [1, 1], \
            [why_failed(instance, run_id) for run_id in killed]
        assert [materialization_keys(instance, run_id) for run_id in killed] == [[], []]
        assert step_worker(instance, killed[0], "latents") is None  # killed before its gpu step
        # the second's step worker tagged its run with this machine (the guard's rule on shared run storage)
        assert instance.get_run_by_id(killed[1]).tags.get(HOST_TAG) == socket.gethostname()
        assert gpu_claims(instance) == []
        store = Store(load_config(pg_home[1]).cache_dir)
        listed = {r["clip_key"] for r in store.read_manifest("latents", parts=[PARTITION])}
        assert listed == {r["key"] for r in store.read_manifest("clips", parts=[PARTITION])} and listed


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_the_guard_fails_a_dead_run_of_this_machine_only_on_postgres(pg_home) -> None:
    """Three STARTED runs holding `gpu` slots whose recorded processes are gone, as a `dagster job execute` run's are
    after `kill -9` (nothing in Dagster watches those): the guard fails the one tagged with this machine and frees its
    slot; the pids of the one tagged with another machine, and of the untagged one, could be alive there."""
    with DagsterInstance.from_config(str(pg_home[0])) as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 3)
        runs = {}
        for name, tags in [("here", {HOST_TAG: socket.gethostname()}), ("elsewhere", {HOST_TAG: "gpu-host-7"}),
                           ("untagged", {})]:
            run = instance.add_run(DagsterRun(job_name="cache_dataset", run_id=str(uuid.uuid4()),
                                              status=DagsterRunStatus.STARTED, tags=tags))
            instance.report_engine_event("Started process for run", run, EngineEventData.in_process(dead_pid()))
            assert storage.claim_concurrency_slot("gpu", run.run_id, "latents").is_claimed
            runs[name] = run.run_id
        try:
            assert reap_dead_runs(instance) == [runs["here"]]
            assert {n: status(instance, r) for n, r in runs.items()} == {
                "here": DagsterRunStatus.FAILURE, "elsewhere": DagsterRunStatus.STARTED,
                "untagged": DagsterRunStatus.STARTED}
            assert sorted(c.run_id for c in gpu_claims(instance)) == sorted([runs["elsewhere"], runs["untagged"]])
        finally:
            for run_id in runs.values():
                storage.free_concurrency_slots_for_run(run_id)
                instance.delete_run(run_id)
            storage.set_concurrency_slots("gpu", 1)
