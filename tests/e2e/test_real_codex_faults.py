"""App-server faults the real binary can show (codex 0.169.0), through the real task code."""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from devtools.processes import codex_pids
from hermes_sessions import services, worker
from hermes_sessions.models import CodexBinding, Notice, Turn
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin):
    with ModelStandIn(slow_seconds=6) as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        yield stand_in


def kill_codex_when_streaming(codex_home, stand_in, killed: list[float] | None = None) -> threading.Thread:
    """Kill -9 every codex app-server under ``codex_home`` 0.5 s into the SLOW reply's stream; the
    monotonic time of the kill is appended to ``killed``."""

    def killer():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pids = codex_pids(codex_home)
            if pids and any("SLOW" in text for r in stand_in.requests() for _, text in stand_in.user_texts(r)):
                time.sleep(0.5)  # mid-stream
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                if killed is not None:
                    killed.append(time.monotonic())
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer)
    thread.start()
    return thread


def test_app_server_killed_mid_turn_fails_the_turn_fast_and_keeps_the_binding(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert t1.status == Turn.Status.SUCCEEDED, t1.error

    killed: list[float] = []
    killer = kill_codex_when_streaming(Path(settings.CODEX_HOMES_ROOT), real_codex, killed)
    t2 = run_turn_now(session=session, text="SLOW please", user=user)
    ended = time.monotonic()
    killer.join()
    # Measured from the kill (spawn, restore and the sandbox check before it vary with machine load):
    # the turn ends on stdout EOF, not after the rest of the 6 s stream nor at the turn deadline.
    assert t2.status == Turn.Status.FAILED and killed and ended - killed[0] < 3, (t2.status, killed, ended)
    assert "codex turn failed" in t2.error
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t1.codex_thread_id
    assert not Notice.objects.exists()
    assert codex_pids(settings.CODEX_HOMES_ROOT) == []

    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action, t3.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", t1.codex_thread_id)


def test_unreachable_model_fails_the_turn_with_codex_reason(user, real_codex, run_turn_now, settings):
    settings.CODEX_STAND_IN_URL = "http://127.0.0.1:9/v1"  # nothing listens on the discard port
    session = services.session_create(owner=user)
    started = time.monotonic()
    turn = run_turn_now(session=session, text="hello", user=user)
    assert turn.status == Turn.Status.FAILED and time.monotonic() - started < 10
    assert "Connection failed" in turn.error or "connect" in turn.error.lower()
    assert codex_pids(settings.CODEX_HOMES_ROOT) == []


def test_a_worker_whose_claim_was_taken_back_during_a_database_outage_leaves_the_home_alone(
        user, real_codex, run_turn_now, settings, monkeypatch):
    """``make faults``' db-down-during-restore, played on the real binary (docs/contract.md §2 "home",
    I3): worker A loses its database while it restores turn 2's rollout (retried by the policy); the outage
    outlasts the lease, so the sweep takes turn 2 back and worker B runs it and then turn 3. A's retry comes
    round while B's codex works in the session's home: it must find its claim gone and leave the home alone
    — before, it wiped the home first and B's turn 3 failed (``the rollout … is gone from … after the
    turn``, or codex's ``thread/resume … invalid paginated history lineage … missing source rollout``)."""
    from datetime import timedelta

    from django.db import OperationalError
    from django.utils import timezone

    from hermes_sessions.codex.runner import TurnAbandoned
    from hermes_sessions.worker import execution

    settings.HERMES_RETRY_DELAYS = (0.05,)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert t1.status == Turn.Status.SUCCEEDED, t1.error
    with monkeypatch.context() as mp:
        mp.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
        t2 = services.turn_enqueue(session=session, input_text="hello two", user=user)
    claim_a, control_a = services.turn_claim(turn_id=t2.id), execution.TurnControl()
    assert claim_a is not None

    def database_down(**kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    with monkeypatch.context() as mp:
        mp.setattr(execution, "rollout_restore", database_down)
        with pytest.raises(execution._StartupError) as blip:
            execution._run_once(claim_a, control_a)
    assert execution._may_retry(blip.value)  # the policy tries again after its next delay

    # The outage outlasts A's lease: the sweep takes turn 2 back and worker B runs it (attempt 2).
    Turn.objects.filter(pk=t2.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert worker.turns_sweep().requeued == 1
    t2.refresh_from_db()
    assert (t2.status, t2.attempt, t2.thread_action) == (Turn.Status.SUCCEEDED, 2, "resumed"), t2.error

    # B's codex is up in the session's home for turn 3 when A's retry (its heartbeat not yet told) starts.
    real_drive, stale = execution.drive_turn, []

    def drive_after_stale_retry(client, spec):
        if not stale:
            with pytest.raises(execution.TurnRunError) as info:
                execution._run_once(claim_a, control_a)
            stale.append(info.value.cause)
        return real_drive(client, spec)

    monkeypatch.setattr(execution, "drive_turn", drive_after_stale_retry)
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action, t3.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", t1.codex_thread_id), t3.error
    assert len(stale) == 1 and isinstance(stale[0], TurnAbandoned) and control_a.abandon.is_set()
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t1.codex_thread_id
    assert not Notice.objects.filter(session=session).exists()
    assert codex_pids(settings.CODEX_HOMES_ROOT) == []


def test_a_turn_cut_off_while_streaming_is_in_codexs_thread_once_after_its_rerun(user, real_codex, run_turn_now, settings):
    """The worker loses its claim while codex streams the reply (as when it is killed): codex has
    written the input to the session's rollout on this host but not completed the turn. The re-run on
    this host runs the input again on the stored rollout, not on the lost attempt's file: the model's
    request holds the input once, and so does the next turn's."""
    settings.CODEX_TURN_TIMEOUT = 30.0
    settings.HERMES_HEARTBEAT_SECONDS = 0.2
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert t1.status == Turn.Status.SUCCEEDED, t1.error

    def steal_when_streaming():  # the sweep takes the turn back mid-stream
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any("SLOW" in text for r in real_codex.requests() for _, text in real_codex.user_texts(r)):
                time.sleep(0.5)
                if Turn.objects.filter(session=session, seq=2, status=Turn.Status.RUNNING).update(claim_token=None):
                    break
            time.sleep(0.05)
        from django.db import connection

        connection.close()

    thief = threading.Thread(target=steal_when_streaming)
    thief.start()
    t2 = run_turn_now(session=session, text="SLOW two", user=user)
    thief.join()
    assert (t2.status, t2.attempt) == (Turn.Status.RUNNING, 1)  # left by the worker that lost it
    real_codex.reset()
    from datetime import timedelta

    from django.utils import timezone

    Turn.objects.filter(pk=t2.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    worker.turns_sweep()  # the re-run, here (eager)
    t2.refresh_from_db()
    assert (t2.status, t2.attempt) == (Turn.Status.SUCCEEDED, 2), t2.error
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert t3.status == Turn.Status.SUCCEEDED, t3.error
    for request in real_codex.requests():
        users = [text for role, text in real_codex.user_texts(request) if role == "user"]
        assert users.count("SLOW two") == 1, users
    assert not Notice.objects.filter(session=session).exists()


def test_codex_state_damaged_on_a_seen_host_is_rebuilt_and_the_turn_succeeds(user, real_codex, run_turn_now, settings):
    """A seen host keeps codex's sqlite projection of the held rollout between turns (``docs/codex.md``
    §7). A damaged one (a truncated ``thread_history_*.sqlite``: a full disk, a crash mid-write) is a cache
    codex can rebuild: ``thread/resume`` fails with ``-32603 … database disk image is malformed``; the
    worker drops codex's state and tries again, the turn succeeds on the same thread, nothing rotates."""
    from hermes_sessions.codex.launch import session_home
    from hermes_sessions.codex.rollout_files import codex_state_files

    settings.HERMES_WARM_IDLE_SECONDS = 0  # every turn cold: restored on this (seen) host, codex's state kept
    settings.HERMES_RETRY_DELAYS = (0.05,)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t1.status, t2.status) == (Turn.Status.SUCCEEDED, Turn.Status.SUCCEEDED), (t1.error, t2.error)
    home = session_home(session.pk).home
    history = [p for p in codex_state_files(home) if p.name.startswith("thread_history_") and p.suffix == ".sqlite"]
    assert history, sorted(p.name for p in home.iterdir())
    with open(history[0], "r+b") as fh:
        fh.truncate(100)
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action, t3.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", t1.codex_thread_id), t3.error
    assert not Notice.objects.filter(session=session).exists()
    users = [text for role, text in real_codex.user_texts(real_codex.requests()[-1]) if role == "user"]
    assert users[-3:] != [] and "hello two" in users and users.count("hello three") == 1, users
