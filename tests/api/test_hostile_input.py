"""Hostile input never reaches a 500 (I6): nesting bombs, forged cursors, NUL in URLs, wrong types."""
import json

import pytest
from kombu.exceptions import OperationalError

from hermes_sessions import tasks, worker
from hermes_sessions.models import Turn
from tests.factories import SessionFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/api/sessions/", "/api/sessions/s1/turns/"])
def test_deeply_nested_json_is_400(client, user, path):
    SessionFactory(owner=user, id="s1")
    body = '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"
    resp = client.post(path, data=body, content_type="application/json")
    assert resp.status_code == 400
    assert "nested too deeply" in resp.json()["detail"]


def test_forged_cursor_is_404_not_500(client, user):
    SessionFactory(owner=user, id="s1")
    resp = client.get("/api/sessions/s1/messages/?cursor=cD1hYmM=")  # base64 of "p=abc"
    assert resp.status_code == 404


@pytest.mark.parametrize("url", [
    "/api/sessions/?page=%00",
    "/api/sessions/s1/messages/?cursor=%00",
    "/admin/hermes_sessions/turn/?status__exact=%00",
    "/admin/hermes_sessions/notice/?kind__exact=%00",
])
def test_nul_in_the_query_string_is_400(admin_client, client, user, url):
    SessionFactory(owner=user, id="s1")
    who = admin_client if url.startswith("/admin/") else client
    assert who.get(url).status_code == 400


def test_non_string_title_is_400(client):
    resp = client.post("/api/sessions/", data=json.dumps({"title": 42}), content_type="application/json")
    assert resp.status_code == 400


def test_broker_down_still_accepts_the_turn_and_the_sweep_resends_it(client, user, monkeypatch, settings,
                                                                     django_capture_on_commit_callbacks):
    session = SessionFactory(owner=user, id="s1")

    def broker_down(*args, **kwargs):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")

    monkeypatch.setattr(tasks.run_turn, "apply_async", broker_down)
    with django_capture_on_commit_callbacks(execute=True):
        resp = client.post("/api/sessions/s1/turns/", data=json.dumps({"input": "hi"}), content_type="application/json")
    assert resp.status_code == 202
    turn = Turn.objects.get(pk=resp.json()["id"], session=session)
    assert turn.status == Turn.Status.QUEUED  # durable: nothing lost, nothing half-written

    sent = []
    monkeypatch.setattr(tasks.run_turn, "apply_async", lambda *a, **k: sent.append(k["args"][0]))
    settings.HERMES_REDISPATCH_SECONDS = 0
    with django_capture_on_commit_callbacks(execute=True):
        assert worker.turns_sweep().redispatched == 1
    assert sent == [str(turn.id)]


@pytest.mark.parametrize("failure", [
    # 60 POSTs waiting on a held session lock can take every pooled connection; the rest of the
    # process's requests then get psycopg_pool's timeout, which must not be a 500.
    lambda: __import__("psycopg_pool").PoolTimeout("couldn't get a connection after 10.00 sec"),
    lambda: __import__("django.db", fromlist=["OperationalError"]).OperationalError(
        "terminating connection due to administrator command"),
])
def test_a_database_that_cannot_serve_the_request_is_503_with_retry_after_not_500(client, user, monkeypatch, failure):
    session = SessionFactory(owner=user)

    def unavailable(**kwargs):
        raise failure()

    monkeypatch.setattr("hermes_sessions.selectors.session_owned", unavailable)
    monkeypatch.setattr("hermes_sessions.services.turn_enqueue", unavailable)  # the POST's first query is its own
    for method, path, body in [("post", f"/api/sessions/{session.id}/turns/", {"input": "hi"}),
                               ("get", f"/api/sessions/{session.id}/messages/", None)]:
        response = getattr(client, method)(path, body, format="json") if body else getattr(client, method)(path)
        assert response.status_code == 503, response.content
        assert response.json()["code"] == "database_unavailable" and response["Retry-After"] == "1"
    assert not Turn.objects.filter(session=session).exists()


def test_an_integrity_bug_is_still_a_500_not_hidden_as_503(client, user, monkeypatch):
    """Only the database being unavailable is a 503; a data error stays a bug to see."""
    from django.db import DataError

    session = SessionFactory(owner=user)

    def broken(**kwargs):
        raise DataError("value too long for type character varying(64)")

    monkeypatch.setattr("hermes_sessions.selectors.session_owned", broken)
    monkeypatch.setattr("hermes_sessions.services.turn_enqueue", broken)
    client.raise_request_exception = False
    assert client.post(f"/api/sessions/{session.id}/turns/", {"input": "hi"}, format="json").status_code == 500


@pytest.mark.parametrize(("path", "body"), [
    ("/api/sessions/s1/turns/", '{"input": "x", "on_busy": "\\ud800"}'),
    ("/api/sessions/s1/turns/", '{"input": "x", "on_busy": "\\udfff"}'),
    ("/api/sessions/", '{"model_config": {"\\ud800": 1}}'),
    ("/api/sessions/", '{"model_config": {"model": 1, "\\udfff\\ud800": "\\ud800"}}'),
    ("/api/sessions/", '{"model_config": {"sandbox": "\\ud800"}}'),
    ("/api/sessions/", '{"id": "\\ud800"}'),
    ("/api/sessions/", '{"\\ud800": 1, "title": "\\ud800"}'),
])
def test_a_lone_surrogate_quoted_back_in_a_400_is_u_fffd_not_a_500(client, user, path, body):
    """A 400 whose message quotes a lone surrogate the client sent would be a 500 (UnicodeEncodeError
    in DRF's JSON renderer); api/renderers.py renders it as U+FFFD."""
    SessionFactory(owner=user, id="s1")
    resp = client.post(path, data=body.encode(), content_type="application/json")
    assert resp.status_code in (201, 400), resp.content
    text = resp.content.decode("utf-8")  # valid UTF-8 throughout
    if resp.status_code == 400:
        assert resp.json()["code"] in ("invalid", "invalid_setting", "invalid_input"), text
    assert "\ud800" not in text and "\udfff" not in text
