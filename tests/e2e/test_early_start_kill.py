"""A woken worker whose claim is late — codex stopped by the early turn/start's pause
(``worker/warm/early_start.py``) — killed with SIGKILL: no process of codex's may be left behind, stopped or
not. ``pause`` stops the app-server process only: stopping codex's whole process group would stop sandbox
helpers too (``bwrap … --die-with-parent`` being started then), and a helper stopped before it registered to
die with its parent stays, stopped, under init for ever (4 of 4 runs)."""
from __future__ import annotations

import os
import signal
import time

import psycopg
import pytest

from hermes_sessions import services
from hermes_sessions.listener import connection_params
from hermes_sessions.models import Session, TurnWorker
from hermes_sessions.services import dispatch, routing

from .test_affinity import _turn, _wait, stand_in, workers  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def _stat(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _group(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, state, command) of every live process in process group ``pgid`` (codex leads its own; the
    sandbox's bwrap carries no CODEX_HOME, so ``devtools.processes.codex_processes`` does not see it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) and int(fields[2]) == pgid and fields[0] != "Z":
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found.append((int(entry), fields[0], cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:70]))
    return found


def test_a_worker_killed_while_codex_is_paused_leaves_no_process_of_codex_behind(user, workers, stand_in, monkeypatch):  # noqa: F811
    proc = workers.start("a")
    session = services.session_create(owner=user, session_id="paused-kill")
    assert _turn(session, user, "first").status == "succeeded"
    [leader] = workers.codex_of("a")
    queue = workers.queue("a")
    _wait(lambda: TurnWorker.objects.filter(queue=queue, wakeable=True).exists(), 10, "not listening")
    # The test sends the wake itself, below, once another transaction holds the session's row lock (any writer
    # of the session): the claim waits, and the pause job stops codex 20 ms after turn/start.
    monkeypatch.setattr(dispatch, "routes_to_workers", lambda: False)  # the enqueue wakes nobody
    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", lambda *a, **kw: None)
    turn = services.turn_enqueue(session=session, input_text="paused", user=user)
    lock = psycopg.Connection.connect(**connection_params("paused-kill-lock"))
    try:
        lock.execute(f"SELECT 1 FROM {Session._meta.db_table} WHERE {Session._meta.pk.column} = %s FOR UPDATE",
                     [session.pk])
        with psycopg.Connection.connect(**connection_params("paused-kill-notify"), autocommit=True) as notify:
            notify.execute("SELECT pg_notify(%s, %s)", [routing.wake_channel(queue), routing.wake_payload(
                turn_id=turn.pk, session_id=session.pk, text="paused", sent_at=time.time())])
        _wait(lambda: (_stat(leader) or ["?"])[0] == "T", 10, "codex was not paused")
        before = _group(leader)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 of the worker and its pool process; codex has its own group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _group(leader) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _group(leader)
    finally:
        lock.rollback()
        lock.close()
        for pid, _, _ in _group(leader):  # nothing left to the next test
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"left behind (the paused group was {before}): {left}"
