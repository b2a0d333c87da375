"""Fixtures shared by the end-to-end tests (real codex binary, real Celery workers)."""
import os
import signal
import subprocess
import time

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


def worker_env(*, database_url: str, broker_url: str, codex_bin: str, stand_in_url: str, codex_home: str,
               **extra: str) -> dict[str, str]:
    """The environment of a real `celery worker` process in these tests: this run's database and broker,
    the real codex binary talking to the model stand-in, ``extra`` on top (e.g. ``CODEX_HOMES_ROOT``)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": broker_url,
        "CELERY_TASK_ALWAYS_EAGER": "0",
        "CODEX_BIN": codex_bin,
        "CODEX_HOME": codex_home,
        "CODEX_MODEL_PROVIDER": "stand-in",
        "CODEX_STAND_IN_URL": stand_in_url,
        "CODEX_TURN_TIMEOUT": "60",
        **extra,
    }
    env.pop("CODEX_APP_SERVER_COMMAND", None)
    return env


def wait_ready(started, timeout: float = 60.0) -> None:
    """Wait until every ``(process, log path)`` worker logged Celery's ``ready.``; fail with its log's
    tail when one exits or the ``timeout`` (s) passes first."""
    deadline = time.monotonic() + timeout
    for proc, log in started:
        while b"ready." not in log.read_bytes():
            assert proc.poll() is None, f"worker exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"worker not ready: {log.read_text()[-3000:]}"
            time.sleep(0.2)
