"""App-server faults the real binary can show (codex 0.169.0), through the real task code."""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from devtools.processes import codex_pids
from hermes_sessions import services
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
