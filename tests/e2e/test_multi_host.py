"""Several worker "hosts" take turns of several sessions (issue 7 §6): each host is a real Celery worker
process with its own homes root (``CODEX_HOMES_ROOT``: its disk), all on one database and one queue,
running the real codex binary against the model stand-in. Turns land on whichever host is free, one
host's disk (its homes root) is wiped mid-run, and still: no failed turn, no rotation, no notice, and turn N's model
request carries turns 1..N-1 — the rollout moves between hosts through PostgreSQL."""
from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from hermes_sessions import services
from hermes_sessions.models import CodexRollout, Notice, Turn
from project.celery import app as celery_app

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

HOSTS = 3
SESSIONS = 10
TURNS = 3  # per session: 30 real codex turns on 2 shared cores stay within ~30 s


def _start_host(name: str, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    host_env = {**env, "CODEX_HOMES_ROOT": str(root / "homes"), "CODEX_WORK_ROOT": str(root / "work")}
    log = root / "worker.log"
    root.mkdir(parents=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", TURN_QUEUE, "-c", "1", "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            env=host_env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return proc, log


@pytest.fixture
def hosts(tmp_path, stand_in, real_codex_bin, settings):
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "legacy_home"))
    subprocess.run([sys.executable, "-m", "celery", "-A", "project", "purge", "-f", "-Q", TURN_QUEUE], env=env,
                   cwd=settings.BASE_DIR, check=True, capture_output=True, timeout=60)
    started = [_start_host(f"host{i}", tmp_path / f"host{i}", env) for i in range(HOSTS)]
    wait_ready(started)
    celery_app.conf.task_always_eager = False
    try:
        yield [tmp_path / f"host{i}" for i in range(HOSTS)], [log for _, log in started]
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([proc for proc, _ in started])
        _forget_queue(settings.CELERY_BROKER_URL)


def _text(session: int, turn: int) -> str:
    return f"session {session} says {turn}"


def _wait_all(turn_ids: list, *, timeout: float) -> list[Turn]:
    deadline = time.monotonic() + timeout
    while True:
        turns = list(Turn.objects.filter(pk__in=turn_ids))
        if all(t.is_terminal for t in turns):
            return turns
        assert time.monotonic() < deadline, [(t.session_id, t.seq, t.status) for t in turns if not t.is_terminal]
        time.sleep(0.1)


def test_sessions_move_between_hosts_through_postgresql(user, hosts, stand_in):
    roots, logs = hosts
    rng = random.Random(7)
    sessions = [services.session_create(owner=user, session_id=f"multi-{i}") for i in range(SESSIONS)]
    # Each session's turns in order, the sessions interleaved at random; posted in rounds so a session's
    # turns land on whichever host is free at that moment.
    order = [s for s in range(SESSIONS) for _ in range(TURNS)]
    rng.shuffle(order)
    next_turn = [1] * SESSIONS
    turn_ids = []
    wiped = False
    for index, s in enumerate(order):
        turn = services.turn_enqueue(session=sessions[s], input_text=_text(s, next_turn[s]), user=user)
        next_turn[s] += 1
        turn_ids.append(turn.pk)
        if index % HOSTS == HOSTS - 1:
            _wait_all(turn_ids, timeout=60)
            if not wiped and index >= len(order) // 2:
                # A host's disk is lost mid-run (between turns: a disk lost under a running turn fails it).
                victim = next(root / "homes" for root in roots if (root / "homes").is_dir())
                shutil.rmtree(victim)
                wiped = True
    assert wiped
    turns = _wait_all(turn_ids, timeout=90)

    failed = [(t.session_id, t.seq, t.error) for t in turns if t.status != Turn.Status.SUCCEEDED]
    assert failed == []
    actions = {(t.seq == 1, t.thread_action) for t in turns}
    assert actions <= {(True, "started"), (False, "resumed")}, actions  # 0 rotations
    assert not Notice.objects.exists()
    assert CodexRollout.objects.count() == SESSIONS
    ran_on = [log.read_text().count("succeeded in") for log in logs]
    assert sum(1 for n in ran_on if n) >= 2, f"turns per host: {ran_on}"

    requests = stand_in.requests()
    for s in range(SESSIONS):
        for n in range(2, TURNS + 1):
            asked = [r for r in requests if (stand_in.user_texts(r) or [("", "")])[-1][1] == _text(s, n)]
            assert asked, f"no model request for {_text(s, n)!r}"
            texts = {text for _, text in stand_in.user_texts(asked[-1])}
            for k in range(1, n):
                assert _text(s, k) in texts and f"echo: {_text(s, k)}" in texts, (s, n, k, sorted(texts))
