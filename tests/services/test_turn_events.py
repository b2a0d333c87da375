"""Turn events (docs/contract.md §8) as the services write them: order, content, rotation notice,
retries and claim fencing — against the scripted app-server and real PostgreSQL."""
import time

import pytest
from django.db import connection

from hermes_sessions import services, worker
from hermes_sessions.codex.runner import TurnOutcome
from hermes_sessions.models import Turn, TurnEvent
from hermes_sessions.services import events
from hermes_sessions.services.events import TurnEventWriter
from tests.support.dispatch import claimed_with_writer, hold_dispatches

pytestmark = pytest.mark.django_db(transaction=True)  # the worker heartbeat uses its own connection

NOTICE = "Codex thread could not be resumed; starting a new one."


def kinds(turn):
    return list(TurnEvent.objects.filter(turn=turn).order_by("id").values_list("kind", flat=True))


def test_a_turn_streams_queued_running_deltas_item_thread_usage_and_its_end(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="hello events", user=user)
    assert turn.status == Turn.Status.SUCCEEDED
    assert kinds(turn) == ["queued", "running", "delta", "item", "thread", "usage", "completed"]
    rows = {e.kind: e for e in TurnEvent.objects.filter(turn=turn)}
    assert rows["queued"].attempt == 0 and rows["running"].attempt == 1 and rows["completed"].attempt == 1
    assert rows["delta"].data["text"] == turn.final_text == "echo: hello events"
    item = rows["item"].data
    assert item["item_type"] == "agentMessage"
    assert item["messages"] == [{"role": "assistant", "content": "echo: hello events", "codex_item_id": item["item_id"]}]
    assert rows["thread"].data == {"action": "started", "thread_id": turn.codex_thread_id, "rotated_from": "",
                                   "notice": ""}
    assert rows["usage"].data == turn.usage and turn.usage["total_tokens"] > 0
    assert rows["completed"].data == {"status": "succeeded", "error": "", "final_text": "echo: hello events"}
    # Ids follow the order of the stream.
    ids = list(TurnEvent.objects.filter(turn=turn).values_list("id", flat=True))
    assert ids == sorted(ids)


def test_rotated_thread_event_carries_the_notice(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    first = run_turn_now(session=session, text="one", user=user)
    scripted_codex.remove_rollout(first.codex_thread_id)
    rotated = run_turn_now(session=session, text="two", user=user)
    assert rotated.thread_action == "rotated"
    thread = TurnEvent.objects.get(turn=rotated, kind="thread").data
    assert thread == {"action": "rotated", "thread_id": rotated.codex_thread_id,
                      "rotated_from": first.codex_thread_id, "notice": NOTICE}


def test_a_cancelled_queued_turn_ends_its_stream(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="never run", user=user)
    services.turn_cancel(turn=turn)
    assert kinds(turn) == ["queued", "cancelled"]
    assert TurnEvent.objects.get(turn=turn, kind="cancelled").data["status"] == "cancelled"


def test_a_requeued_attempt_says_retrying_and_the_next_runs_as_attempt_two(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    services.turn_requeue(turn_id=turn.id, token=claim.token, reason="thread busy")
    again = services.turn_claim(turn_id=turn.id)
    assert again is not None and again.attempt == 2
    rows = list(TurnEvent.objects.filter(turn=turn).order_by("id").values_list("kind", "attempt"))
    assert rows == [("queued", 0), ("running", 1), ("retrying", 1), ("running", 2)]
    assert "thread busy" in TurnEvent.objects.get(turn=turn, kind="retrying").data["reason"]


def test_a_fenced_out_worker_appends_no_event(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    old = services.turn_claim(turn_id=turn.id)
    writer = TurnEventWriter(turn_id=turn.id, session_id=session.id, token=old.token, attempt=old.attempt)
    writer.add(events.DELTA, {"item_id": "a", "text": "from the first worker"})
    writer.flush()
    assert writer.written == 1
    # The sweep takes the turn back (lease expired) and another worker claims it.
    Turn.objects.filter(pk=turn.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    worker.turns_sweep()
    new = services.turn_claim(turn_id=turn.id)
    assert new is not None and new.token != old.token
    time.sleep(events.DELTA_FLUSH_SECONDS)
    writer.add(events.DELTA, {"item_id": "a", "text": "late"})
    writer.add(events.ITEM, {"item_id": "a", "item_type": "agentMessage", "messages": []})
    writer.flush()
    assert writer.fenced and writer.written == 1
    assert writer.take_pending() == []  # nothing for a finalize either
    texts = list(TurnEvent.objects.filter(turn=turn, kind="delta").values_list("data__text", flat=True))
    assert texts == ["from the first worker"]
    assert kinds(turn) == ["queued", "running", "delta", "retrying", "running"]


def test_deltas_in_a_burst_are_written_in_few_transactions(user, monkeypatch):
    """Batching: 200 deltas arriving at once cost a handful of commits, not 200 (each commit also
    takes the session's event lock and sends a NOTIFY)."""
    session, turn, claim, writer = claimed_with_writer(user, monkeypatch, "hi")
    commits = []
    with connection.execute_wrapper(lambda execute, sql, *a: (commits.append(sql) if "pg_notify" in sql else None,
                                                               execute(sql, *a))[1]):
        for i in range(200):
            writer.add(events.DELTA, {"item_id": "m", "text": f"{i},"})
        writer.flush()
    assert len(commits) < 20, len(commits)
    texts = TurnEvent.objects.filter(turn=turn, kind="delta").order_by("id").values_list("data__text", flat=True)
    assert "".join(texts) == "".join(f"{i}," for i in range(200))
    services.turn_finalize(turn_id=turn.id, token=claim.token, result=TurnOutcome(status="completed"))
    assert kinds(turn)[-1] == "completed"
