"""The enqueue of ``on_busy`` ``enqueue`` / ``interrupt`` in one round trip (``turns._enqueue_in_one_trip``):
what the two-trip enqueue decided in Python between its round trips — the seq, the queued
event's data, whether to wake the holder, the interrupt — now decided by the statements themselves, and
nothing of it reaching a session that is not the caller's. On PostgreSQL, as the outermost transaction
(``transaction=True``): inside a test's transaction the two-trip path runs instead."""
from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from hermes_sessions import services
from hermes_sessions.listener import connection_params
from hermes_sessions.models import Approval, Session, Turn
from hermes_sessions.services import events, pipelining, routing
from hermes_sessions.sql import query
from hermes_sessions.worker import recovery
from project.celery import app as celery_app
from tests.factories import ApprovalFactory, SessionFactory, TurnFactory, UserFactory

from .test_affinity import own, warm_row, worker_row
from .test_wake import Listening, listening  # noqa: F401 — the fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
def celery_sends():
    """Celery's app not eager: the enqueue routes and wakes as an API process does (nothing is sent: the
    woken path sends no Celery message, and ``sent`` records the others)."""
    celery_app.conf.task_always_eager = False
    try:
        yield
    finally:
        celery_app.conf.task_always_eager = True


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, str | None]]:
    from hermes_sessions import tasks

    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(tasks.run_turn, "apply_async", lambda args, **kw: calls.append((args[0], kw.get("queue"))))
    return calls


def held_session(user, listening, name: str, *, wakeable: bool):  # noqa: F811
    """A session of ``user`` whose thread a worker (``wakeable`` or not) keeps loaded; its queue, and a LISTEN
    on that worker's wake channel."""
    session = SessionFactory(owner=user)
    queue = own(name)
    worker_row(queue, wakeable=wakeable)
    warm_row(session, queue)
    return session, queue, listening(queue)


def trips(monkeypatch) -> list[int]:
    """The round trips of every batch sent from now on (``Batch.round_trips`` per batch)."""
    counted: list[int] = []
    real = pipelining.Batch.send

    def send(self, *, commit=False):
        before = self.round_trips
        real(self, commit=commit)
        counted.append(self.round_trips - before)

    monkeypatch.setattr(pipelining.Batch, "send", send)
    return counted


@pytest.mark.parametrize("queue", ["turns.a@host", "turns.ünïcödé-'quoted\"@h", "turns." + "n" * 300 + "@host"])
def test_postgresql_names_the_wake_channel_as_python_does(queue):
    """The one-trip enqueue's statement names the holder's channel from the route it reads (``queries.sql``:
    ``enqueue_reads_and_wake``); that expression, run on ``'wake:<queue>'``, gives ``routing.wake_channel``."""
    channel = re.search(r"pg_notify\((.*), %s\) FROM r WHERE", query("enqueue_reads_and_wake")).group(1)
    with connection.cursor() as cursor:
        cursor.execute(f"WITH r AS (SELECT 'wake:' || %s AS route) SELECT {channel} FROM r", [queue])
        assert cursor.fetchone()[0] == routing.wake_channel(queue)


def test_a_turn_is_queued_in_one_round_trip_with_its_seq_and_its_queued_event(user, monkeypatch, sent, celery_sends):
    session = SessionFactory(owner=user)
    counted = trips(monkeypatch)
    first = services.turn_enqueue(owned_session_id=session.id, input_text="one", user=user)
    second = services.turn_enqueue(owned_session_id=session.id, input_text="two", user=user)
    assert [t for t in counted if t] == [1, 1]
    assert (first.seq, second.seq) == (1, 2)
    stored = {t.pk: t for t in Turn.objects.filter(session=session)}
    assert stored[first.pk].seq == 1 and stored[second.pk].seq == 2 and stored[second.pk].input == "two"
    assert stored[second.pk].dispatched_at is not None and stored[second.pk].status == Turn.Status.QUEUED
    for turn in (first, second):
        assert list(stored[turn.pk].events.values_list("kind", "data")) == [("queued", {"seq": turn.seq})]
    # No warm worker: the shared queue, for the first; the second, queued behind it, is dispatched by its end.
    assert sent == [(str(first.pk), None)]
    assert Session.objects.get(pk=session.pk).last_turn_seq == 2


