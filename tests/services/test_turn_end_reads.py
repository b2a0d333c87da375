"""The reads that the enqueue and the finalize fold into raw statements (``queries.sql``: ``enqueue_reads``,
``turns._end_turn``): which turn the busy check names, which binding a new thread replaces, which
queued turn a finalize dispatches — each branch pinned, since no ORM query states them any more."""
import hashlib

import pytest

from hermes_sessions import services
from hermes_sessions.codex.rollout_files import RolloutDelta
from hermes_sessions.codex.runner import TurnOutcome
from hermes_sessions.models import CodexBinding, CodexRollout, Turn, WarmThread
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db(transaction=True)

OLD = "019a0000-0000-7000-8000-0000000000b1"
NEW = "019a0000-0000-7000-8000-0000000000b2"


def _started(thread_id: str) -> TurnOutcome:
    """A completed turn on a freshly started ``thread_id`` with its first rollout bytes."""
    data = b'{"type":"session_meta"}\n'
    delta = RolloutDelta(thread_id=thread_id, relpath="sessions/new.jsonl", offset=0, data=data, length=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), base=None)
    return TurnOutcome(thread_action="started", thread_id=thread_id, codex_turn_id="ct", status="completed",
                       messages=[{"role": "assistant", "content": "hi", "codex_item_id": "msg_1"}], final_text="hi",
                       methods=["thread/start"], rollout=delta, codex_version="0.1")


def test_a_new_thread_replaces_the_active_binding_to_another_one(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    old = CodexBinding.objects.create(session=session, thread_id=OLD)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    claim = services.turn_claim(turn_id=turn.id)

    done = services.turn_finalize(turn_id=turn.id, token=claim.token, result=_started(NEW), warm_queue="turns.w")

    assert done is not None and done.status == Turn.Status.SUCCEEDED
    old.refresh_from_db()
    assert (old.status, old.ended_reason, old.ended_by_turn_id) == ("ended", "replaced by a newer thread", turn.id)
    assert old.ended_at is not None
    active = CodexBinding.objects.get(session=session, status=CodexBinding.Status.ACTIVE)
    assert (active.thread_id, active.created_by_turn_id) == (NEW, turn.id)
    assert WarmThread.objects.get(session=session).thread_id == NEW
    assert CodexRollout.objects.get(thread_id=NEW).generation == 1


def test_a_resumed_turn_keeps_its_binding_and_a_failed_one_forgets_the_warm_row(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    CodexBinding.objects.create(session=session, thread_id=OLD)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    claim = services.turn_claim(turn_id=first.id)
    resumed = TurnOutcome(thread_action="resumed", thread_id=OLD, codex_turn_id="ct", status="completed")
    services.turn_finalize(turn_id=first.id, token=claim.token, result=resumed, warm_queue="turns.w")
    assert list(CodexBinding.objects.filter(session=session).values_list("thread_id", "status")) == [(OLD, "active")]
    assert not WarmThread.objects.filter(session=session).exists()  # no rollout stored: no worker holds it

    WarmThread.objects.create(session=session, queue="turns.w", thread_id=OLD, generation=1, until=first.created_at)
    second = services.turn_enqueue(session=session, input_text="two", user=user)
    claim = services.turn_claim(turn_id=second.id)
    services.turn_fail(turn_id=second.id, token=claim.token, reason="boom")
    assert not WarmThread.objects.filter(session=session).exists()
    assert list(CodexBinding.objects.filter(session=session).values_list("thread_id", "status")) == [(OLD, "active")]


def test_a_finalize_dispatches_the_oldest_queued_turn_and_stamps_it(user, monkeypatch):
    sent = hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    second = services.turn_enqueue(session=session, input_text="two", user=user)
    third = services.turn_enqueue(session=session, input_text="three", user=user)
    claim = services.turn_claim(turn_id=first.id)
    Turn.objects.filter(pk__in=[second.pk, third.pk]).update(dispatched_at=None)
    sent.clear()

    services.turn_finalize(turn_id=first.id, token=claim.token, result=TurnOutcome(status="completed"))

    assert sent == [str(second.id)]
    stamped = dict(Turn.objects.filter(session=session).values_list("seq", "dispatched_at"))
    assert stamped[2] is not None and stamped[3] is None
    # The last turn of the session ends with nothing queued: nothing sent.
    claim = services.turn_claim(turn_id=second.id)
    services.turn_cancel(turn=third)
    sent.clear()
    services.turn_fail(turn_id=second.id, token=claim.token, reason="boom")
    assert sent == []


def test_the_busy_check_names_the_running_turn_before_queued_ones_else_the_oldest_queued(user, monkeypatch):
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    second = services.turn_enqueue(session=session, input_text="two", user=user)
    with pytest.raises(services.SessionBusy) as info:
        services.turn_enqueue(session=session, input_text="x", user=user, on_busy="reject")
    assert (info.value.turn_id, str(info.value)) == (str(first.id), f"turn {first.id} of this session is queued")
    services.turn_claim(turn_id=first.id)
    services.turn_claim(turn_id=second.id)  # not runnable: stays queued behind the running one
    with pytest.raises(services.SessionBusy) as info:
        services.turn_enqueue(session=session, input_text="x", user=user, on_busy="reject")
    assert (info.value.turn_id, str(info.value)) == (str(first.id), f"turn {first.id} of this session is running")
    # A rejected POST draws a seq but rolls back with it: the next turn gets 3.
    third = services.turn_enqueue(session=session, input_text="three", user=user)
    assert third.seq == 3 and Turn.objects.get(pk=third.pk).created_at == third.created_at
