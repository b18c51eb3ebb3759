"""Real servers for the tests of a deployment past one machine: PostgreSQL, Redis and an S3 server (moto), each
started on a free loopback port in a temporary folder of its own, bounded in time, and ended by the test session.

A server whose package is not installed skips its tests, naming the package and the command that installs it
(`.ci/run` installs them: under CI those tests fail instead, `missing_input`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.factory import missing_input

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(ready: Callable[[], bool], process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if ready():
            return
        time.sleep(0.2)
    pytest.fail(f"{what} did not answer within {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _need(binary: str | None, package: str) -> str:
    if not binary:
        missing_input(f"{package} is not installed: `apt-get install -y {package}` (.ci/run does)")
    return binary


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A PostgreSQL cluster of its own (initdb, then the server on loopback); yields the URL of its `dagster`
    database. PostgreSQL refuses to run as root: as root, the cluster belongs to the package's `postgres` user."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    bin_dir = Path(_need(found[-1] if found else shutil.which("initdb"), "postgresql")).parent
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="loraflow-pg-"))
    if as_user:
        shutil.chown(folder, "postgres")
    data, log, port = folder / "data", folder / "server.log", free_port()
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True, timeout=START_TIMEOUT_S)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off"  # a test cluster: no power cut
    server = subprocess.Popen([*as_user, str(bin_dir / "postgres"), "-D", str(data), *options.split()],
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _accepts(port), server, "postgres", log)
        subprocess.run([*as_user, str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                        "dagster"], check=True, capture_output=True, timeout=START_TIMEOUT_S)
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/dagster"  # SQLAlchemy 2.1 defaults to psycopg 3
    finally:
        _stop(server)
        shutil.rmtree(folder, ignore_errors=True)


def new_database(url: str, name: str) -> str:
    """A new database on the PostgreSQL server of `url` (from postgres()); its URL. A test's own Dagster instance on
    the session's server: its runs apart from other tests' runs."""
    import psycopg2  # dagster-postgres's driver

    connection = psycopg2.connect(url.replace("postgresql+psycopg2://", "postgresql://"))
    try:
        connection.autocommit = True  # CREATE DATABASE runs outside a transaction
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        connection.close()
    return f"{url.rsplit('/', 1)[0]}/{name}"


@contextlib.contextmanager
def redis() -> Iterator[str]:
    """A Redis server without persistence; yields its URL."""
    binary = _need(shutil.which("redis-server"), "redis-server")
    folder, port = Path(tempfile.mkdtemp(prefix="loraflow-redis-")), free_port()
    log = folder / "server.log"
    server = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder),
                               "--save", "", "--appendonly", "no"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _accepts(port), server, "redis-server", log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(server)
        shutil.rmtree(folder, ignore_errors=True)


S3_ENV = {"AWS_ACCESS_KEY_ID": "loraflow-test", "AWS_SECRET_ACCESS_KEY": "loraflow-test",
          "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3() -> Iterator[dict[str, str]]:
    """moto's standalone server speaking S3 on loopback; yields the environment that points boto3/s3fs at it
    (`AWS_ENDPOINT_URL`: no loraflow setting names an endpoint, as on a real deployment)."""
    binary = Path(sys.executable).with_name("moto_server")
    if not binary.exists():
        missing_input("moto[server] is not installed: `make setup-test` installs it (pyproject extra `scale`)")
    folder, port = Path(tempfile.mkdtemp(prefix="loraflow-s3-")), free_port()
    log = folder / "server.log"
    server = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], cwd=folder,
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _accepts(port), server, "moto_server", log)
        yield {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    finally:
        _stop(server)
        shutil.rmtree(folder, ignore_errors=True)


def make_bucket(env: dict[str, str], name: str) -> str:
    """A new bucket on the S3 server; its URL."""
    import s3fs

    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"
