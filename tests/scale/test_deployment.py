"""loraflow/assets/runs/deployment.py: off unless the environment names a broker or a step-output URL; a broker alone is
refused, naming what to set (no server needed: tests/scale/test_celery_fanout.py runs the real thing)."""

from __future__ import annotations

import pytest

from loraflow.assets.runs.deployment import JsonStepIO, deployment_defs


def test_one_machine_gets_nothing_and_a_broker_without_step_io_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAFLOW_CELERY_BROKER", raising=False)
    monkeypatch.delenv("LORAFLOW_STEP_IO", raising=False)
    assert deployment_defs() == {}
    monkeypatch.setenv("LORAFLOW_CELERY_BROKER", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="LORAFLOW_CELERY_BROKER is set but LORAFLOW_STEP_IO is not"):
        deployment_defs()
    monkeypatch.setenv("LORAFLOW_STEP_IO", "memory://step-io")
    defs = deployment_defs()
    assert defs["executor"].name == "celery" and isinstance(defs["resources"]["io_manager"], JsonStepIO)
