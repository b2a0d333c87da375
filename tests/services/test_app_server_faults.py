"""App-server faults (issue 3 §5) through the real task code: each ends in a defined state within a
bounded time, keeps the binding, records no rotation notice and leaves no process behind."""
import json
import os
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from hermes_sessions import services
from hermes_sessions.models import CodexBinding, Message, Notice, Turn

pytestmark = pytest.mark.django_db(transaction=True)

ITEM = {"type": "commandExecution", "id": "call_1", "command": "ls", "cwd": "/w", "status": "completed",
        "aggregatedOutput": "a\n", "exitCode": 0}


@pytest.fixture
def bound(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_REQUEST_TIMEOUT = 2.0
    settings.CODEX_TURN_TIMEOUT = 2.0
    settings.HERMES_RETRY_DELAYS = (0.05,)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    return session, t1.codex_thread_id


def pids(scripted_codex):
    return {c["pid"] for c in scripted_codex.calls()}


def assert_kept_and_clean(session, thread_id, scripted_codex):
    assert CodexBinding.objects.get(session=session, status="active").thread_id == thread_id
    assert not Notice.objects.exists()
    for pid in pids(scripted_codex):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def run_with_fault(run_turn_now, session, user, scripted_codex, script):
    scripted_codex.script(script)
    started = time.monotonic()
    turn = run_turn_now(session=session, text="hello two", user=user)
    return turn, time.monotonic() - started


def test_process_dies_during_a_turn(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    turn, took = run_with_fault(run_turn_now, session, user, scripted_codex,
                                {"turn/start": [{"turn_items": [ITEM], "exit_mid_turn": 9}]})
    assert turn.status == Turn.Status.FAILED and took < 5
    assert "exited" in turn.error or "EOF" in turn.error or "closed" in turn.error, turn.error
    # What codex completed before it died is stored, consistently (a call and its result).
    assert [(m.role, m.codex_item_id) for m in Message.objects.filter(turn=turn).order_by("seq")] == [
        ("user", ""), ("assistant", "call_1"), ("tool", "call_1")]
    assert_kept_and_clean(session, thread, scripted_codex)


def test_error_notification_then_silence(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    error = {"method": "error", "params": {"error": {"message": "upstream went away"}, "willRetry": False}}
    turn, took = run_with_fault(run_turn_now, session, user, scripted_codex,
                                {"turn/start": [{"notification": error, "no_completion": True}]})
    assert turn.status == Turn.Status.FAILED and took < 10
    assert "did not arrive within 2 s" in turn.error
    assert_kept_and_clean(session, thread, scripted_codex)


def test_stderr_flood_before_initialize_is_drained(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    turn, took = run_with_fault(run_turn_now, session, user, scripted_codex, {"initialize": [{"stderr_lines": 50_000}]})
    assert (turn.status, turn.thread_action) == (Turn.Status.SUCCEEDED, "resumed"), turn.error
    assert_kept_and_clean(session, thread, scripted_codex)


def test_thread_not_found_on_turn_start_resumes_then_retries_once(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    gone = {"error": {"code": -32600, "message": "thread not found: {thread_id}"}}
    turn, _ = run_with_fault(run_turn_now, session, user, scripted_codex, {"turn/start": [gone]})
    assert (turn.status, turn.thread_action) == (Turn.Status.SUCCEEDED, "resumed"), turn.error
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "turn/start", "thread/resume", "turn/start"]
    assert_kept_and_clean(session, thread, scripted_codex)


def test_thread_not_found_twice_fails_without_rotating(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    gone = {"error": {"code": -32600, "message": "thread not found: {thread_id}"}}
    turn, _ = run_with_fault(run_turn_now, session, user, scripted_codex, {"turn/start": [gone, gone]})
    assert turn.status == Turn.Status.FAILED and "thread not found" in turn.error
    assert "thread/start" not in scripted_codex.processes()[-1]
    assert_kept_and_clean(session, thread, scripted_codex)


def test_whole_turn_before_the_turn_start_response_then_exit_completes_once(bound, user, scripted_codex, run_turn_now):
    """Issue 6 §9: turn/started, the items and turn/completed arrive before the turn/start response, then
    the app-server exits at once → one completed turn with its messages; no failure, no retry."""
    session, thread = bound
    turn, _ = run_with_fault(run_turn_now, session, user, scripted_codex,
                             {"turn/start": [{"turn_items": [ITEM], "respond_last": True, "exit_after": 0}]})
    assert (turn.status, turn.thread_action, turn.error) == (Turn.Status.SUCCEEDED, "resumed", ""), turn.error
    assert (turn.attempt, turn.final_text) == (1, "echo: hello two")
    assert turn.codex_turn_id and turn.usage["input_tokens"] > 0
    rows = [(m.role, m.content) for m in Message.objects.filter(turn=turn).order_by("seq")]
    assert [role for role, _ in rows] == ["user", "assistant", "tool", "assistant"]
    assert rows[-1] == ("assistant", "echo: hello two")
    assert len(scripted_codex.processes()) == 2  # turn 1's app-server and this one: nothing was retried
    assert [c["method"] for c in scripted_codex.calls()].count("turn/start") == 2
    assert_kept_and_clean(session, thread, scripted_codex)


def test_unknown_notifications_and_server_requests_do_not_disturb_a_turn(bound, user, scripted_codex, run_turn_now):
    session, thread = bound
    odd = {"method": "some/futureNotification", "params": {"x": 1}}
    turn, _ = run_with_fault(run_turn_now, session, user, scripted_codex, {"turn/start": [
        {"notification": odd, "server_request": {"method": "some/futureRequest", "params": {}}}]})
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    answers = [json.loads(x) for x in (scripted_codex.state / "server_answers.jsonl").read_text().splitlines()]
    assert answers[0]["answer"]["error"]["code"] == -32601  # answered, not left hanging
    assert_kept_and_clean(session, thread, scripted_codex)


def test_celery_soft_time_limit_interrupts_codex_fails_the_turn_and_stops_codex(bound, user, scripted_codex, run_turn_now, monkeypatch):
    session, thread = bound
    scripted_codex.script({"turn/start": [{"no_completion": True}]})

    def over_time(client, spec, out):  # the soft limit fires while the turn streams
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr("hermes_sessions.codex.runner._drive", over_time)
    turn = run_turn_now(session=session, text="hello two", user=user)
    assert turn.status == Turn.Status.FAILED and "time limit" in turn.error
    assert [c["method"] for c in scripted_codex.calls()][-1] == "turn/interrupt"
    assert_kept_and_clean(session, thread, scripted_codex)
