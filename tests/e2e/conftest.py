"""Fixtures shared by the end-to-end tests (real codex binary, real Celery workers)."""
import os
import signal
import subprocess

import pytest

from devtools.model_stand_in import ModelStandIn


@pytest.fixture
def stand_in():
    """The offline model stand-in, running for the test (codex's model provider)."""
    with ModelStandIn() as server:
        yield server


def stop_workers(procs) -> None:
    """SIGTERM each worker's process group (a warm shutdown), then SIGKILL any still running after 20 s."""
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
