"""The caching fan-out past one machine, with real parts (docs/scale.md): run storage in PostgreSQL, each step on one
of 3 Celery workers over Redis, the store and the steps' outputs on an S3 server, with deploy/dagster.yaml as it is.

Each worker is a separate `dagster-celery worker start` process tree with its own DAGSTER_HOME, temporary folder and
working folder, as if on its own machine: what the workers share is PostgreSQL, Redis and S3. (The tiny checkpoint
and the videos are read from one path by all, as every machine of a deployment has the model and the data.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from loraflow.assets.partitions import sync_partitions
from loraflow.config import load_config
from loraflow.keys import Shard
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import SHARD_CLIPS, latent_rows
from loraflow.store import Store
from tests.dagster_dev import dagster_dev, gpu_claims, graphql, kill_group, status, wait_until
from tests.factory import REPO, demo_dict, many_clips, write_config
from tests.servers import make_bucket

WORKERS, COPIES = 3, 3  # 21 clips in 3 buckets: about 7 per step, committed per bucket
BIN = Path(sys.executable).parent
STEP_TIMEOUT_S = 240


class Deployment:
    """The shared servers, the loraflow config on S3, and the environment every machine of the deployment gets."""

    def __init__(self, root: Path, pg_url: str, redis_url: str, s3_env: dict[str, str], config: Path) -> None:
        self.root, self.config_path = root, config
        self.config = load_config(config)
        self.env = {**os.environ, **s3_env, "DAGSTER_PG_URL": pg_url, "LORAFLOW_CONFIG": str(config),
                    "LORAFLOW_CELERY_BROKER": redis_url, "LORAFLOW_STEP_IO": f"{self.config.cache_dir}-dagster-io",
                    "PYTHONPATH": str(REPO), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.redis_url = redis_url
        self.home = self.machine("orchestrator")
        self.instance = DagsterInstance.from_config(str(self.home))
        self.workers: dict[str, subprocess.Popen] = {}

    def machine(self, name: str) -> Path:
        """A machine's own folder: DAGSTER_HOME (deploy/dagster.yaml), temporary and working folders under it."""
        folder = self.root / name
        (folder / "tmp").mkdir(parents=True)
        shutil.copyfile(REPO / "deploy" / "dagster.yaml", folder / "dagster.yaml")
        return folder

    def env_of(self, folder: Path) -> dict[str, str]:
        return {**self.env, "DAGSTER_HOME": str(folder), "TMPDIR": str(folder / "tmp")}

    def start_worker(self, name: str) -> subprocess.Popen:
        folder = self.machine(name)
        celery = {"execution": {"config": {"broker": self.redis_url, "backend": self.redis_url}}}  # deploy/celery.yaml
        (folder / "celery.yaml").write_text(yaml.safe_dump(celery))
        self.workers[name] = subprocess.Popen(
            [str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app", "-y", "celery.yaml",
             "-n", name, "--", "--concurrency", "1"],
            cwd=folder, env=self.env_of(folder), stdout=(folder / "worker.log").open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True)
        return self.workers[name]

    def execute(self, job: str, *args: str) -> subprocess.Popen:
        """`dagster job execute` of a job of loraflow.definitions on the orchestrator machine (not waited for)."""
        run_config = self.home / f"{job}.yaml"
        run_config.write_text(yaml.safe_dump(
            {"loggers": {"console": {"config": {"log_level": "INFO"}}},
             **({"ops": {"latents_shards": {"config": {"dataset": "demo-videos", "workers": WORKERS}}}}
                if job == "cache_latents_fanout" else {})}))
        return subprocess.Popen([str(BIN / "dagster"), "job", "execute", "-m", "loraflow.definitions", "-j", job,
                                 "-c", str(run_config), *args], cwd=self.home, env=self.env_of(self.home),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def last_run(self, job: str) -> Any:
        return self.instance.get_runs(RunsFilter(job_name=job), limit=1)[0]


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=STEP_TIMEOUT_S)
    return process.returncode, output


