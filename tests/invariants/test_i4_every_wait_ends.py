"""I4 — every wait ends, fast: a silent app-server fails a request at its deadline, stdout EOF fails
every pending request at once, and a turn that never completes ends failed with a reason.

Each test has a hard ``timeout`` a few seconds long and measures its own clock, so a broken deadline
fails here in seconds rather than hanging until pytest-timeout's suite-wide 300 s.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from hermes_sessions import services
from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.errors import RequestTimeout, TransportError
from hermes_sessions.models import CodexBinding, Turn

SCRIPTED = Path(__file__).resolve().parents[1] / "codex" / "scripted_app_server.py"
SLACK = 1.5  # seconds allowed past a deadline (thread wake-up, a loaded 2-core machine)


def scripted_client(state_dir: Path, script: dict, **kwargs) -> AppServerClient:
    (state_dir / "script.json").write_text(json.dumps(script))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SCRIPTED_STATE_DIR": str(state_dir)}
    return AppServerClient([sys.executable, str(SCRIPTED)], env=env, cwd=str(state_dir), **kwargs)


def wait_for_request(state_dir: Path, method: str) -> None:
    deadline = time.monotonic() + 3
    log = state_dir / "methods.jsonl"
    while not (log.exists() and f'"{method}"' in log.read_text()):
        assert time.monotonic() < deadline, f"{method} never reached the app-server"
        time.sleep(0.01)


@pytest.mark.timeout(6)
@pytest.mark.parametrize("per_call", [False, True], ids=["client-deadline", "per-call-deadline"])
def test_a_request_to_a_silent_app_server_times_out_at_its_deadline(tmp_path, per_call):
    deadline = 0.5
    kwargs = {} if per_call else {"request_timeout": deadline}
    with scripted_client(tmp_path, {"thread/start": [{"hang": True}]}, **kwargs) as client:
        client.start()
        started = time.monotonic()
        with pytest.raises(RequestTimeout) as info:
            client.request("thread/start", timeout=deadline if per_call else None)
        elapsed = time.monotonic() - started
        assert deadline <= elapsed <= deadline + SLACK, elapsed
        assert (info.value.method, info.value.timeout) == ("thread/start", deadline)
        assert client.request("thread/start")["thread"]["id"]  # the process was left running and usable


@pytest.mark.timeout(10)
def test_stdout_eof_fails_every_pending_request_at_once(tmp_path):
    script = {"thread/loaded/list": [{"hang": True}] * 3, "thread/start": [{"exit": 3}]}
    results: dict[int, tuple[BaseException, float]] = {}
    with scripted_client(tmp_path, script, request_timeout=30) as client:
        client.start()

        def pending(n: int) -> None:
            try:
                client.request("thread/loaded/list")
            except BaseException as exc:  # noqa: BLE001 — recorded for the assertions below
                results[n] = (exc, time.monotonic())

        waiters = [threading.Thread(target=pending, args=(n,), daemon=True) for n in range(3)]
        for w in waiters:
            w.start()
        deadline = time.monotonic() + 3
        while (tmp_path / "methods.jsonl").read_text().count("thread/loaded/list") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.request("thread/start")  # the app-server exits instead of answering
        for w in waiters:
            w.join(timeout=max(0.0, started + 3 - time.monotonic()))
        assert sorted(results) == [0, 1, 2], "requests still pending after EOF"

    assert not isinstance(info.value, RequestTimeout) and "exit code 3" in str(info.value)
    for exc, at in results.values():
        assert isinstance(exc, TransportError) and not isinstance(exc, RequestTimeout), exc
        assert at - started < 3  # at EOF, not at the 30 s request deadline


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(15)
def test_a_turn_whose_completion_never_comes_ends_failed_with_a_reason(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_TURN_TIMEOUT = 0.5
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})

    started = time.monotonic()
    turn = run_turn_now(session=session, text="hello", user=user)

    assert time.monotonic() - started < 8
    assert turn.status == Turn.Status.FAILED
    assert "did not arrive within 0.5 s" in turn.error
    assert turn.finished_at is not None and turn.claim_token is None
    assert not CodexBinding.objects.filter(session=session).exists()
