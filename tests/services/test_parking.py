"""A turn waiting for a person parks (docs/contract.md §10, ``hermes_sessions/worker/runners.py``), through
the real task code on the scripted app-server: the delivery returns and the worker's turn slot is free
while the turn keeps its runner and app-server; the decision then finishes it, answered once. A parked
turn's app-server is not kept; ``HERMES_MAX_PARKED_TURNS`` bounds them; the runner's time limit ends a
parked turn; the worker's stop gives a parked turn back to the queue with its approval pending (A8)."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from hermes_sessions import services, tasks
from hermes_sessions.models import Approval, Turn
from hermes_sessions.services import routing
from hermes_sessions.worker import approvals, execution, process, runners, time_limits, wake
from hermes_sessions.worker import approvals as approvals_mod
from hermes_sessions.worker.warm import kept as kept_mod
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db(transaction=True)

COMMAND = {"method": "item/commandExecution/requestApproval", "params": {
    "itemId": "call_1", "command": "/bin/bash -lc 'touch approved.txt'", "cwd": "/w",
    "availableDecisions": ["accept", "cancel"]}}


@pytest.fixture(autouse=True)
def fast_clock(settings, monkeypatch):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    monkeypatch.setattr(approvals, "PARK_AFTER", 0.1)


@pytest.fixture
def pool(monkeypatch):
    """This process runs turns on runners, as a worker process does (``process.start``), and has a wake
    listener, so a Celery delivery holds ``wake.turn_slot`` while its turn runs."""
    made = runners.Runners()
    made.start()
    monkeypatch.setattr(process.runtime(), "runners", made)
    monkeypatch.setattr(process.runtime(), "listener", object())
    yield made
    made.stop(timeout=10)


def answers(scripted_codex) -> list[dict]:
    path = scripted_codex.state / "server_answers.jsonl"
    return [json.loads(line)["answer"] for line in path.read_text().splitlines()] if path.exists() else []


def until(check: Callable[[], object], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def posted(user, text: str, *, asks: bool) -> Turn:
    session = services.session_create(owner=user, model_config={"approval_policy": "untrusted"} if asks else {})
    return services.turn_enqueue(session=session, input_text=text, user=user)


def status(turn: Turn) -> str:
    return Turn.objects.get(pk=turn.pk).status


def slot_free() -> bool:
    """No turn holds one of this process's permits (``wake.TurnSlots``)."""
    return wake.turn_slots().held() == 0


def test_a_waiting_turn_parks_frees_the_slot_and_finishes_after_the_decision(user, scripted_codex, pool, monkeypatch):
    hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
    asking = posted(user, "RUNCMD touch approved.txt", asks=True)
    result = tasks.run_turn.run(str(asking.pk))
    assert result == {"turn": str(asking.pk), "turn_status": "parked"}
    assert slot_free() and runners.parked_count() == 1
    assert status(asking) == Turn.Status.RUNNING
    approval = Approval.objects.get(turn_ref=asking.pk)
    assert approval.status == Approval.Status.PENDING

    other = posted(user, "hello", asks=False)  # another session's turn takes the slot meanwhile
    assert tasks.run_turn.run(str(other.pk))["turn_status"] == Turn.Status.SUCCEEDED
    assert status(asking) == Turn.Status.RUNNING

    services.approval_decide(approval_id=approval.pk, user=user, decision="accept")
    until(lambda: status(asking) == Turn.Status.SUCCEEDED)
    assert answers(scripted_codex) == [{"id": 0, "result": {"decision": "accept"}}]
    until(lambda: runners.parked_count() == 0)
    assert pool.idle_threads() == 2  # two turns ran at once: two runners, each idle again


def test_a_woken_turn_that_parks_gives_its_permit_back(user, scripted_codex, pool, settings, monkeypatch):
    """With one permit, a woken turn waiting for a person parks and its runner gives the permit back: the
    next wake runs at once; the parked turn finishes after the decision."""
    settings.HERMES_WORKER_TURNS = 1
    hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
    asking = posted(user, "RUNCMD touch approved.txt", asks=True)
    run = execution.turn_execute_woken(asking.pk, str(asking.session_id))
    assert isinstance(run, runners.TurnRun)
    until(lambda: runners.parked_count() == 1)
    assert slot_free() and status(asking) == Turn.Status.RUNNING
    other = posted(user, "hello", asks=False)
    execution.turn_execute_woken(other.pk, str(other.session_id))
    until(lambda: status(other) == Turn.Status.SUCCEEDED)
    _decide_when_pending(user, asking, "accept").join(15)
    until(lambda: status(asking) == Turn.Status.SUCCEEDED)
    until(lambda: runners.parked_count() == 0 and slot_free())


def test_a_decision_given_at_once_leaves_the_turn_on_its_slot(user, scripted_codex, pool, monkeypatch):
    monkeypatch.setattr(approvals, "PARK_AFTER", 30.0)
    hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
    asking = posted(user, "RUNCMD touch approved.txt", asks=True)
    _decide_when_pending(user, asking, "accept")
    assert tasks.run_turn.run(str(asking.pk))["turn_status"] == Turn.Status.SUCCEEDED
    assert runners.parked_count() == 0


