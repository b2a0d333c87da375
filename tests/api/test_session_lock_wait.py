"""A turn's POST behind a long-held session lock (an operator's ``prune_sessions`` of a long session, a
delete): it waits at most ``HERMES_POST_LOCK_TIMEOUT_MS`` and answers 503 ``session_locked`` with
``Retry-After``, writing nothing — instead of holding a pooled connection until the pool gives up and
answering 503 ``database_unavailable`` after 10 s. With an Idempotency-Key too."""
from __future__ import annotations

import json
import time

import psycopg
import pytest
from django.db import connection

from hermes_sessions.models import Turn, TurnEvent
from tests.factories import SessionFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def held_session_lock():
    """Hold a session's row lock from another connection, as a long operator command would."""
    settings = connection.settings_dict
    conns = []

    def hold(session_id: str) -> None:
        conn = psycopg.connect(dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None,
                               host=settings["HOST"] or None, port=settings["PORT"] or None)
        conn.execute('SELECT 1 FROM "hermes_sessions_session" WHERE "id" = %s FOR UPDATE', [session_id])
        conns.append(conn)

    yield hold
    for conn in conns:
        conn.rollback()
        conn.close()


@pytest.mark.parametrize("idempotency_key", [None, "k-1"])
def test_a_post_behind_a_held_session_lock_answers_503_session_locked_soon_and_writes_nothing(
        client, user, dispatched, settings, held_session_lock, idempotency_key):
    settings.HERMES_POST_LOCK_TIMEOUT_MS = 300
    session = SessionFactory(owner=user)
    held_session_lock(session.pk)
    headers = {"HTTP_IDEMPOTENCY_KEY": idempotency_key} if idempotency_key else {}
    t0 = time.monotonic()
    response = client.post(f"/api/sessions/{session.pk}/turns/", data=json.dumps({"input": "hi"}),
                           content_type="application/json", **headers)
    waited = time.monotonic() - t0
    assert response.status_code == 503, response.content
    assert response.json()["code"] == "session_locked" and response["Retry-After"] == "1"
    assert 0.25 <= waited < 3, waited
    assert not Turn.objects.filter(session=session).exists() and not TurnEvent.objects.exists()
    assert dispatched == []


def test_the_same_post_goes_through_once_the_lock_is_released(client, user, dispatched, settings):
    settings.HERMES_POST_LOCK_TIMEOUT_MS = 300
    session = SessionFactory(owner=user)
    response = client.post(f"/api/sessions/{session.pk}/turns/", data=json.dumps({"input": "hi"}),
                           content_type="application/json")
    assert response.status_code == 202, response.content
    # The lock timeout was the enqueue transaction's own (SET LOCAL): nothing after it inherits it.
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"


def test_posts_with_one_idempotency_key_behind_a_held_session_lock_each_answer_within_the_bound(
        user, dispatched, settings, held_session_lock):
    """Such POSTs wait for each other on the key's lock; were that wait unbounded (before any lock timeout
    is set), the n-th would answer after n × 3 s, each holding a pooled connection. Every wait is bounded:
    the one holding the key answers 503 session_locked, the others 409 idempotency_key_in_use (Retry-After)
    or, had it let go already, 503 session_locked themselves."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections
    from rest_framework.test import APIClient

    settings.HERMES_POST_LOCK_TIMEOUT_MS = 500
    session = SessionFactory(owner=user)
    held_session_lock(session.pk)

    def post(_: int) -> tuple[int, str, str | None, float]:
        client = APIClient()
        client.force_authenticate(user)
        t0 = time.monotonic()
        try:
            r = client.post(f"/api/sessions/{session.pk}/turns/", data=json.dumps({"input": "chain"}),
                            content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-chain")
            return r.status_code, r.json()["code"], r.headers.get("Retry-After"), time.monotonic() - t0
        finally:
            connections.close_all()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, range(4)))
    assert {(status, code) for status, code, _, _ in answers} <= {(503, "session_locked"), (409, "idempotency_key_in_use")}
    assert (503, "session_locked") in {(status, code) for status, code, _, _ in answers}
    assert all(retry == "1" for _, _, retry, _ in answers)
    assert max(waited for *_, waited in answers) < 1.2, answers  # the n-th after n × 0.5 s before
    assert not Turn.objects.filter(session=session).exists()
