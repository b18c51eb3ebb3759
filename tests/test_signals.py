"""The suite's process stays killable: a test that runs Dagster in-process must not leave SIGTERM ignored.

A suite started in the background by a non-interactive shell (CI's `make test`, `make test &`) has SIGINT ignored;
Dagster's in-process execution copies SIGINT's handler onto SIGTERM on its way out (dagster/_utils/interrupts.py), so
after the first `materialize` the pytest process ignored `kill` until the end of the suite. The conftest fixture
`signal_handlers_kept` puts both handlers back to the session's before and after every test, whoever changed them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factory import REPO

INNER = '''
import time

from dagster import asset, materialize


@asset
def one() -> int:
    return 1


def test_materialize():
    assert materialize([one]).success


def test_wait():
    print("waiting", flush=True)
    time.sleep(120)
'''

# The same run in a module fixture: set up before any test's own fixtures, so a fixture that puts back what it found
# when its test started put back SIGTERM ignored (an xdist worker of the full suite, after tests/scale's `pg_home`).
INNER_IN_A_FIXTURE = '''
import time

import pytest
from dagster import asset, materialize


@asset
def one() -> int:
    return 1


@pytest.fixture(scope="module")
def materialized():
    assert materialize([one]).success


def test_wait(materialized):
    print("waiting", flush=True)
    time.sleep(120)
'''


def not_a_worker() -> dict[str, str]:
    """This process's environment without xdist's worker name: the killed inner suite would make itself a
    DAGSTER_HOME as a worker (tests/conftest.py) that nothing removes; it uses this worker's."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}


@pytest.mark.parametrize("inner", [INNER, INNER_IN_A_FIXTURE], ids=["in-a-test", "in-a-module-fixture"])
def test_sigterm_ends_a_background_suite_after_an_in_process_dagster_run(tmp_path: Path, inner: str) -> None:
    (tmp_path / "test_inner.py").write_text(inner)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's addopts
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731  as `cmd &` in a script
    suite = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=ignore_sigint,
        env=not_a_worker())
    try:
        for line in suite.stdout:
            if "waiting" in line:
                break
        suite.send_signal(signal.SIGTERM)
        # Killed by the signal, not the end of a 120 s wait (exit 0) nor a pytest error.
        assert suite.wait(timeout=100) == -signal.SIGTERM
    finally:
        suite.kill()
        suite.wait()
