"""One lock order for turn events (``docs/contract.md`` §8, I3): the worker's event batch takes the
session row before the turn row, like ``lock_session_and_turn``. Before, a batch held the turn's share
lock and the session's advisory lock and then waited (its insert's foreign-key check) for the session
row that a post or cancel held ``FOR UPDATE`` while waiting for the turn row or the advisory lock:
PostgreSQL's ``deadlock detected`` — POST turn / cancel answered 500, or the batch was lost.

Each test interleaves two real connections in the order that deadlocked: the batch has taken its locks
and written its rows (on PostgreSQL one statement, ``queries.sql``: ``events_append_claimed``) and has not committed yet
(its foreign-key checks run at commit), the API write starts and blocks on a lock, then the batch goes on."""
import threading
import time
from unittest import mock

import pytest
from django.db import connection, transaction

from hermes_sessions import services
from hermes_sessions.models import Session, Turn, TurnEvent
from hermes_sessions.services import events
from tests.support.dispatch import claimed_with_writer

pytestmark = pytest.mark.django_db(transaction=True)  # two threads, two connections


def _someone_waits_on_a_lock(timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:  # autocommit: a fresh pg_stat_activity each time
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.02)
    return False


def _interleave(user, monkeypatch, api_write):
    session, turn, claim, writer = claimed_with_writer(user, monkeypatch, "a long streaming turn")
    at_insert, go, errors = threading.Event(), threading.Event(), []
    real_insert = events._insert_events

    def paused_insert(*args, **kwargs):  # the batch holds its locks here, before its commit
        written = real_insert(*args, **kwargs)
        at_insert.set()
        go.wait(10)
        return written

    def run(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            errors.append(exc)
        finally:
            connection.close()

    with mock.patch.object(events, "_insert_events", paused_insert):
        worker = threading.Thread(target=run, args=(lambda: (writer.add(events.DELTA, {"item_id": "m", "text": "hel"}),
                                                             writer.flush()),))
        worker.start()
        assert at_insert.wait(10)
        api = threading.Thread(target=run, args=(lambda: api_write(session, turn),))
        api.start()
        blocked = _someone_waits_on_a_lock()
        go.set()
        worker.join(20)
        api.join(20)
    assert blocked and not worker.is_alive() and not api.is_alive()
    assert errors == []
    assert writer.written == 1 and not writer.fenced  # the batch was not lost to a deadlock
    return session, turn


def test_a_cancel_during_an_event_batch_does_not_deadlock(user, monkeypatch):
    _, turn = _interleave(user, monkeypatch, lambda session, turn: services.turn_cancel(turn=turn))
    turn.refresh_from_db()
    assert turn.status == Turn.Status.RUNNING and turn.cancel_requested_at is not None
    assert list(TurnEvent.objects.filter(turn=turn).order_by("id").values_list("kind", flat=True)) == [
        "queued", "running", "delta"]


def test_a_post_during_an_event_batch_does_not_deadlock(user, monkeypatch):
    session, turn = _interleave(user, monkeypatch, lambda session, turn: services.turn_enqueue(
        session=session, input_text="next", user=user))
    kinds = list(TurnEvent.objects.filter(session=session).order_by("id").values_list("kind", flat=True))
    assert kinds == ["queued", "running", "delta", "queued"]  # ids in commit order (§8)


def test_a_batch_waiting_for_the_session_row_holds_no_lock_of_the_turn_row(user, monkeypatch):
    """The other interleaving: the API holds the session row first; the batch must wait for it before it
    touches the turn row, so the API can still lock the turn row (a batch that took the turn's share lock
    first would make this a deadlock, or the API's lock wait time out)."""
    session, turn, claim, writer = claimed_with_writer(user, monkeypatch, "a long streaming turn")
    errors = []

    def batch():
        try:
            writer.add(events.DELTA, {"item_id": "m", "text": "hel"})
            writer.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            errors.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=batch)
    with transaction.atomic():
        Session.objects.select_for_update().get(pk=session.pk)
        worker.start()
        waiting, deadline = False, time.monotonic() + 5
        while not waiting and time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_stat_clear_snapshot()")  # a fresh pg_stat_activity inside this transaction
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
                waiting = bool(cursor.fetchone()[0])
            time.sleep(0.02)
        assert waiting
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '2s'")
        Turn.objects.select_for_update().get(pk=turn.pk)  # not held by the waiting batch
    worker.join(20)
    assert not worker.is_alive() and errors == []
    assert writer.written == 1 and not writer.fenced
