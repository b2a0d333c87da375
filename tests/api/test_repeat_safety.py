"""REST API: Idempotency-Key, on_busy double-texting policies, cancel."""
from __future__ import annotations

import json
import threading

import pytest
from django.db import connection
from rest_framework.test import APIClient

from hermes_sessions.models import IdempotencyKey, Session, Turn
from tests.factories import SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_codex(dispatched):
    """Record dispatches instead of running codex (``dispatched`` in tests/api/conftest.py)."""


def post(client, path, body, key=None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return client.post(path, data=json.dumps(body), content_type="application/json", **headers)


def test_same_key_same_body_returns_the_same_session(client):
    first = post(client, "/api/sessions/", {"title": "a"}, key="k1")
    again = post(client, "/api/sessions/", {"title": "a"}, key="k1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert Session.objects.count() == 1


def test_same_key_different_body_is_422(client):
    assert post(client, "/api/sessions/", {"title": "a"}, key="k1").status_code == 201
    resp = post(client, "/api/sessions/", {"title": "b"}, key="k1")
    assert resp.status_code == 422
    assert resp.json()["code"] == "idempotency_key_reused"
    assert Session.objects.count() == 1


def test_keys_are_scoped_per_user(client):
    other = APIClient()
    other.force_authenticate(UserFactory())
    a = post(client, "/api/sessions/", {"title": "a"}, key="shared")
    b = post(other, "/api/sessions/", {"title": "a"}, key="shared")
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["id"] != b.json()["id"]


def test_turn_post_with_a_key_queues_one_turn_and_dispatches_once(client, user, dispatched, django_capture_on_commit_callbacks):
    session = SessionFactory(owner=user)
    path = f"/api/sessions/{session.id}/turns/"
    with django_capture_on_commit_callbacks(execute=True):
        first = post(client, path, {"input": "hi"}, key="t1")
        again = post(client, path, {"input": "hi"}, key="t1")
    assert (first.status_code, again.status_code) == (202, 202)
    assert first.json()["id"] == again.json()["id"]
    assert Turn.objects.filter(session=session).count() == 1
    assert dispatched == [first.json()["id"]]
    assert post(client, path, {"input": "other"}, key="t1").status_code == 422


def test_a_malformed_key_is_400(client):
    assert post(client, "/api/sessions/", {}, key="x" * 300).status_code == 400
    assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_with_one_key_create_exactly_one_turn(user):
    session = SessionFactory(owner=user)
    results = []

    def fire():
        api = APIClient()
        api.force_authenticate(user)
        results.append(post(api, f"/api/sessions/{session.id}/turns/", {"input": "same"}, key="race"))
        connection.close()

    threads = [threading.Thread(target=fire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [202] * 8
    assert len({r.json()["id"] for r in results}) == 1
    assert Turn.objects.filter(session=session).count() == 1


def test_on_busy_reject_is_409_naming_the_running_turn(client, user):
    session = SessionFactory(owner=user)
    running = TurnFactory(session=session, seq=1, status=Turn.Status.RUNNING)
    session.last_turn_seq = 1
    session.save()
    resp = post(client, f"/api/sessions/{session.id}/turns/", {"input": "again", "on_busy": "reject"})
    assert resp.status_code == 409
    assert resp.json()["code"] == "session_busy" and resp.json()["turn"] == str(running.id)
    assert post(client, f"/api/sessions/{session.id}/turns/", {"input": "x", "on_busy": "sideways"}).status_code == 400


def test_on_busy_interrupt_marks_the_running_turn_and_queues(client, user):
    session = SessionFactory(owner=user)
    running = TurnFactory(session=session, seq=1, status=Turn.Status.RUNNING)
    session.last_turn_seq = 1
    session.save()
    resp = post(client, f"/api/sessions/{session.id}/turns/", {"input": "now this", "on_busy": "interrupt"})
    assert resp.status_code == 202 and resp.json()["status"] == "queued"
    running.refresh_from_db()
    assert running.cancel_requested_at is not None


def test_cancel_endpoint(client, user):
    session = SessionFactory(owner=user)
    queued = TurnFactory(session=session, seq=1, status=Turn.Status.QUEUED)
    resp = client.post(f"/api/turns/{queued.id}/cancel/")
    assert resp.status_code == 202 and resp.json()["status"] == "cancelled"
    other = APIClient()
    other.force_authenticate(UserFactory())
    assert other.post(f"/api/turns/{queued.id}/cancel/").status_code == 404
    assert client.post("/api/turns/not-a-uuid/cancel/").status_code == 404
    again = client.post(f"/api/turns/{queued.id}/cancel/")
    assert again.status_code == 409 and again.json()["code"] == "turn_finished"
    assert again.json()["turn"]["status"] == "cancelled"


@pytest.mark.parametrize("key", ["über-1", "ключ", "emoji-\U0001F600", "tab\tkey", "x" * 256])
def test_idempotency_keys_are_printable_ascii(client, key):
    resp = client.post("/api/sessions/", data="{}", content_type="application/json",
                       HTTP_IDEMPOTENCY_KEY=key.encode("utf-8").decode("latin-1"))
    assert resp.status_code == 400
    assert resp.json()["field"] == "Idempotency-Key"
