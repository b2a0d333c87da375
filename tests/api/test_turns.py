"""REST API: sending input (queueing turns), reading turns, bad input never reaching a 500."""
from __future__ import annotations

import json
import uuid

import pytest
from django.utils import timezone

from hermes_sessions import services
from hermes_sessions.models import Message, Session, Turn
from tests.factories import SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def session(user):
    return SessionFactory(owner=user, id="sess-turns")


@pytest.fixture(autouse=True)
def _no_codex(dispatched):
    """Record dispatches instead of running codex (``dispatched`` in tests/api/conftest.py)."""


def post_turn(client, session_id, body, *, raw=None):
    data = raw if raw is not None else json.dumps(body)
    return client.post(f"/api/sessions/{session_id}/turns/", data=data, content_type="application/json")


def test_post_turn_queues_it_and_dispatches_after_commit(client, session, dispatched, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = post_turn(client, session.id, {"input": "hello"})
        assert dispatched == []  # nothing is sent before the turn row commits
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "queued"
    assert body["seq"] == 1
    assert body["session"] == session.id
    turn = Turn.objects.get(pk=body["id"])
    assert turn.input == "hello"
    assert turn.status == Turn.Status.QUEUED
    assert dispatched == [str(turn.id)]


def test_turns_get_consecutive_seqs(client, session):
    assert post_turn(client, session.id, {"input": "one"}).json()["seq"] == 1
    assert post_turn(client, session.id, {"input": "two"}).json()["seq"] == 2


@pytest.mark.parametrize(
    "body",
    [{}, {"input": ""}, {"input": "   \n"}, {"input": None}, {"input": 42}, {"input": ["hi"]}, {"input": {"t": 1}}, ["hi"], "hi"],
)
def test_missing_empty_or_non_string_input_is_400(client, session, body):
    response = post_turn(client, session.id, body)
    assert response.status_code == 400, response.content
    assert response.json()["detail"]
    assert not Turn.objects.exists()


def test_too_long_input_is_400_with_reason(client, session):
    response = post_turn(client, session.id, {"input": "x" * (services.MAX_INPUT_CHARS + 1)})
    assert response.status_code == 400
    assert "limit" in response.json()["detail"]
    assert not Turn.objects.exists()


def test_malformed_json_is_400(client, session):
    response = post_turn(client, session.id, None, raw='{"input": "unterminated')
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]
    assert not Turn.objects.exists()


def test_non_json_body_is_415(client, session):
    response = client.post(f"/api/sessions/{session.id}/turns/", data="input=hi", content_type="text/plain")
    assert response.status_code == 415


@pytest.mark.parametrize("url", ["/api/sessions/sess-turns/turns/", "/api/sessions/"])
def test_body_larger_than_the_limit_is_413(client, session, settings, url):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = post_turn(client, session.id, None, raw=json.dumps({"input": "x" * 2000})) if "turns" in url else (
        client.post(url, data=json.dumps({"title": "x" * 2000}), content_type="application/json")
    )
    assert response.status_code == 413
    assert response.json()["code"] == "request_too_large"
    assert not Turn.objects.exists()
    assert Session.objects.count() == 1


def test_body_just_under_the_limit_is_accepted(client, session, settings):
    raw = json.dumps({"input": "x" * 900})
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = len(raw.encode())
    assert post_turn(client, session.id, None, raw=raw).status_code == 202


def test_nul_byte_and_lone_surrogate_in_input_are_stored_safely(client, session):
    # json.dumps escapes both as \u0000 / \ud800, exactly as a client would send them.
    response = post_turn(client, session.id, {"input": "a\u0000b \ud800 c"})
    assert response.status_code == 202, response.content
    turn = Turn.objects.get(pk=response.json()["id"])
    assert turn.input == "a\ufffdb \ufffd c"


