"""The round trips of a warm turn's database work, pinned: the claim, one stream-event batch and the
finalize (``turn_claim``, ``TurnEventWriter``, ``turn_finalize``). Each round trip costs wake-ups of two
processes, and each statement its Python and the server's work, on a CPU that codex shares (``make
bench-warm``); a change that adds one fails here and must say why. Round trips are counted on the wire
(``tests.support.round_trips``: the claim and the finalize send their statements in psycopg's pipeline
mode, ``services.pipelining``); statements as Django records them, which includes its own ``BEGIN`` and
``COMMIT`` entries (a pipelined transaction's COMMIT is sent by ``pipelining`` and recorded twice). Also
pinned: what those statements write, and the NOTIFY each transaction sends (``docs/contract.md`` §8)."""
import hashlib
import time

import psycopg
import pytest
from django.db import connection

from hermes_sessions import services
from hermes_sessions.codex.rollout_files import RolloutDelta
from hermes_sessions.codex.runner import TurnOutcome
from hermes_sessions.models import CodexBinding, CodexRollout, Message, Session, Turn, TurnEvent, WarmThread
from hermes_sessions.services import events, rollouts
from hermes_sessions.services.events import TurnEventWriter
from tests.support.dispatch import hold_dispatches
from tests.support.round_trips import counting, round_trips_counted

pytestmark = pytest.mark.django_db(transaction=True)

THREAD = "019a0000-0000-7000-8000-0000000000aa"
STORED = b'{"type":"session_meta"}\n'

#: BEGIN; lock session + turn (one statement); the decision and its writes — runnable, turn update, user
#: row, session counter, binding and rollout generation read back (``queries.sql``: ``claim``); the ``running``
#: event (session event lock + claim check + insert + NOTIFY); COMMIT — one round trip (Django's log shows
#: BEGIN and COMMIT twice: the pipeline's and its own). Was 14 statements, then 6 round trips, then 2.
CLAIM_QUERIES = 7
CLAIM_ROUND_TRIPS = 1
#: BEGIN; session event lock + claim check + insert + NOTIFY; COMMIT. Was 6.
BATCH_QUERIES = 3
#: BEGIN; lock; rollout header + chunk — one round trip; rows + session counter; turn update + WarmThread
#: upsert + the session's next queued turn (stamped) + the active binding (``turns._end_turn``); thread +
#: usage + completed events with one NOTIFY; COMMIT — the second. Was 27 statements, then 10, then 7
#: round trips.
FINALIZE_QUERIES = 9
FINALIZE_ROUND_TRIPS = 2


@pytest.fixture
def warm_session(user, monkeypatch):
    """A session bound to a thread whose rollout PostgreSQL holds (the warm path's state)."""
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    CodexBinding.objects.create(session=session, thread_id=THREAD)
    CodexRollout.objects.create(thread_id=THREAD, session=session, relpath="sessions/r.jsonl", length=len(STORED),
                                sha256=hashlib.sha256(STORED).hexdigest(), generation=3)
    return session


@pytest.fixture
def listener():
    """A LISTEN connection on the events channel; call it to get the payloads received so far."""
    settings = connection.settings_dict
    conn = psycopg.connect(dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
                           host=settings["HOST"] or None, port=settings["PORT"] or None, autocommit=True)
    conn.execute(f"LISTEN {events.CHANNEL}")

    def received(count):
        return [n.payload for n in conn.notifies(timeout=5, stop_after=count)]

    yield received
    conn.close()


def _outcome(session, turn_no):
    base = rollouts.rollout_state(thread_id=THREAD)
    appended = f'{{"turn":{turn_no}}}\n'.encode()
    whole = STORED + appended
    delta = RolloutDelta(thread_id=THREAD, relpath="sessions/r.jsonl", offset=len(STORED), data=appended,
                         length=len(whole), sha256=hashlib.sha256(whole).hexdigest(), base=base)
    return TurnOutcome(thread_action="resumed", thread_id=THREAD, codex_turn_id="codex-turn-1", status="completed",
                       messages=[{"role": "assistant", "content": "echo: hi", "codex_item_id": "msg_1"}],
                       final_text="echo: hi", usage={"total_tokens": 7}, methods=["thread/resume"], rollout=delta,
                       codex_version="0.1")


