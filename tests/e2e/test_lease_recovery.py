"""Lease recovery without beat in a worker that runs no affinity loop (``-c 2``: more than one turn
slot, so no route): its pool processes run ``recovery.SweepLoop`` (``project/celery.py``), and a
dead worker's running turn comes back and runs with no beat anywhere. A real ``celery worker`` process,
the real codex binary and the model stand-in."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from hermes_sessions.models import Message, Turn, TurnEvent
from hermes_sessions.services import events
from project.celery import app as celery_app
from tests.factories import SessionFactory, TurnFactory

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def test_a_worker_with_two_slots_takes_back_a_dead_workers_turn_without_beat(tmp_path, stand_in, real_codex_bin,
                                                                            settings):
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    # A worker claimed this turn and died (kill -9): running, its lease expired, nobody renewing it.
    turn = TurnFactory(session=SessionFactory(), seq=1, input="left by a dead worker", status=Turn.Status.RUNNING,
                       attempt=1, claim_token=uuid.uuid4(), started_at=timezone.now(),
                       lease_expires_at=timezone.now() - timedelta(seconds=1))

    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "legacy_home"),
                     CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_WORK_ROOT=str(tmp_path / "work"),
                     HERMES_WORKER_HEARTBEAT_SECONDS="0.5")
    subprocess.run([sys.executable, "-m", "celery", "-A", "project", "purge", "-f", "-Q", TURN_QUEUE], env=env,
                   cwd=settings.BASE_DIR, check=True, capture_output=True, timeout=60)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:  # no -B, and no beat anywhere
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", f"{TURN_QUEUE},celery", "-c", "2",
             "-n", f"lease-{uuid.uuid4().hex[:6]}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    celery_app.conf.task_always_eager = False
    try:
        wait_ready([(proc, log)])
        deadline = time.monotonic() + 60
        while True:
            turn.refresh_from_db()
            if turn.is_terminal:
                break
            assert time.monotonic() < deadline, f"turn still {turn.status}: {log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([proc])
        _forget_queue(settings.CELERY_BROKER_URL)
    assert turn.status == Turn.Status.SUCCEEDED and turn.attempt == 2, (turn.status, turn.error)
    assert "worker process" in log.read_text() and "queued again (attempt 2 next)" in log.read_text()
    assert TurnEvent.objects.filter(turn=turn, kind=events.RETRYING).count() == 1
    assert list(Message.objects.filter(turn=turn).values_list("role", flat=True).order_by("seq")) == ["user", "assistant"]
