"""I6 — bad input gets a clear 4xx (or is stored safely) and never leaves a half-written turn."""
from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from hermes_sessions import services
from hermes_sessions.models import IdempotencyKey, Message, Session, Turn
from tests.factories import SessionFactory, UserFactory
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(monkeypatch):
    hold_dispatches(monkeypatch)
    owner = UserFactory()
    client = APIClient()
    client.force_authenticate(owner)
    return client, SessionFactory(owner=owner, id="s-bad-input")


def nothing_written():
    return not Turn.objects.exists() and not Message.objects.exists() and not IdempotencyKey.objects.exists()


def post_turn(client, url, body: str, **headers):
    return client.post(url, data=body, content_type="application/json", **headers)


@pytest.mark.parametrize("body,expected", [
    pytest.param(json.dumps({"input": "x" * (services.MAX_INPUT_CHARS + 1)}), "limit", id="input-over-the-limit"),
    pytest.param('{"input": "unterminated', "JSON parse error", id="malformed-json"),
    pytest.param(json.dumps({"input": " \n\t "}), "non-empty", id="blank"),
    pytest.param(json.dumps({"input": "hi", "on_busy": "sideways"}), "", id="unknown-on-busy"),
])
def test_bad_turn_input_is_400_and_writes_nothing(api, body, expected):
    client, session = api
    response = post_turn(client, f"/api/sessions/{session.id}/turns/", body, HTTP_IDEMPOTENCY_KEY="k1")
    assert response.status_code == 400, response.content
    assert expected in response.json()["detail"]
    assert nothing_written()


def test_the_service_refuses_input_over_the_limit_and_writes_nothing(api):
    """``turn_enqueue`` itself refuses an input over ``MAX_INPUT_CHARS``, whatever its caller checked
    before (the API's serializer refuses it first: the test above); one at the limit is queued."""
    client, session = api
    with pytest.raises(services.InvalidInput, match="limit"):
        services.turn_enqueue(session=session, input_text="x" * (services.MAX_INPUT_CHARS + 1), user=session.owner)
    assert nothing_written()
    turn = services.turn_enqueue(session=session, input_text="x" * services.MAX_INPUT_CHARS, user=session.owner)
    assert len(turn.input) == services.MAX_INPUT_CHARS


def test_an_oversized_body_is_413_and_writes_nothing(api, settings):
    client, session = api
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = post_turn(client, f"/api/sessions/{session.id}/turns/", json.dumps({"input": "x" * 20_000}))
    assert response.status_code == 413
    assert nothing_written()


def test_nul_bytes_in_input_are_stored_replaced_not_a_500(api):
    client, session = api
    response = post_turn(client, f"/api/sessions/{session.id}/turns/", json.dumps({"input": "a\u0000b \ud800"}))
    assert response.status_code == 202, response.content
    assert Turn.objects.get(pk=response.json()["id"]).input == "a\ufffdb \ufffd"


@pytest.mark.parametrize("url", [
    "/api/sessions/s-bad-input%00/turns/",
    "/api/sessions/s-bad-input/turns/?x=%00",
])
def test_nul_bytes_in_the_url_are_400_and_write_nothing(api, url):
    client, _ = api
    assert post_turn(client, url, json.dumps({"input": "hi"})).status_code == 400
    assert nothing_written()


def test_nul_in_an_admin_filter_is_400(admin_client):
    assert admin_client.get("/admin/hermes_sessions/turn/?status__exact=%00").status_code == 400


@pytest.mark.parametrize("session_id", ["a%0A", "x" * 65, "-leading-dash", "a b"])
def test_invalid_session_ids_are_404_and_create_nothing(api, session_id):
    client, _ = api
    response = post_turn(client, f"/api/sessions/{session_id}/turns/", json.dumps({"input": "hi"}))
    assert response.status_code == 404
    assert nothing_written()
    assert Session.objects.count() == 1
