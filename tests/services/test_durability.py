"""Crashes, duplicates, double-texting and cancels (issue 3): nothing lost, doubled or stuck."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from hermes_sessions import services, worker
from hermes_sessions.models import CodexBinding, Message, Notice, Turn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fast_clock(settings):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    settings.HERMES_RETRY_DELAYS = (0.05,)


def expire_lease(turn):
    Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def transcript(session):
    return list(Message.objects.filter(session=session).order_by("seq").values_list("seq", "role", "content"))


def cancel_once_running(session, ready=lambda: True) -> threading.Thread:
    """Start a thread that cancels the session's turn as soon as a worker has claimed it and
    ``ready()`` holds (e.g. codex has received ``turn/start``)."""

    def cancel_when_running():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            running = Turn.objects.filter(session=session, status=Turn.Status.RUNNING).first()
            if running and ready():
                services.turn_cancel(turn=running)
                break
            time.sleep(0.02)
        connection.close()

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    return canceller


def test_turn_of_a_dead_worker_is_taken_back_and_run_once(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello one", user=user)
    turn = services.turn_enqueue(session=session, input_text="hello two", user=user)  # on_commit ran it…
    turn.refresh_from_db()
    assert turn.status == Turn.Status.SUCCEEDED
    # …so simulate the crash on a fresh turn: claimed by a worker that then vanished.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
        lost = services.turn_enqueue(session=session, input_text="hello three", user=user)
    claim = services.turn_claim(turn_id=lost.id)
    assert claim is not None
    expire_lease(lost)

    report = worker.turns_sweep()  # re-queues and dispatches (eager: runs it now)
    assert report.requeued == 1
    lost.refresh_from_db()
    assert (lost.status, lost.attempt, lost.thread_action) == (Turn.Status.SUCCEEDED, 2, "resumed"), lost.error
    rows = transcript(session)
    assert [r[2] for r in rows].count("hello three") == 1  # the user row was not written twice
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
    # The dead worker's claim token is gone: its late commit changes nothing.
    assert services.turn_fail(turn_id=lost.id, token=claim.token, reason="late") is None
    lost.refresh_from_db()
    assert lost.status == Turn.Status.SUCCEEDED


def test_rerun_adopts_the_turn_codex_completed_before_the_worker_died(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)

    class WorkerKilled(BaseException):
        pass

    def die(**kwargs):
        raise WorkerKilled  # kill -9 between codex's turn/completed and our commit

    monkeypatch.setattr("hermes_sessions.worker.execution.turn_finalize", die)
    with pytest.raises(WorkerKilled):
        run_turn_now(session=session, text="hello two", user=user)
    monkeypatch.undo()
    t2 = Turn.objects.get(session=session, seq=2)
    assert t2.status == Turn.Status.RUNNING
    expire_lease(t2)

    worker.turns_sweep()
    t2.refresh_from_db()
    assert (t2.status, t2.attempt, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, 2, t1.codex_thread_id), t2.error
    assert t2.final_text == "echo: hello two"
    assert scripted_codex.turn_inputs() == ["hello one", "hello two"]  # codex ran the input once, not twice
    assert "thread/turns/list" in scripted_codex.processes()[-1]
    assert [r[2] for r in transcript(session)] == ["hello one", "echo: hello one", "hello two", "echo: hello two"]


def test_a_rerun_after_a_turn_cut_off_while_talking_sends_its_input_once(user, scripted_codex, run_turn_now, settings):
    """The worker loses its turn while codex's turn has only talked: the rollout it leaves on this host
    holds the input but no completed turn and no action. The re-run runs the input again — on the rollout
    PostgreSQL stored, not on the lost attempt's file — so that the thread holds the input once (else the
    model sees it twice, in this turn and every later one)."""
    from hermes_sessions.services.rollouts import rollout_load, rollout_state

    settings.CODEX_TURN_TIMEOUT = 10.0
    session = services.session_create(owner=user)
    first = run_turn_now(session=session, text="hello one", user=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})  # codex writes the input, never completes

    def steal():  # the sweep takes the turn back while codex works: the worker stops, committing nothing
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if Turn.objects.filter(session=session, seq=2, status=Turn.Status.RUNNING).update(claim_token=None):
                break
            time.sleep(0.02)
        connection.close()

    thief = threading.Thread(target=steal)
    thief.start()
    lost = run_turn_now(session=session, text="hello two", user=user)
    thief.join()
    assert lost.status == Turn.Status.RUNNING and lost.attempt == 1
    scripted_codex.script({})
    expire_lease(lost)
    worker.turns_sweep()  # re-queued and run again (eager), on this host
    lost.refresh_from_db()
    assert (lost.status, lost.attempt, lost.codex_thread_id) == (Turn.Status.SUCCEEDED, 2, first.codex_thread_id), lost.error
    assert scripted_codex.turn_inputs().count("hello two") == 2  # both attempts reached codex…
    stored = rollout_load(base=rollout_state(thread_id=first.codex_thread_id))
    assert stored.count(b'"text": "hello two"') == 1, stored.decode(errors="replace")  # …the thread holds it once
    assert [r[2] for r in transcript(session)].count("hello two") == 1


def test_a_turn_whose_workers_keep_dying_fails_after_max_attempts(user, scripted_codex, settings, monkeypatch):
    settings.HERMES_MAX_ATTEMPTS = 2
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="doomed", user=user)
    for _ in range(2):
        assert services.turn_claim(turn_id=turn.id) is not None
        expire_lease(turn)
        worker.turns_sweep()
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED
    assert "lost 2 time(s)" in turn.error


def test_sweep_redispatches_a_queued_turn_whose_task_was_lost(user, scripted_codex, settings, monkeypatch):
    settings.HERMES_REDISPATCH_SECONDS = 0
    sent = []
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    services.turn_enqueue(session=session, input_text="two", user=user)  # not the head: not re-sent
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit",
                        lambda turn_id, **_: sent.append(turn_id))
    time.sleep(0.01)
    assert worker.turns_sweep().redispatched == 1
    assert sent == [first.id]


def test_lease_lost_mid_turn_stops_the_worker_and_commits_nothing(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_TURN_TIMEOUT = 10.0
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})

    def steal():  # another party (the sweep) takes the turn back while codex works
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if Turn.objects.filter(session=session, status=Turn.Status.RUNNING).update(claim_token=None):
                break
            time.sleep(0.02)
        connection.close()

    thief = threading.Thread(target=steal)
    thief.start()
    started = time.monotonic()
    turn = run_turn_now(session=session, text="hello", user=user)
    thief.join()
    assert time.monotonic() - started < 5  # noticed within a heartbeat or two, not at the turn deadline
    assert turn.status == Turn.Status.RUNNING  # untouched by the worker that lost it
    assert not CodexBinding.objects.exists()
    assert Message.objects.filter(session=session).count() == 1  # only the user row from the claim


def test_cancel_a_queued_turn_and_the_next_one_still_runs(user, scripted_codex, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    second = services.turn_enqueue(session=session, input_text="two", user=user)
    monkeypatch.undo()
    cancelled = services.turn_cancel(turn=first)
    assert (cancelled.status, cancelled.error) == (Turn.Status.CANCELLED, "cancelled before it ran")
    second.refresh_from_db()
    assert second.status == Turn.Status.SUCCEEDED  # dispatched when the one before it ended
    assert scripted_codex.turn_inputs() == ["two"]


def test_cancel_a_running_turn_interrupts_codex(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_TURN_TIMEOUT = 10.0
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello one", user=user)
    item = {"type": "commandExecution", "id": "call_1", "command": "ls", "cwd": "/w", "status": "completed",
            "aggregatedOutput": "a\n", "exitCode": 0}
    scripted_codex.script({"turn/start": [{"no_completion": True, "turn_items": [item]}]})

    # Cancel once codex runs the turn (on a busy machine the spawn alone can outlast a heartbeat).
    canceller = cancel_once_running(session, ready=lambda: len(scripted_codex.turn_inputs()) == 2)
    started = time.monotonic()
    turn = run_turn_now(session=session, text="hello two", user=user)
    canceller.join()
    assert time.monotonic() - started < 5
    assert turn.status == Turn.Status.CANCELLED, turn.error
    assert turn.error.startswith("cancelled while running")
    assert "turn/interrupt" in [c["method"] for c in scripted_codex.calls()]
    # What codex completed before the interrupt is stored, consistently.
    roles = [(m.role, m.codex_item_id) for m in Message.objects.filter(turn=turn).order_by("seq")]
    assert roles == [("user", ""), ("assistant", "call_1"), ("tool", "call_1")]
    # The binding is kept and the session goes on.
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action) == (Turn.Status.SUCCEEDED, "resumed")


def test_on_busy_reject_names_the_running_turn(user, scripted_codex, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    services.turn_claim(turn_id=first.id)
    with pytest.raises(services.SessionBusy) as info:
        services.turn_enqueue(session=session, input_text="two", user=user, on_busy="reject")
    assert info.value.turn_id == str(first.id)
    assert Turn.objects.filter(session=session).count() == 1


def test_on_busy_interrupt_asks_the_running_turn_to_stop(user, scripted_codex, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    services.turn_claim(turn_id=first.id)
    second = services.turn_enqueue(session=session, input_text="two", user=user, on_busy="interrupt")
    first.refresh_from_db()
    assert first.cancel_requested_at is not None
    assert (second.status, second.seq) == (Turn.Status.QUEUED, 2)
    assert services.turn_heartbeat(turn_id=first.id, token=first.claim_token).cancel_requested


def test_codex_error_text_with_nul_bytes_is_stored(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"turn_status": "failed", "turn_error": {"message": "bad\x00thing \ud800"}}]})
    turn = run_turn_now(session=session, text="x", user=user)
    assert turn.status == Turn.Status.FAILED
    assert "bad\ufffdthing \ufffd" in turn.error
    assert not Notice.objects.exists()


def test_cancel_during_retry_backoff_ends_cancelled_without_running_codex(user, scripted_codex, run_turn_now, settings):
    settings.HERMES_RETRY_DELAYS = (3.0, 3.0)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    writer = {"error": {"code": -32600, "message": "thread {thread_id} already has an active writer"}}
    scripted_codex.script({"thread/resume": [writer, writer, writer]})

    canceller = cancel_once_running(session)
    started = time.monotonic()
    t2 = run_turn_now(session=session, text="hello two", user=user)
    canceller.join()
    assert time.monotonic() - started < 2.5  # the 3 s backoff was cut short
    assert t2.status == Turn.Status.CANCELLED and "cancelled before codex ran it" in t2.error
    assert "hello two" not in scripted_codex.turn_inputs()
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t1.codex_thread_id


def test_a_second_delivery_of_a_running_turn_changes_nothing(user, scripted_codex, monkeypatch):
    from hermes_sessions.tasks import run_turn

    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="one", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    before = transcript(session)
    assert run_turn(str(turn.id)) == {"turn": str(turn.id), "turn_status": "skipped"}
    turn.refresh_from_db()
    assert (turn.status, turn.claim_token, turn.attempt) == (Turn.Status.RUNNING, claim.token, 1)
    assert transcript(session) == before and scripted_codex.calls() == []


def test_binding_ended_by_an_operator_during_a_turn_stays_ended(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    real_finalize = services.turn_finalize

    def operator_acts_first(**kwargs):  # the admin action lands while codex runs turn 2
        services.binding_end(session=session, reason="ended by operator admin")
        return real_finalize(**kwargs)

    monkeypatch.setattr("hermes_sessions.worker.execution.turn_finalize", operator_acts_first)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    monkeypatch.undo()
    assert (t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED, "resumed")
    assert not CodexBinding.objects.filter(session=session, status="active").exists()
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert t3.thread_action == "started" and t3.codex_thread_id != t1.codex_thread_id


def test_a_turn_cancelled_while_its_worker_was_lost_is_not_run_again(user, scripted_codex, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="RUNCMD rm -rf something", user=user)
    services.turn_claim(turn_id=turn.id)
    services.turn_cancel(turn=turn)  # running: only marked
    expire_lease(turn)
    monkeypatch.undo()
    worker.turns_sweep()  # queued again and dispatched (eager)
    turn.refresh_from_db()
    assert turn.status == Turn.Status.CANCELLED and "not run again" in turn.error
    assert scripted_codex.calls() == []


class WorkerKilled(BaseException):
    """kill -9 of the worker, as far as the code under test can tell."""


def test_first_turn_rerun_resumes_the_thread_the_lost_worker_started_and_runs_once(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)

    def die(**kwargs):
        raise WorkerKilled

    monkeypatch.setattr("hermes_sessions.worker.execution.turn_finalize", die)
    with pytest.raises(WorkerKilled):
        run_turn_now(session=session, text="RUNCMD charge the card", user=user)
    monkeypatch.undo()
    turn = Turn.objects.get(session=session)
    provisional = turn.codex_thread_id
    assert turn.status == Turn.Status.RUNNING and provisional  # noted before turn/start, not bound
    assert not CodexBinding.objects.exists()
    expire_lease(turn)

    worker.turns_sweep()
    turn.refresh_from_db()
    assert (turn.status, turn.thread_action, turn.codex_thread_id) == (Turn.Status.SUCCEEDED, "started", provisional)
    assert scripted_codex.turn_inputs() == ["RUNCMD charge the card"]  # once, not twice
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "thread/turns/list"]
    assert CodexBinding.objects.get(session=session, status="active").thread_id == provisional


def test_rerun_starts_afresh_when_the_lost_worker_died_before_turn_start(user, scripted_codex, run_turn_now, monkeypatch):
    from hermes_sessions.services import turns as turn_ops

    session = services.session_create(owner=user)

    def note_then_die(**kwargs):
        turn_ops.turn_note_thread(**kwargs)
        raise WorkerKilled

    monkeypatch.setattr("hermes_sessions.worker.execution.turn_note_thread", note_then_die)
    with pytest.raises(WorkerKilled):
        run_turn_now(session=session, text="hello", user=user)
    monkeypatch.undo()
    turn = Turn.objects.get(session=session)
    expire_lease(turn)

    worker.turns_sweep()
    turn.refresh_from_db()
    assert (turn.status, turn.thread_action) == (Turn.Status.SUCCEEDED, "started"), turn.error
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "thread/start", "turn/start"]
    assert scripted_codex.turn_inputs() == ["hello"]


def test_a_thread_still_held_after_every_retry_goes_back_to_the_queue(user, scripted_codex, run_turn_now, settings):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    writer = {"error": {"code": -32600, "message": "thread {thread_id} already has an active writer"}}
    scripted_codex.script({"thread/resume": [writer, writer, writer]})  # attempt 1: both tries; attempt 2: one
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.attempt, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, 2, t1.codex_thread_id), t2.error
    assert t2.error == ""


def _crash_mid_turn(run_turn_now, monkeypatch, *, session, text, user) -> Turn:
    """Run a turn whose worker dies (kill -9) after codex accepted turn/start; return it with its
    lease expired, ready for the sweep."""

    def die(client, spec, out):
        raise WorkerKilled

    with monkeypatch.context() as patched:
        patched.setattr("hermes_sessions.codex.runner._drive", die)
        with pytest.raises(WorkerKilled):
            run_turn_now(session=session, text=text, user=user)
    turn = Turn.objects.filter(session=session).order_by("-seq").first()
    expire_lease(turn)
    return turn


def test_a_turn_cut_off_after_codex_ran_a_command_is_not_run_again(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    command = {"type": "commandExecution", "id": "call_7", "command": "date >> ran.txt", "cwd": "/w",
               "status": "completed", "aggregatedOutput": "", "exitCode": 0}
    scripted_codex.script({"turn/start": [{"turn_items": [command], "no_completion": True}]})
    t2 = _crash_mid_turn(run_turn_now, monkeypatch, session=session, text="RUNCMD date >> ran.txt", user=user)

    worker.turns_sweep()
    t2.refresh_from_db()
    assert t2.status == Turn.Status.FAILED and "not run again" in t2.error and "commandExecution" in t2.error
    assert scripted_codex.turn_inputs().count("RUNCMD date >> ran.txt") == 1  # the command ran once
    rows = [(m.role, m.codex_item_id) for m in Message.objects.filter(turn=t2).order_by("seq")]
    assert rows == [("user", ""), ("assistant", "call_7"), ("tool", "call_7")]  # what codex did is on record
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t1.codex_thread_id


def test_a_turn_cut_off_before_doing_anything_is_run_again(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello one", user=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})
    t2 = _crash_mid_turn(run_turn_now, monkeypatch, session=session, text="just talk", user=user)

    worker.turns_sweep()
    t2.refresh_from_db()
    assert (t2.status, t2.final_text) == (Turn.Status.SUCCEEDED, "echo: just talk"), t2.error
    assert scripted_codex.turn_inputs().count("just talk") == 2  # nothing had happened; safe to repeat
