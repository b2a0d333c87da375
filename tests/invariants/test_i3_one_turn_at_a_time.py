"""I3 — one turn at a time per session, in the order accepted, with no transaction or row lock held
while codex works."""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from hermes_sessions import services
from hermes_sessions.models import Message, Session, Turn
from tests.support.dispatch import hold_dispatches

from .conftest import queue_turn


@pytest.mark.django_db
def test_claim_refuses_a_second_turn_while_one_runs(user, turn_outcome):
    session = services.session_create(owner=user)
    first = queue_turn(session=session, text="one", user=user)
    second = queue_turn(session=session, text="two", user=user)
    claim = services.turn_claim(turn_id=first.id)
    assert claim is not None

    assert services.turn_claim(turn_id=second.id) is None

    second.refresh_from_db()
    assert (second.status, second.claim_token) == (Turn.Status.QUEUED, None)
    assert not Message.objects.filter(turn=second).exists()
    # Once the first has ended, the second may run.
    services.turn_finalize(turn_id=first.id, token=claim.token, result=turn_outcome(status="completed"))
    assert services.turn_claim(turn_id=second.id) is not None


@pytest.mark.django_db
def test_claim_refuses_a_later_turn_while_an_earlier_one_is_queued(user):
    session = services.session_create(owner=user)
    first = queue_turn(session=session, text="one", user=user)
    second = queue_turn(session=session, text="two", user=user)

    assert services.turn_claim(turn_id=second.id) is None  # delivered first, but accepted second

    second.refresh_from_db()
    assert second.status == Turn.Status.QUEUED
    assert services.turn_claim(turn_id=first.id) is not None
    assert list(Message.objects.filter(session=session).values_list("content", flat=True)) == ["one"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(30)
def test_no_row_lock_is_held_while_codex_works(user, scripted_codex, run_turn_now, settings):
    """While codex runs the turn, another connection can lock the session and the turn at once
    (NOWAIT); then it cancels the turn, which ends it."""
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    settings.CODEX_TURN_TIMEOUT = 3.0  # the cancel below ends the turn long before this
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})
    probe: dict = {}

    def lock_while_running():
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                running = Turn.objects.filter(session=session, status=Turn.Status.RUNNING).first()
                if running and "turn/start" in [c["method"] for c in scripted_codex.calls()]:
                    # The heartbeat's one-statement UPDATE holds the turn row for a moment every
                    # 0.1 s; a lock held while codex works would refuse every one of these tries.
                    for _ in range(10):
                        try:
                            with transaction.atomic():
                                Session.objects.select_for_update(nowait=True).get(pk=session.pk)
                                Turn.objects.select_for_update(nowait=True).get(pk=running.pk)
                            probe.pop("error", None)
                            probe["locked"] = True
                            break
                        except Exception as exc:  # noqa: BLE001 — recorded for the assertion below
                            probe["error"] = repr(exc)
                            time.sleep(0.03)
                    services.turn_cancel(turn=running)
                    return
                time.sleep(0.02)
        finally:
            connection.close()

    prober = threading.Thread(target=lock_while_running)
    prober.start()
    turn = run_turn_now(session=session, text="hello", user=user)
    prober.join()
    assert probe == {"locked": True}
    assert turn.status == Turn.Status.CANCELLED, turn.error


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(20)
def test_the_claim_lock_holds_the_session_row(user, monkeypatch):
    """Claims, ends and enqueues of one session serialize on the session row: while a worker's
    transaction holds ``lock_session_and_turn``, nobody else can lock that session row."""
    from hermes_sessions.services.locks import lock_session_and_turn

    hold_dispatches(monkeypatch)  # the enqueue commits here: its task would run the turn at once (eager Celery)
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="one", user=user)
    locked, release = threading.Event(), threading.Event()

    def worker() -> None:
        try:
            with transaction.atomic():
                assert lock_session_and_turn(turn.id) is not None
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=worker)
    holder.start()
    try:
        assert locked.wait(10)
        with pytest.raises(Exception, match="could not obtain lock"):  # noqa: B017 — psycopg's LockNotAvailable, wrapped
            with transaction.atomic():
                Session.objects.select_for_update(nowait=True).get(pk=session.pk)
    finally:
        release.set()
        holder.join()