def test_post_turn_to_another_users_session_is_404_and_changes_nothing(client, dispatched):
    """The POST does not read the session first: the enqueue's locking UPDATE checks the owner.
    Someone else's session is neither locked nor counted up, and nothing is sent."""
    other = SessionFactory()
    before = Session.objects.filter(pk=other.pk).values("last_turn_seq", "updated_at").get()
    for body in ({"input": "hi"}, {"input": "hi", "on_busy": "reject"}):
        response = post_turn(client, other.id, body)
        assert (response.status_code, response.json()["code"]) == (404, "not_found")
    assert not Turn.objects.exists() and dispatched == []
    assert Session.objects.filter(pk=other.pk).values("last_turn_seq", "updated_at").get() == before


@pytest.mark.parametrize("session_id", ["nope", "x" * 300, "a/b", "%00"])
def test_post_turn_to_unknown_or_malformed_session_is_404(client, session_id):
    assert post_turn(client, session_id, {"input": "hi"}).status_code in (404, 400)
    if session_id in ("nope", "x" * 300):
        assert post_turn(client, session_id, {"input": "hi"}).status_code == 404


@pytest.mark.parametrize(("body", "raw", "headers"), [
    ({"input": ""}, None, {}),  # invalid input
    (None, "{not json", {}),  # parse error
    ({"input": "hi", "on_busy": "nope"}, None, {}),
    ({"input": "hi"}, None, {"HTTP_IDEMPOTENCY_KEY": "k" * 300}),  # malformed key
])
def test_a_bad_request_to_a_session_the_caller_cannot_see_is_404_first(client, body, raw, headers):
    """As when the session was read first: 404 before 400 for any session not the caller's (I7)."""
    other = SessionFactory()
    for session_id in ("nope", other.id):
        data = raw if raw is not None else json.dumps(body)
        response = client.post(f"/api/sessions/{session_id}/turns/", data=data, content_type="application/json",
                               **headers)
        assert response.status_code == 404, response.content
    mine = SessionFactory(owner=other.owner)  # the same request on a session of one's own: the 400
    client.force_authenticate(other.owner)
    data = raw if raw is not None else json.dumps(body)
    response = client.post(f"/api/sessions/{mine.id}/turns/", data=data, content_type="application/json", **headers)
    assert response.status_code == 400, response.content


def test_turn_detail_shows_fields(client, session):
    now = timezone.now()
    turn = TurnFactory(
        session=session,
        seq=1,
        status=Turn.Status.SUCCEEDED,
        input="what is 2+2",
        thread_action=Turn.ThreadAction.STARTED,
        codex_thread_id="019a-thread",
        codex_turn_id="7",
        final_text="4",
        usage={"total_tokens": 12},
        timings={"run_ms": 105.0},
        started_at=now,
        finished_at=now,
    )
    response = client.get(f"/api/turns/{turn.id}/")
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == str(turn.id)
    assert body["session"] == session.id
    assert body["seq"] == 1
    assert body["status"] == "succeeded"
    assert body["input"] == "what is 2+2"
    assert body["thread_action"] == "started"
    assert body["codex_thread_id"] == "019a-thread"
    assert body["codex_turn_id"] == "7"
    assert body["final_text"] == "4"
    assert body["error"] == ""
    assert body["usage"] == {"total_tokens": 12}
    assert body["timings"] == {"run_ms": 105.0}
    for key in ("created_at", "started_at", "finished_at"):
        assert body[key]


def test_another_users_turn_is_404(client):
    turn = TurnFactory(seq=1)
    assert client.get(f"/api/turns/{turn.id}/").status_code == 404


@pytest.mark.parametrize("turn_id", [str(uuid.uuid4()), "not-a-uuid", "123", "%0A"])
def test_unknown_or_non_uuid_turn_id_is_json_404(client, turn_id):
    response = client.get(f"/api/turns/{turn_id}/")
    assert response.status_code == 404
    assert response.json()["detail"]


def test_queued_turn_writes_no_transcript_rows(client, session):
    post_turn(client, session.id, {"input": "hello"})
    assert not Message.objects.exists()  # the user row is written when a worker claims the turn