def test_the_queued_events_stream_wake_up_is_sent_by_the_enqueue_itself_and_only_for_a_written_event(
        user, monkeypatch, sent, celery_sends):
    """The event streams' ``NOTIFY`` (``<session> <turn> <event id>``) goes with the enqueue's COMMIT — no
    round trip of its own after it — and a refused enqueue (another user's session) sends none."""
    streams = Listening(events.CHANNEL)
    try:
        mine = SessionFactory(owner=user)
        counted = trips(monkeypatch)
        with CaptureQueriesContext(connection) as captured:
            turn = services.turn_enqueue(owned_session_id=mine.id, input_text="hi", user=user)
        assert [t for t in counted if t] == [1]
        sqls = [q["sql"] for q in captured.captured_queries]
        assert sqls[-1] == "COMMIT", sqls  # no statement of its own after the commit
        assert any("pg_notify(" in s and "turnevent" in s for s in sqls[:-1]), sqls
        queued = turn.events.get()
        assert streams.payloads() == [f"{mine.id} {turn.id} {queued.pk}"]
        with pytest.raises(Session.DoesNotExist):
            services.turn_enqueue(owned_session_id=SessionFactory(owner=UserFactory()).id, input_text="x", user=user)
        assert streams.payloads() == []
    finally:
        streams.close()


def test_another_users_session_gets_nothing_no_turn_no_interrupt_no_wake(user, listening, celery_sends, sent):  # noqa: F811
    """The enqueue's statements run whatever the lock found; each of them must match nothing for a session
    that is not the caller's: its running turn is not interrupted, its holder not woken (a wake would hand its
    input to that session's codex), its seq not drawn."""
    owner = UserFactory()
    theirs = SessionFactory(owner=owner)
    running = TurnFactory(session=theirs, status=Turn.Status.RUNNING, seq=1)
    Session.objects.filter(pk=theirs.pk).update(last_turn_seq=1)
    queue = own("foreign")
    worker_row(queue, wakeable=True)
    warm_row(theirs, queue)
    heard = listening(queue)
    for on_busy in ("enqueue", "interrupt"):
        with pytest.raises(Session.DoesNotExist):
            services.turn_enqueue(owned_session_id=theirs.id, input_text="not yours", user=user, on_busy=on_busy)
    running.refresh_from_db()
    assert running.cancel_requested_at is None
    assert list(Turn.objects.filter(session=theirs).values_list("pk", flat=True)) == [running.pk]
    assert Session.objects.get(pk=theirs.pk).last_turn_seq == 1
    assert heard.payloads() == [] and sent == []


def test_the_holder_is_woken_with_the_input_only_when_nothing_else_of_the_session_is_running_or_queued(
        user, listening, celery_sends, sent, settings):  # noqa: F811
    settings.HERMES_EARLY_START = True
    session, queue, heard = held_session(user, listening, "one-trip", wakeable=True)
    first = services.turn_enqueue(owned_session_id=session.id, input_text="wake me", user=user)
    (payload,) = heard.payloads()
    assert routing.parse_payload(payload)[:2] == (first.pk, session.id)
    assert routing.parse_payload(payload)[2].text == "wake me"
    # Queued behind the first (still queued): its holder claims it once the first ends; no wake now.
    second = services.turn_enqueue(owned_session_id=session.id, input_text="behind", user=user)
    assert second.seq == 2 and heard.payloads() == []
    assert sent == []  # nor a message: the first one's end dispatches it


def test_a_holder_that_does_not_listen_is_sent_the_task_instead(user, listening, celery_sends, sent):  # noqa: F811
    session, queue, heard = held_session(user, listening, "deaf", wakeable=False)
    turn = services.turn_enqueue(owned_session_id=session.id, input_text="hi", user=user)
    assert heard.payloads() == []
    assert sent == [(str(turn.pk), None)]  # the shared queue


def test_on_busy_interrupt_asks_the_running_turn_to_stop_and_closes_its_approvals_in_the_enqueue(
        user, monkeypatch, celery_sends, sent):
    # Two round trips, as on_busy=reject: the interrupt reads the running turn and closes its pending
    # approvals in the enqueue's transaction (docs/contract.md §10, A4).
    session = SessionFactory(owner=user)
    running = TurnFactory(session=session, status=Turn.Status.RUNNING, seq=1, attempt=1)
    pending = ApprovalFactory(turn=running)
    Session.objects.filter(pk=session.pk).update(last_turn_seq=1)
    counted = trips(monkeypatch)
    turn = services.turn_enqueue(owned_session_id=session.id, input_text="stop that", user=user, on_busy="interrupt")
    assert [t for t in counted if t] == [1, 1]
    running.refresh_from_db()
    pending.refresh_from_db()
    assert running.cancel_requested_at is not None and turn.seq == 2
    assert pending.status == Approval.Status.CANCELLED


