"""``HERMES_LOG_FORMAT=json`` in real processes (``project/log_format.py``): a Celery worker (Celery's own
logging set aside, ``project/celery.py``) running a real turn, and the API (gunicorn + uvicorn workers,
``gunicorn.conf.py``) write nothing but JSON lines, the turn-end line with its fields as keys."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from django.conf import settings

from hermes_sessions import services
from hermes_sessions.models import Turn
from project.celery import app as celery_app
from tests.support.sse import ApiServer
from tests.test_log_format import TURN_KEYS, _json_lines

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_a_worker_and_the_api_started_with_json_write_only_json_lines(tmp_path, user, stand_in, real_codex_bin):
    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "codex_home"),
                     CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_WORK_ROOT=str(tmp_path / "work"),
                     HERMES_LOG_FORMAT="json")
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", TURN_QUEUE, "-c", "1", "-n", "json@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    api = ApiServer(tmp_path / "api.log", env={"HERMES_LOG_FORMAT": "json"})
    celery_app.conf.task_always_eager = False
    try:
        wait_ready([(worker, log)])
        api.start()
        assert api.get("/healthz", None)[0] == 200
        session = services.session_create(owner=user, session_id="sess-json-worker")
        turn = services.turn_enqueue(session=session, input_text="hello", user=user)
        deadline = time.monotonic() + 60
        while Turn.objects.get(pk=turn.pk).status in ("queued", "running"):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # the line is written after the commit
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([worker])
        api.stop()
        _forget_queue(settings.CELERY_BROKER_URL)
    lines = _json_lines(log.read_text())
    loggers = {line["logger"] for line in lines}
    assert {"celery.apps.worker", "hermes_sessions.turns"} <= loggers, loggers  # Celery's "ready." and ours
    [end] = [line for line in lines if line["logger"] == "hermes_sessions.turns"]
    assert (end["turn"], end["status"], end["session"]) == (str(turn.pk), "succeeded", "sess-json-worker"), end
    assert TURN_KEYS <= set(end)
    api_lines = _json_lines((tmp_path / "api.log").read_text())
    assert {"gunicorn.error", "uvicorn.error"} <= {line["logger"] for line in api_lines}, api_lines
