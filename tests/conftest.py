"""Shared fixtures: one tiny real-architecture checkpoint and one generated dataset per session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.config import LoraflowConfig, parse_config
from tests.factory import (
    REPO,
    build_caches,
    config_for,
    demo_dict,
    fill_validation_store,
    random_lora,
    validation_dict,
    write_config,
)

# `make test` runs the suite in two pytest-xdist workers (each a process). Two workers on two cores: each runs torch
# on one thread, as the CLI and Dagster subprocesses it starts do (set before anything imports torch).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Each worker its own DAGSTER_HOME (the project's dagster.yaml in a folder of its own): two workers creating the
    # SQLite run storage of the project's .dagster at once stamped its schema twice ("more than one head"), and the
    # next `dg check defs` or `make dev` there failed.
    _home = Path(tempfile.mkdtemp(prefix=f"dagster-home-{os.environ['PYTEST_XDIST_WORKER']}-"))
    shutil.copyfile(REPO / ".dagster" / "dagster.yaml", _home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(_home)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The worker's DAGSTER_HOME goes with its session (an xdist worker ends without running atexit handlers: the
    folders were left in /tmp, one per worker per run)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_home, ignore_errors=True)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """A session's read-only input (a tiny checkpoint, the demo dataset, the pre-trained tiny world), built once for
    the whole run: under pytest-xdist every worker runs each session fixture, so the first builds it in the folder the
    workers share while holding a lock, and the others wait, then find it complete (`build` returns at once when its
    folder is complete: build_tiny and make_demo_dataset are idempotent). Without xdist: in the session's folder."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(shared / f"{name}.lock"):
        return build(shared / name)


@pytest.fixture(autouse=True, scope="session")
def estimates_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`loraflow check` remembers its estimates in the user's cache folder (`estimates.estimates_cache`): the suite
    keeps its own, so that no run reuses another's (a reused table prints one more line) and ~/.cache stays as it
    was. Set in the environment: the CLI subprocesses read it too."""
    folder = tmp_path_factory.mktemp("estimates-cache")
    os.environ["LORAFLOW_ESTIMATES_CACHE"] = str(folder)
    return folder


# SIGINT's and SIGTERM's handlers as the session started, before any fixture ran Dagster in-process.
_SESSION_SIGNALS = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


def _session_signals() -> None:
    for signum, handler in _SESSION_SIGNALS.items():
        if handler is not None:  # None: set outside Python; leave it
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def signal_handlers_kept() -> Iterator[None]:
    """Every test starts and ends with SIGINT and SIGTERM as the session started. Dagster's in-process runs
    (`materialize`, `execute_in_process`) map SIGTERM to SIGINT's handler, and SIGINT is ignored in a suite started in
    the background (CI's `make test`): the suite then ignored `kill`, and so did every process it started (an ignored
    signal is inherited). Not "as the test found them": a module fixture's run (tests/scale's `pg_home`) comes before
    this fixture, and putting back what it left kept SIGTERM ignored in that xdist worker (tests/test_signals.py)."""
    _session_signals()
    try:
        yield
    finally:
        _session_signals()


@pytest.fixture(scope="session")
def tiny_k5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.tiny import build_tiny

    return built_once(tmp_path_factory, "models",
                      lambda root: build_tiny("kandinsky5-video", root / "kandinsky5-video"))


@pytest.fixture(scope="session")
def tiny_hv15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HunyuanVideo 1.5 t2v checkpoint (read only)."""
    from loraflow.demo.tiny import build_tiny

    return built_once(tmp_path_factory, "models",
                      lambda root: build_tiny("hunyuanvideo-1.5", root / "hunyuanvideo-1.5"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.dataset import make_demo_dataset

    return built_once(tmp_path_factory, "data", lambda root: make_demo_dataset(root / "demo"))


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's checkpoint (`loraflow demo` builds it): pre-trained once per test run."""
    from loraflow.demo.tiny import build_tiny

    return built_once(tmp_path_factory, "world",
                      lambda root: build_tiny("kandinsky5-video", root / "tiny-world", world=True))


@pytest.fixture(scope="session")
def demo_run(tiny_world: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's demo, run once for the session: `loraflow demo` in its own process (as `make demo` runs it) on
    configs/demo.yaml with paths moved under the returned folder (`config.yaml`) and DAGSTER_HOME at its `dagster_home`,
    where every asset and check is then materialized. Read by the demo's learning test and the UI test: the two
    modules ran the same demo each (the UI test in-process, by `materialize_everything`, what `loraflow demo` runs)."""
    return built_once(tmp_path_factory, "demo-run", lambda root: _run_demo(root, tiny_world, demo_data))


def _run_demo(root: Path, tiny_world: Path, demo_data: Path) -> Path:
    import subprocess
    import sys

    from loraflow.atomic import write_atomic

    done = root / "demo.out"  # written last: a folder holding it holds a finished demo
    if done.is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    config = write_config(root / "config.yaml", demo_dict(tiny_world, demo_data, root, base="configs/demo.yaml"))
    home = root / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nnux:\n  enabled: false\n")
    run = subprocess.run([sys.executable, "-m", "loraflow.cli", "demo", "--config", str(config)], cwd=REPO,
                         env={**os.environ, "DAGSTER_HOME": str(home)}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    write_atomic(done, lambda tmp: Path(tmp).write_text(run.stdout))
    return root


# What diffusers' conversion script writes for the 10 s checkpoints is P 0.9 and windows (11, 3, 3); small windows
# keep the tiny mask sparse.
NABLA = {"attention_type": "nabla", "attention_P": 0.9, "attention_wT": 1, "attention_wH": 1, "attention_wW": 1,
         "attention_add_sta": True, "attention_method": "topcdf"}


@pytest.fixture(scope="session")
def nabla_k5(tiny_k5: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Kandinsky 5 Video with NABLA attention in its transformer config, as the 10 s checkpoints have it."""
    path = tmp_path_factory.mktemp("nabla") / "k5-nabla"
    shutil.copytree(tiny_k5, path)
    config_file = path / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **NABLA}))
    return path