def test_concurrent_posts_to_one_session_get_consecutive_seqs_and_matching_events(user, celery_sends, sent):
    session = SessionFactory(owner=user)
    made: list[Turn] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def post(i: int) -> None:
        try:
            start.wait()
            made.append(services.turn_enqueue(owned_session_id=session.id, input_text=f"t{i}", user=user))
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(t.seq for t in made) == [1, 2, 3, 4, 5, 6]
    assert sorted(Turn.objects.filter(session=session).values_list("input", flat=True)) == [f"t{i}" for i in range(6)]
    for turn in made:
        stored = Turn.objects.get(pk=turn.pk)
        assert stored.seq == turn.seq and stored.input == turn.input
        assert list(stored.events.values_list("kind", "data")) == [("queued", {"seq": turn.seq})]


def test_a_nul_byte_in_the_input_is_stored_cleaned_not_a_500(user, celery_sends, sent):
    """The input travels as a parameter of the INSERT … SELECT (PostgreSQL refuses NUL in text)."""
    session = SessionFactory(owner=user)
    turn = services.turn_enqueue(owned_session_id=session.id, input_text="a\x00b", user=user)
    assert "\x00" not in Turn.objects.get(pk=turn.pk).input



@pytest.mark.parametrize("on_busy", ["enqueue", "interrupt", "reject"])
def test_a_turn_that_waited_for_the_session_lock_is_not_born_overdue(user, celery_sends, sent, settings, on_busy):
    """``dispatched_at`` is when the turn is dispatched — the sweep counts from it —: the commit, not the
    moment the POST began to wait for the session's lock. Stamped before the wait, a POST that waited longer
    than HERMES_AFFINITY_DEADLINE would make a turn that the sweep dispatches to the shared queue at once,
    taking it from its warm holder (it would run cold)."""
    settings.HERMES_AFFINITY_DEADLINE = 0.5
    settings.HERMES_POST_LOCK_TIMEOUT_MS = 3000
    session = SessionFactory(owner=user)
    queue = own("late")
    worker_row(queue, wakeable=True)
    warm_row(session, queue)
    holder = psycopg.Connection.connect(**connection_params("test-lock-holder"))
    try:
        holder.execute(f'SELECT 1 FROM {Session._meta.db_table} WHERE id = %s FOR NO KEY UPDATE', [session.pk])
        threading.Timer(0.8, holder.commit).start()  # a finalize or an operator's command holding it 0.8 s
        began = timezone.now()
        turn = services.turn_enqueue(owned_session_id=session.id, input_text="hi", user=user, on_busy=on_busy)
        overdue = Turn.objects.filter(pk=turn.pk, dispatched_at__lt=timezone.now() - timedelta(
            seconds=settings.HERMES_AFFINITY_DEADLINE)).exists()  # right after the 202: the sweep's rule
        swept = recovery.turns_dispatch_unclaimed(limit=20, by="test")
    finally:
        time.sleep(0.9)
        holder.close()
    assert not overdue and swept == 0
    stored = Turn.objects.get(pk=turn.pk)
    assert (stored.created_at, stored.dispatched_at) == (turn.created_at, turn.dispatched_at)  # the 202 says what is stored
    assert (stored.dispatched_at - began).total_seconds() >= 0.7


def test_a_claim_that_waited_for_the_session_lock_starts_its_turn_after_the_wait(user):
    """The claim's ``started_at`` (and its user row's time) is the claim statement's clock, after its locks:
    a claim that waited while the turn before it was finalized started, by its row, before that turn had
    finished (else ``make faults`` broker-restart reads "turns #8 and #9 overlapped or ran out of order")."""
    session = SessionFactory(owner=user, last_turn_seq=1)
    turn = TurnFactory(session=session, seq=1, status=Turn.Status.QUEUED, input="hi")
    holder = psycopg.Connection.connect(**connection_params("test-lock-holder"))
    try:
        holder.execute(f'SELECT 1 FROM {Session._meta.db_table} WHERE id = %s FOR UPDATE', [session.pk])
        released: list = []
        threading.Timer(0.5, lambda: (released.append(timezone.now()), holder.commit())).start()
        claim = services.turn_claim(turn_id=turn.pk)
    finally:
        time.sleep(0.1)
        holder.close()
    assert claim is not None
    stored = Turn.objects.get(pk=turn.pk)
    assert stored.started_at >= released[0]
    user_row = stored.messages.get(role="user")
    assert user_row.created_at == stored.started_at
