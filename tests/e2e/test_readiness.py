"""``GET /readyz`` on the production shape (issue 27 §2): a real API process (gunicorn + uvicorn, as
``make run``) reaches PostgreSQL through a TCP proxy the test cuts and restores
(``devtools.faults.pgproxy``), its broker is a private redis-server the test stops and starts again, and
a real Celery worker (the real codex binary's sandbox check) is killed and replaced. Each time the probe
turns 503 naming the failing check, answers within ~3 s, and turns 200 again once the piece is back.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from devtools.faults.pgproxy import PgProxy
from devtools.processes import free_port
from tests.support.sse import ApiServer

from .conftest import wait_ready, worker_env
from .test_seed_e2e import _database_url

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

STALE = 3  # HERMES_WORKER_STALE_SECONDS of the API and the worker
ANSWER_WITHIN = 3.5  # seconds: the readiness deadline (2.5 s) and an HTTP round trip
PASSWORD = "hunter2-readiness"


def _readyz(port: int) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), time.monotonic() - started
    finally:
        conn.close()


def _until(port: int, status: int, timeout: float) -> dict[str, Any]:
    """Poll ``/readyz`` until it answers ``status``; every answer within ``ANSWER_WITHIN`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got, body, took = _readyz(port)
        assert took < ANSWER_WITHIN, (took, body)
        assert PASSWORD not in json.dumps(body)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"/readyz still {got} after {timeout} s: {body}"
        time.sleep(0.3)


def _failed(body: dict[str, Any]) -> list[str]:
    return sorted(name for name, check in body["checks"].items() if check["status"] == "failed")


class Worker:
    """One real ``celery worker -c 1`` process (its own process group), started and killed by the test."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env, self.n = root, env, 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.n += 1
        log = self.root / f"worker{self.n}.log"
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", self.env["HERMES_TURN_QUEUE"], "-c", "1",
                 "-n", f"ready{self.n}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
                env=self.env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready([(self.proc, log)])

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_readyz_names_the_piece_that_is_gone_and_recovers(tmp_path, redis_broker, real_codex_bin):
    queue = f"turns-ready-{time.monotonic_ns()}"
    proxy = PgProxy(("127.0.0.1", int(settings.DATABASES["default"]["PORT"] or 5432)), free_port())
    proxy.up()
    db = settings.DATABASES["default"]
    common = {"HERMES_WORKER_STALE_SECONDS": str(STALE), "HERMES_TURN_QUEUE": queue,
              "CELERY_BROKER_URL": redis_broker.url}
    # A password in the URL (trust authentication ignores it): no answer may show it.
    api = ApiServer(tmp_path / "api.log", env={
        **common, "DATABASE_URL": f"postgres://{db['USER']}:{PASSWORD}@127.0.0.1:{proxy.port}/{db['NAME']}"})
    worker = Worker(tmp_path, worker_env(
        database_url=_database_url(), broker_url=redis_broker.url, codex_bin=real_codex_bin,
        stand_in_url="http://127.0.0.1:9/v1", codex_home=str(tmp_path / "legacy_home"),
        CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_WORK_ROOT=str(tmp_path / "work"),
        HERMES_VAR_DIR=str(tmp_path / "var"), HERMES_WORKER_HEARTBEAT_SECONDS="0.5", **common))
    try:
        api.start()
        body = _until(api.port, 503, 5)  # no worker yet
        assert _failed(body) == ["sandbox", "workers"], body
        worker.start()
        body = _until(api.port, 200, 20)
        assert body["status"] == "ready" and "ready1@" in body["checks"]["workers"]["reason"], body
        assert "1 passed" in body["checks"]["sandbox"]["reason"], body

        # PostgreSQL gone: refused at once; then a server that never answers (the connect is held).
        proxy.down()
        body = _until(api.port, 503, 5)
        assert _failed(body) == ["database", "migrations", "sandbox", "workers"], body
        assert "PostgreSQL unreachable" in body["checks"]["database"]["reason"], body
        proxy.up()
        _until(api.port, 200, 10)
        trap = proxy.arm(b"hermes health")  # the probe's own connection (its application_name) hangs
        status, body, took = _readyz(api.port)
        assert status == 503 and "database" in _failed(body) and took < ANSWER_WITHIN, (took, body)
        proxy.disarm(trap)
        _until(api.port, 200, 10)

        # The broker gone, then back on its port.
        redis_broker.stop()
        body = _until(api.port, 503, 5)
        assert _failed(body) == ["broker"], body
        assert "broker unreachable" in body["checks"]["broker"]["reason"], body
        redis_broker.start({"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"})
        _until(api.port, 200, 10)

        # Every worker gone (kill -9: its row stays, and goes stale), then a new one.
        worker.kill9()
        body = _until(api.port, 503, STALE + 5)
        assert _failed(body) == ["sandbox", "workers"], body
        assert "last heard of: ready1@" in body["checks"]["workers"]["reason"], body
        worker.start()
        body = _until(api.port, 200, 20)
        assert "ready2@" in body["checks"]["workers"]["reason"], body
    finally:
        worker.kill9()
        api.stop()
        proxy.close()
