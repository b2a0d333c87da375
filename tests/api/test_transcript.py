"""REST API: the transcript (cursor-paginated by seq) and notices."""
from __future__ import annotations

import random
from urllib.parse import urlsplit

import pytest
from django.utils import timezone

from hermes_sessions.models import Message
from tests.factories import MessageFactory, NoticeFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def session(user):
    return SessionFactory(owner=user)


def follow(client, url):
    """Every row of a paginated list, following ``next`` links; returns (rows, pages)."""
    rows, pages = [], 0
    while url:
        response = client.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        rows.extend(body["results"])
        pages += 1
        url = body["next"]
        if url:
            parts = urlsplit(url)
            url = f"{parts.path}?{parts.query}"
    return rows, pages


def test_messages_come_in_seq_order_across_pages(client, session):
    seqs = list(range(1, 12))
    random.Random(7).shuffle(seqs)  # insertion order must not matter
    for seq in seqs:
        MessageFactory(session=session, seq=seq, content=f"m{seq}")
    MessageFactory(session=SessionFactory(), seq=1, content="someone else's")
    rows, pages = follow(client, f"/api/sessions/{session.id}/messages/?page_size=3")
    assert [row["seq"] for row in rows] == list(range(1, 12))
    assert [row["content"] for row in rows] == [f"m{n}" for n in range(1, 12)]
    assert pages == 4


def test_messages_default_page_is_50_and_page_size_is_capped_at_500(client, session):
    Message.objects.bulk_create(
        [Message(session=session, seq=n, role=Message.Role.USER, content=str(n)) for n in range(1, 503)]
    )
    url = f"/api/sessions/{session.id}/messages/"
    assert len(client.get(url).json()["results"]) == 50
    assert len(client.get(url + "?page_size=1000").json()["results"]) == 500


def test_message_fields(client, session):
    turn = TurnFactory(session=session, seq=1)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]
    MessageFactory(
        session=session, seq=1, turn=turn, role="assistant", content="", tool_calls=calls, reasoning="r", codex_item_id="item_1"
    )
    MessageFactory(session=session, seq=2, turn=turn, role="tool", content="ok", tool_call_id="call_1", codex_item_id="item_1")
    rows = client.get(f"/api/sessions/{session.id}/messages/").json()["results"]
    assert rows[0] == {
        "seq": 1,
        "role": "assistant",
        "content": "",
        "tool_calls": calls,
        "tool_call_id": "",
        "reasoning": "r",
        "codex_item_id": "item_1",
        "turn": str(turn.id),
        "created_at": rows[0]["created_at"],
    }
    assert rows[1]["tool_call_id"] == "call_1"


def test_invalid_cursor_is_404_not_500(client, session):
    response = client.get(f"/api/sessions/{session.id}/messages/?cursor=garbage")
    assert response.status_code == 404


def test_another_users_messages_and_notices_are_404(client):
    other = SessionFactory()
    MessageFactory(session=other, seq=1)
    NoticeFactory(session=other)
    assert client.get(f"/api/sessions/{other.id}/messages/").status_code == 404
    assert client.get(f"/api/sessions/{other.id}/notices/").status_code == 404


def test_notices_list(client, session):
    turn = TurnFactory(session=session, seq=1)
    notice = NoticeFactory(session=session, turn=turn)
    acked = NoticeFactory(session=session, text="older", acknowledged_at=timezone.now())
    NoticeFactory(session=SessionFactory(), text="not mine")
    rows = client.get(f"/api/sessions/{session.id}/notices/").json()["results"]
    assert {row["id"] for row in rows} == {notice.id, acked.id}
    row = next(r for r in rows if r["id"] == notice.id)
    assert row["kind"] == "lifecycle"
    assert row["text"] == "Codex thread could not be resumed; starting a new one."
    assert row["turn"] == str(turn.id)
    assert row["acknowledged_at"] is None
    assert next(r for r in rows if r["id"] == acked.id)["acknowledged_at"]