def _decide_when_pending(user, turn: Turn, decision: str, after: float = 0.0) -> threading.Thread:
    def person() -> None:
        from django.db import connection

        try:
            until(lambda: Approval.objects.filter(turn_ref=turn.pk, status=Approval.Status.PENDING).exists())
            time.sleep(after)
            approval = Approval.objects.get(turn_ref=turn.pk, status=Approval.Status.PENDING)
            services.approval_decide(approval_id=approval.pk, user=user, decision=decision)
        finally:
            connection.close()

    thread = threading.Thread(target=person, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("parks", [True, False])
def test_a_parked_turns_app_server_is_closed_not_kept(user, scripted_codex, pool, settings, monkeypatch, parks):
    """In a process that keeps threads loaded, a turn decided on its slot leaves its app-server to the
    keeper; a parked one closes it (it finished beside the slot's turn, whose keeper it must not touch)."""
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 60.0, 4
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, "turns-test.parking")
    monkeypatch.setattr(execution, "start_affinity", lambda k: None)
    monkeypatch.setattr(approvals, "PARK_AFTER", 0.1 if parks else 30.0)
    kept_mod.close_keeper()
    keeper = kept_mod.keeper_make()
    assert keeper is not None
    try:
        hold_dispatches(monkeypatch)
        scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
        asking = posted(user, "RUNCMD touch approved.txt", asks=True)
        person = _decide_when_pending(user, asking, "accept", after=0.5 if parks else 0.0)
        result = tasks.run_turn.run(str(asking.pk))
        person.join(15)
        until(lambda: status(asking) == Turn.Status.SUCCEEDED)
        until(lambda: pool.idle_threads() == 1)  # the runner is done with it
        assert result["turn_status"] == ("parked" if parks else Turn.Status.SUCCEEDED)
        assert (keeper.peek(asking.session_id) is None) is parks
    finally:
        kept_mod.close_keeper()


def test_past_the_bound_a_waiting_turn_keeps_its_slot(user, scripted_codex, pool, settings, monkeypatch):
    settings.HERMES_MAX_PARKED_TURNS = 1
    hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}, {"server_request": COMMAND}]})
    first = posted(user, "RUNCMD touch approved.txt", asks=True)
    assert tasks.run_turn.run(str(first.pk))["turn_status"] == "parked"
    second = posted(user, "RUNCMD touch approved.txt", asks=True)
    _decide_when_pending(user, second, "accept", after=1.0)
    t0 = time.monotonic()
    assert tasks.run_turn.run(str(second.pk))["turn_status"] == Turn.Status.SUCCEEDED  # held its slot to its end
    assert time.monotonic() - t0 > 1.0 and runners.parked_count() == 1
    _decide_when_pending(user, first, "decline").join(15)
    until(lambda: status(first) == Turn.Status.SUCCEEDED)


def test_the_runners_time_limit_ends_a_parked_turn(user, scripted_codex, pool, monkeypatch):
    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: None)  # the hard limit must not kill pytest
    # Parks 0.2 s into its wait, well before the 4 s soft limit even on a loaded host; the limit then ends it.
    monkeypatch.setattr(approvals_mod, "PARK_AFTER", 0.2)
    monkeypatch.setattr(execution, "turn_time_limits", lambda: (4, 60))
    hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
    asking = posted(user, "RUNCMD touch approved.txt", asks=True)
    assert tasks.run_turn.run(str(asking.pk))["turn_status"] == "parked"
    until(lambda: Turn.objects.get(pk=asking.pk).is_terminal)
    turn = Turn.objects.get(pk=asking.pk)
    assert (turn.status, turn.error) == (Turn.Status.FAILED, time_limits.TIME_LIMIT_REASON)
    approval = Approval.objects.get(turn_ref=asking.pk)
    assert approval.status == Approval.Status.CANCELLED, approval.reason  # by the desk or the turn's end (A4)


def test_the_workers_stop_gives_a_parked_turn_back_with_its_approval_pending(user, scripted_codex, pool, monkeypatch):
    sent = hold_dispatches(monkeypatch)
    scripted_codex.script({"turn/start": [{"server_request": COMMAND}]})
    asking = posted(user, "RUNCMD touch approved.txt", asks=True)
    assert tasks.run_turn.run(str(asking.pk))["turn_status"] == "parked"
    t0 = time.monotonic()
    pool.stop(timeout=30)
    assert time.monotonic() - t0 < 5  # given back at once, not waited for
    turn = Turn.objects.get(pk=asking.pk)
    assert (turn.status, turn.attempt) == (Turn.Status.QUEUED, 1) and runners.GIVEN_BACK_REASON in turn.error
    assert sent[-1] == str(asking.pk)  # dispatched again, for any worker
    approval = Approval.objects.get(turn_ref=asking.pk)
    assert (approval.status, approval.answered_at) == (Approval.Status.PENDING, None)  # the re-run carries it (A8)
    assert answers(scripted_codex) == []  # codex was killed before any answer could reach it