def test_a_warm_turn_claims_streams_and_finalizes_in_few_round_trips(
        warm_session, user, listener, django_assert_num_queries):
    session = warm_session
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    queued_id = TurnEvent.objects.get(turn=turn).pk
    assert listener(1) == [f"{session.pk} {turn.pk} {queued_id}"]

    with round_trips_counted() as wire, counting(wire) as trips, django_assert_num_queries(CLAIM_QUERIES):
        claim = services.turn_claim(turn_id=turn.id)
    assert trips == [CLAIM_ROUND_TRIPS]
    assert claim is not None and claim.thread_id == THREAD and claim.rollout_generation == 3 and claim.attempt == 1
    turn.refresh_from_db()
    assert turn.status == Turn.Status.RUNNING and turn.claim_token == claim.token and turn.lease_expires_at
    assert list(Message.objects.filter(turn=turn).values_list("seq", "role", "content")) == [(1, "user", "hi")]
    assert Session.objects.get(pk=session.pk).last_message_seq == 1

    writer = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                             attempt=claim.attempt)
    # A short turn: what codex streams is buffered (written within DELTA_FLUSH_SECONDS by the runner's tick)
    # and, when turn/completed comes first, commits with the finalize — no transaction of its own.
    with django_assert_num_queries(0):
        writer.add(events.DELTA, {"item_id": "msg_1", "text": "echo"})
        writer.add(events.DELTA, {"item_id": "msg_1", "text": ": hi"})
        writer.add(events.ITEM, {"item_id": "msg_1", "item_type": "agentMessage", "messages": []})
        assert 0 < writer.tick() <= events.DELTA_FLUSH_SECONDS
    assert writer.written == 0

    outcome = _outcome(session, 1)
    outcome.stream_tail = writer.take_pending()
    assert [kind for kind, _ in outcome.stream_tail] == ["delta", "delta", "item"]
    with round_trips_counted() as wire, counting(wire) as trips, django_assert_num_queries(FINALIZE_QUERIES):
        done = services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome,
                                      warm_queue="turns.worker-a")
    assert trips == [FINALIZE_ROUND_TRIPS]
    assert done is not None and done.status == Turn.Status.SUCCEEDED
    done.refresh_from_db()
    assert (done.claim_token, done.final_text, done.usage, done.codex_methods) == (
        None, "echo: hi", {"total_tokens": 7}, ["thread/resume"])
    assert done.timings["run_ms"] >= 0 and done.finished_at is not None
    assert list(Message.objects.filter(session=session).order_by("seq").values_list("seq", "role")) == [
        (1, "user"), (2, "assistant")]
    assert CodexRollout.objects.get(thread_id=THREAD).generation == 4
    assert list(CodexRollout.objects.get(thread_id=THREAD).chunks.values_list("seq", "offset")) == [(4, len(STORED))]
    warm = WarmThread.objects.get(session=session)
    assert (warm.queue, warm.thread_id, warm.generation) == ("turns.worker-a", THREAD, 4)

    rows = list(TurnEvent.objects.filter(turn=turn).order_by("id").values_list("id", "kind", "attempt", "data"))
    assert [kind for _, kind, _, _ in rows] == [
        "queued", "running", "delta", "delta", "item", "thread", "usage", "completed"]
    assert [attempt for _, _, attempt, _ in rows] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert rows[-3][3] == {"action": "resumed", "thread_id": THREAD, "rotated_from": "", "notice": ""}
    assert rows[-2][3] == {"total_tokens": 7}
    assert rows[-1][3] == {"status": "succeeded", "error": "", "final_text": "echo: hi"}
    # One NOTIFY per transaction, naming its last event: the claim, the finalize.
    ids = {kind: pk for pk, kind, _, _ in rows}
    assert listener(2) == [f"{session.pk} {turn.pk} {pk}" for pk in (ids["running"], ids["completed"])]


def test_a_long_turns_stream_is_written_in_batches_as_it_comes(warm_session, user, django_assert_num_queries):
    """What codex streams during a longer turn is written once the oldest buffered event is
    DELTA_FLUSH_SECONDS old (the runner's tick between notifications): one transaction per batch."""
    turn = services.turn_enqueue(session=warm_session, input_text="hi", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    writer = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                             attempt=claim.attempt)
    assert writer.tick() is None  # nothing buffered
    writer.add(events.DELTA, {"item_id": "msg_1", "text": "echo"})
    writer.add(events.DELTA, {"item_id": "msg_1", "text": ": hi"})
    time.sleep(events.DELTA_FLUSH_SECONDS)
    with django_assert_num_queries(BATCH_QUERIES):
        assert writer.tick() is None
    assert writer.written == 2 and writer.take_pending() == []
    writer.add(events.RETRYING, {"reason": "x"})  # not codex's stream: at once
    assert writer.written == 3


def test_a_second_warm_claim_finds_the_stored_generation_and_a_busy_one_writes_nothing(
        warm_session, user, django_assert_num_queries):
    session = warm_session
    first = services.turn_enqueue(session=session, input_text="one", user=user)
    second = services.turn_enqueue(session=session, input_text="two", user=user)
    claim = services.turn_claim(turn_id=first.id)
    # The session is busy: the same one round trip, which writes nothing (the ``claim`` statement's ``ok`` is empty).
    with round_trips_counted() as wire:
        with counting(wire) as trips, django_assert_num_queries(CLAIM_QUERIES):
            assert services.turn_claim(turn_id=second.id) is None
        assert trips == [CLAIM_ROUND_TRIPS]
        assert not TurnEvent.objects.filter(turn=second, kind=events.RUNNING).exists()
        assert not Message.objects.filter(turn=second).exists()
        assert Turn.objects.get(pk=second.pk).status == Turn.Status.QUEUED
        services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=_outcome(session, 1))
        with counting(wire) as trips, django_assert_num_queries(CLAIM_QUERIES):
            again = services.turn_claim(turn_id=second.id)
        assert trips == [CLAIM_ROUND_TRIPS]
        assert again is not None and again.rollout_generation == 4 and again.thread_id == THREAD
        # A turn already running: the same round trip, nothing written (one user row, one running event).
        with counting(wire) as trips, django_assert_num_queries(CLAIM_QUERIES):
            assert services.turn_claim(turn_id=second.id) is None
        assert trips == [CLAIM_ROUND_TRIPS]
        assert Message.objects.filter(turn=second).count() == 1
        assert TurnEvent.objects.filter(turn=second, kind=events.RUNNING).count() == 1
        assert Turn.objects.get(pk=second.pk).claim_token == again.token
