"""One lock order for turn events (``docs/contract.md`` §8, I3): the worker's event batch takes the
session row before the turn row, like ``lock_session_and_turn``. Before, a batch held the turn's share
lock and the session's advisory lock and then waited (its insert's foreign-key check) for the session
row that a post or cancel held ``FOR UPDATE`` while waiting for the turn row or the advisory lock:
PostgreSQL's ``deadlock detected`` — POST turn / cancel answered 500, or the batch was lost.

Each test interleaves two real connections in the order that deadlocked: the batch reaches its insert
holding its locks, the API write starts and blocks on a lock, then the batch goes on."""
import threading
import time
from unittest import mock

import pytest
from django.db import connection

from hermes_sessions import services
from hermes_sessions.models import Turn, TurnEvent
from hermes_sessions.services import events
from hermes_sessions.services.events import TurnEventWriter
from tests.support.dispatch import hold_dispatches

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
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="a long streaming turn", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    writer = TurnEventWriter(turn_id=turn.id, session_id=session.id, token=claim.token, attempt=claim.attempt)
    at_insert, go, errors = threading.Event(), threading.Event(), []
    real_bulk_create = TurnEvent.objects.bulk_create

    def paused_bulk_create(*args, **kwargs):  # the batch holds its locks here
        at_insert.set()
        go.wait(10)
        return real_bulk_create(*args, **kwargs)

    def run(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            errors.append(exc)
        finally:
            connection.close()

    with mock.patch.object(TurnEvent.objects, "bulk_create", paused_bulk_create):
        worker = threading.Thread(target=run, args=(lambda: writer.add(events.DELTA, {"item_id": "m", "text": "hel"}),))
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