def computed_by_shard(messages: list[str]) -> dict[int, int]:
    found = (re.search(rf"latents shard (\d)/{WORKERS} of 'demo-videos': computed (\d+)", m) for m in messages)
    return {int(m[1]): int(m[2]) for m in found if m}


def committed(store_url: str) -> list[str]:
    """Every committed latent key, once per store shard holding it (a key computed twice is listed twice)."""
    store = Store(store_url)
    return [k for path in store.shard_paths("latents") for group in store._shard_keys("latents", path) for k in group]


@pytest.fixture(scope="module")
def deployment(tiny_k5: Path, demo_data: Path, postgres_url: str, redis_url: str, s3_env: dict[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deployment")
    bucket = make_bucket(s3_env, f"deploy-{uuid.uuid4().hex[:12]}")
    config = write_config(root / "config.yaml",
                          {**demo_dict(tiny_k5, many_clips(demo_data, root / "data", COPIES), root),
                           "cache_dir": f"{bucket}/cache"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DAGSTER_PG_URL", postgres_url)  # this process's instance reads deploy/dagster.yaml too
        deployment = Deployment(root, postgres_url, redis_url, s3_env, config)
        workers = [deployment.start_worker(f"worker{i}") for i in range(WORKERS)]
        try:
            yield deployment
        finally:
            for worker in workers:
                kill_group(worker)


def test_three_celery_workers_cache_every_clip_once_though_one_is_killed_mid_step(
        deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    config, url = deployment.config, deployment.config.cache_dir
    clips = build_clips(config, get_family(config), model_source(config), Store(url), datasets=["demo-videos"])
    rows = latent_rows(config, get_family(config), model_source(config), Store(url), ["demo-videos"])
    owner = {r.key: next(i for i in range(WORKERS) if Shard(i, WORKERS).owns(r.clip_key)) for r in rows}
    share = {i: sum(o == i for o in owner.values()) for i in range(WORKERS)}
    buckets = Counter((owner[r.key], r.bucket) for r in rows)  # a step commits per bucket, SHARD_CLIPS at most
    commits = {i: sum(-(-n // SHARD_CLIPS) for (o, _), n in buckets.items() if o == i) for i in range(WORKERS)}
    victim = max(commits, key=commits.get)
    assert clips.computed == len(rows) and commits[victim] >= 2, commits  # so the kill can land between two

    # 1. the fan-out on the workers; the victim step's worker process is SIGKILLed after its first commit
    process = deployment.execute("cache_latents_fanout")
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not any(owner[k] == victim for k in committed(url)):
        assert time.monotonic() < deadline and process.poll() is None, "no commit of the victim's shard"
        time.sleep(0.2)
    run = deployment.last_run("cache_latents_fanout")
    started = next(e for e in deployment.instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)
                   if f"latents_shard[shard_{victim}] in celery worker" in e.message)  # logged, then relayed
    host = started.dagster_event.event_specific_data.metadata["Celery worker"].value
    pool_process(deployment.workers[host.split("@")[0]]).send_signal(signal.SIGKILL)
    code, output = finish(process)
    assert code != 0 and deployment.instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE, output
    messages = [e.message for e in deployment.instance.all_logs(run.run_id)]
    tasks = {m for m in messages if m.endswith("in celery worker")}  # every step was a Celery task
    assert tasks == {f"[CeleryExecutor] Executing steps {step} in celery worker" for step in
                     ["latents_shards", *(f"latents_shard[shard_{i}]" for i in range(WORKERS))]}, tasks
    assert computed_by_shard(messages) == {i: share[i] for i in range(WORKERS) if i != victim}, messages
    before = committed(url)
    killed = [k for k in before if owner[k] == victim]
    assert 1 <= len(killed) < share[victim], "the kill should land between the step's first and last commit"
    assert sorted(k for k in before if owner[k] != victim) == sorted(k for k in owner if owner[k] != victim)

    # 2. the next run computes only what the killed step left: every clip then committed exactly once
    code, output = finish(deployment.execute("cache_latents_fanout"))
    assert code == 0, output[-4000:]
    run = deployment.last_run("cache_latents_fanout")
    again = computed_by_shard([e.message for e in deployment.instance.all_logs(run.run_id)])
    assert again == {i: share[victim] - len(killed) if i == victim else 0 for i in range(WORKERS)}, again
    assert sorted(committed(url)) == sorted(owner), "a latent computed twice, or one missing"
    step_io = deployment.env["LORAFLOW_STEP_IO"]
    total = json.loads(Store(step_io).fs.cat(f"{step_io}/{run.run_id}/latents_fanned_out/result.json"))
    assert total == share[victim] - len(killed)  # the counts passed between workers through S3, as JSON

    # 3. the stage job on the workers: `cache_dataset` of the partition lists them all, computing nothing;
    # 4. meanwhile `dagster dev` starts on this instance: it shows the runs, the partition and the materializations
    sync_partitions(deployment.instance, config)
    process = deployment.execute("cache_dataset", "--tags", '{"dagster/partition": "demo-videos"}')
    for name in ("LORAFLOW_CELERY_BROKER", "LORAFLOW_STEP_IO"):
        monkeypatch.setenv(name, deployment.env[name])
    with dagster_dev(deployment.home, deployment.config_path, deployment.root / "dagster_dev.log") as ui:
        code, output = finish(process)
        assert code == 0, output[-4000:]
        shown = graphql(ui, UI_QUERY)

        # 5. a dead run never blocks the next: a CLI run's process SIGKILLed while its steps hold gpu slots stays
        # STARTED; the daemon of `dagster dev` (run_monitoring in deploy/dagster.yaml) fails it past its
        # `dagster/max_runtime` and frees its slots
        Store(url).fs.rm(f"{url}/latents", recursive=True)  # work for the steps: the kill lands while they run
        before = {r.run_id for r in deployment.instance.get_runs()}
        dead = deployment.execute("cache_latents_fanout", "--tags", json.dumps({"dagster/max_runtime": "20"}))
        dead_id = wait_until("the new run's steps holding gpu slots", lambda: next(
            (c.run_id for c in gpu_claims(deployment.instance) if c.run_id not in before), None), STEP_TIMEOUT_S)
        dead.kill()
        dead.wait()
        assert status(deployment.instance, dead_id) == DagsterRunStatus.STARTED  # nobody has failed it yet
        wait_until("the dead run failed", lambda: status(deployment.instance, dead_id) == DagsterRunStatus.FAILURE, 90)
        wait_until("its gpu slots freed", lambda: not gpu_claims(deployment.instance), 60)
    (latents,) = [e.asset_materialization for e in deployment.instance.all_logs(
        deployment.last_run("cache_dataset").run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
        if e.asset_materialization.asset_key.path[-1] == "latents"]
    assert (latents.metadata["computed"].value, latents.metadata["reused"].value) == (0, len(rows))
    runs = [(r["jobName"], r["status"]) for r in shown["runsOrError"]["results"]]
    assert sorted(runs) == [("cache_dataset", "SUCCESS"), ("cache_latents_fanout", "FAILURE"),
                            ("cache_latents_fanout", "SUCCESS")], runs
    node = shown["assetNodeOrError"]
    assert node["partitionKeysByDimension"][0]["partitionKeys"] == ["demo-videos"], node
    assert [m["partition"] for m in node["assetMaterializations"]] == ["demo-videos"], node


UI_QUERY = """{
  runsOrError { ... on Runs { results { jobName status } } }
  assetNodeOrError(assetKey: {path: ["latents"]}) {
    ... on AssetNode { partitionKeysByDimension { partitionKeys } assetMaterializations { partition runId } }
  }
}"""


def pool_process(worker: subprocess.Popen) -> psutil.Process:
    """The process of a worker that runs its Celery task: the prefork pool's child of `celery worker` (which
    dagster-celery starts), forked with its command line; what the kernel's OOM killer would pick."""
    (celery,) = psutil.Process(worker.pid).children()
    (pool,) = [p for p in celery.children() if p.cmdline() == celery.cmdline()]
    return pool
