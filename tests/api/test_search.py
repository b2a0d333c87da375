"""REST API message search: ``?q=`` on a session's messages and ``GET /api/messages/?q=`` across the
caller's sessions (PostgreSQL full-text search, web-search syntax, newest first, keyset cursor)."""
from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from rest_framework.test import APIClient

from hermes_sessions import selectors
from hermes_sessions.models import Message
from tests.factories import MessageFactory, SessionFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def session(user):
    s = SessionFactory(owner=user, id="search-mine")
    texts = ["the deploy failed on host alpha", "rollback of the deploy done", "unrelated chatter",
             "Deploying again: failed twice", "alpha and beta hosts are fine"]
    for seq, text in enumerate(texts, start=1):
        MessageFactory(session=s, seq=seq, content=text)
    return s


def seqs(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [row["seq"] for row in response.json()["results"]]


def test_session_search_finds_words_newest_first(client, session):
    assert seqs(client.get(f"/api/sessions/{session.id}/messages/", {"q": "deploy"})) == [2, 1]
    # 'simple' configuration: no stemming, so "deploying" is its own word; case does not matter.
    assert seqs(client.get(f"/api/sessions/{session.id}/messages/", {"q": "DEPLOYING"})) == [4]


def test_session_search_speaks_web_search_syntax(client, session):
    url = f"/api/sessions/{session.id}/messages/"
    assert seqs(client.get(url, {"q": "deploy failed"})) == [1]  # words are ANDed
    assert seqs(client.get(url, {"q": '"of the deploy"'})) == [2]  # a phrase
    assert seqs(client.get(url, {"q": "rollback or chatter"})) == [3, 2]
    assert seqs(client.get(url, {"q": "alpha -beta"})) == [1]
    assert seqs(client.get(url, {"q": "nothing-like-this"})) == []


def test_session_search_pages_by_keyset_cursor(client, user):
    s = SessionFactory(owner=user)
    Message.objects.bulk_create(
        [Message(session=s, seq=n, role="user", content=f"needle {n}" if n % 2 else f"hay {n}") for n in range(1, 41)]
    )
    url, found = f"/api/sessions/{s.id}/messages/?q=needle&page_size=7", []
    while url:
        body = client.get(url).json()
        found += [row["seq"] for row in body["results"]]
        url = body["next"] and "{0.path}?{0.query}".format(urlsplit(body["next"]))
    assert found == list(range(39, 0, -2))
    # Without q the transcript is still in seq order.
    assert seqs(client.get(f"/api/sessions/{s.id}/messages/?page_size=3")) == [1, 2, 3]


@pytest.mark.parametrize("q", ["", "   ", "x" * (selectors.MAX_SEARCH_CHARS + 1), " " * 200 + "x"])
def test_bad_search_text_is_a_json_400(client, session, q):
    for url in (f"/api/sessions/{session.id}/messages/", "/api/messages/"):
        response = client.get(url, {"q": q})
        assert response.status_code == 400
        body = response.json()
        assert body["code"] == "invalid_search"
        assert "q " in body["detail"]


def test_search_across_sessions_needs_q(client):
    response = client.get("/api/messages/")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_search"


def test_search_across_sessions_sees_only_the_callers(client, user, session):
    other = SessionFactory(owner=UserFactory(), id="search-theirs")
    MessageFactory(session=other, seq=1, content="deploy secrets of someone else")
    second = SessionFactory(owner=user, id="search-mine-2")
    MessageFactory(session=second, seq=1, content="the deploy of session two")
    response = client.get("/api/messages/", {"q": "deploy"})
    assert response.status_code == 200
    rows = [(r["session"], r["seq"]) for r in response.json()["results"]]
    assert rows == [("search-mine-2", 1), ("search-mine", 2), ("search-mine", 1)]
    assert all("someone else" not in r["content"] for r in response.json()["results"])


def test_search_of_someone_elses_session_is_404(client):
    other = SessionFactory(owner=UserFactory())
    MessageFactory(session=other, seq=1, content="hidden words")
    assert client.get(f"/api/sessions/{other.id}/messages/", {"q": "hidden"}).status_code == 404


def test_search_needs_authentication():
    assert APIClient().get("/api/messages/", {"q": "x"}).status_code in (401, 403)


def test_search_across_sessions_pages_newest_first(client, user):
    sessions = [SessionFactory(owner=user) for _ in range(3)]
    for n in range(12):
        MessageFactory(session=sessions[n % 3], seq=n + 1, content=f"common word {n}")
    ids = []
    url = "/api/messages/?q=common&page_size=5"
    while url:
        body = client.get(url).json()
        ids += [(r["session"], r["seq"]) for r in body["results"]]
        url = body["next"] and "{0.path}?{0.query}".format(urlsplit(body["next"]))
    expected = [(sessions[n % 3].id, n + 1) for n in range(11, -1, -1)]
    assert ids == expected


def test_schema_documents_search():
    api = APIClient()
    api.force_authenticate(UserFactory())
    paths = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    search = paths["/api/messages/"]["get"]
    assert [p["name"] for p in search["parameters"] if p["in"] == "query" and p["name"] == "q"] == ["q"]
    q = next(p for p in search["parameters"] if p["name"] == "q")
    assert q["required"] is True
    assert q["schema"] == {"type": "string", "minLength": 1, "maxLength": selectors.MAX_SEARCH_CHARS, "pattern": r"^[^\x00]*[^\s\x00][^\x00]*$"}
    assert "400" in search["responses"]
    transcript = paths["/api/sessions/{session_id}/messages/"]["get"]
    assert any(p["name"] == "q" and not p.get("required") for p in transcript["parameters"])
    assert "400" in transcript["responses"]


def test_search_uses_the_gin_index_expression(session):
    """The filter's SQL is the index's expression, so PostgreSQL can use ``message_content_search``."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SET enable_seqscan = off")
        plan = selectors.message_search_filter(Message.objects.all(), "deploy").explain()
        cur.execute("RESET enable_seqscan")
    assert "message_content_search" in plan


def test_a_cursor_the_server_did_not_make_is_the_documented_404_across_sessions(client):
    """schemathesis found it: ``GET /api/messages/?q=0&cursor=%C2%84`` answered an undocumented 404."""
    response = client.get("/api/messages/?q=0&cursor=%C2%84")
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"
    schema = client.get("/api/schema/?format=json").json()
    assert "404" in schema["paths"]["/api/messages/"]["get"]["responses"]


@pytest.mark.parametrize("q", ["-" * 40, "- " * 90 + "a"])
def test_a_query_postgresql_cannot_parse_is_a_json_400_not_a_500(client, session, q):
    """33+ dashes make PostgreSQL answer 'tsquery stack too small': a JSON 400, not a 500."""
    for url in (f"/api/sessions/{session.id}/messages/", "/api/messages/"):
        response = client.get(url, {"q": q})
        assert response.status_code == 400, url
        assert response.json()["code"] == "invalid_search"
        assert "tsquery" in response.json()["detail"]
