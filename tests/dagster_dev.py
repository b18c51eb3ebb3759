"""`dagster dev` as tests start it: on a free loopback port, in its own process group, ended as a group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