@pytest.fixture(scope="session")
def caches(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two-clip dataset (`factory.build_caches`) with its clips, latents and text_embeds cached: built once, read
    by the training and validation tests (each trains into its own output folder)."""
    return build_caches(tiny_k5, demo_data, tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def own_caches(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same two-clip caches built anew for one test module, for the modules whose runs add to their cache (i2v
    latents, masks, teacher features, validation texts, other ranks' runs) and so must not share `caches`."""
    return build_caches(tiny_k5, demo_data, tmp_path_factory.mktemp("own-caches"))


@pytest.fixture(scope="module")
def validation_inputs(tiny_k5: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Any, Path]:
    """(validation's config dict, its store filled by `fill_validation_store`, a LoRA of random B), built once per
    module (tests/validation/test_validate.py, tests/pipelines/test_render_memory.py)."""
    from loraflow.store import Store

    root = tmp_path_factory.mktemp("validate")
    data = validation_dict(tiny_k5, root)
    config = parse_config(data)
    store = Store(config.cache_dir, config.manifest_names)  # tests of other settings read theirs: store.named
    fill_validation_store(config, store)
    return data, store, random_lora(config, root / "lora")


@pytest.fixture
def demo_config(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> LoraflowConfig:
    return config_for(tiny_k5, demo_data, tmp_path)


# Real servers for the tests of a deployment past one machine (tests/servers.py), started once per session on demand.
@pytest.fixture(scope="session")
def s3_env() -> Any:
    """moto's S3 server on loopback; boto3/s3fs in this process and its children reach it through AWS_* variables."""
    from tests.servers import s3

    with s3() as env:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        yield env
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def postgres_url() -> Any:
    from tests.servers import postgres

    with postgres() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Any:
    from tests.servers import redis

    with redis() as url:
        yield url


@pytest.fixture
def unreachable_hub(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a machine whose Hub endpoint refuses connections: a loopback port bound, never listening."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed.getsockname()[1]}", HF_HUB_CACHE=str(tmp_path / "hf"),
               PYTHONPATH=str(REPO))
    yield env
    closed.close()
