"""The admin stays fast on long sessions: the session page and the message search run a fixed number
of bounded queries whatever the transcript's length, page by keyset (no OFFSET, no COUNT), and the
sessions list never counts a whole big table."""
from __future__ import annotations

import re

import pytest
from django.contrib.admin.utils import quote
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from hermes_sessions import selectors
from hermes_sessions.admin.pagination import EstimatedCountPaginator
from hermes_sessions.models import Message
from tests.factories import CodexBindingFactory, NoticeFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db

MESSAGES = Message._meta.db_table
BIG = 3_000


def load_messages(session_id: str, count: int) -> None:
    """``count`` rows in one INSERT … SELECT generate_series; every 100th mentions "needle"."""
    with connection.cursor() as cur:
        cur.execute(
            f"""INSERT INTO {MESSAGES} (session_id, seq, turn_id, role, content, tool_calls, tool_call_id,
                                         reasoning, codex_item_id, created_at)
                SELECT %s, g, NULL, CASE WHEN g %% 2 = 1 THEN 'user' ELSE 'assistant' END,
                       'row ' || g || CASE WHEN g %% 100 = 0 THEN ' needle' ELSE ' hay' END, NULL, '', '', '', now()
                FROM generate_series(1, %s) AS g""",
            [session_id, count],
        )
        cur.execute("UPDATE hermes_sessions_session SET last_message_seq = %s WHERE id = %s", [count, session_id])


def dressed_session(session_id: str, messages: int):
    session = SessionFactory(id=session_id)
    load_messages(session_id, messages)
    for seq in range(1, 4):
        TurnFactory(session=session, seq=seq, status="succeeded", usage={"total_tokens": 10})
    CodexBindingFactory(session=session, status="ended", ended_reason="codex could not resume the thread: gone")
    CodexBindingFactory(session=session)
    NoticeFactory(session=session)
    return session


def page_url(session_id: str, query: str = "") -> str:
    return reverse("admin:hermes_sessions_session_change", args=[quote(session_id)]) + query


def captured(client, url: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    return response.content.decode(), [q["sql"] for q in ctx.captured_queries]


def message_queries_are_bounded(queries: list[str]) -> None:
    """No COUNT over messages, and every read of the messages table is narrowed (WHERE) and LIMITed."""
    for sql in queries:
        if f'FROM "{MESSAGES}"' in sql:
            assert "COUNT(" not in sql.upper(), sql
            assert " WHERE " in sql and re.search(r"LIMIT \d+", sql), sql


@pytest.mark.parametrize("query", ["", "?before=1500", "?q=needle"])
def test_session_page_queries_do_not_grow_with_the_transcript(admin_client, query):
    dressed_session("small", 20)
    dressed_session("big", BIG)
    captured(admin_client, page_url("small", query))  # warm the per-process caches (content types, permissions)
    _, small = captured(admin_client, page_url("small", query))
    html, big = captured(admin_client, page_url("big", query))
    assert len(big) == len(small) <= 25
    message_queries_are_bounded(big)
    rows = re.findall(r'class="transcript-row role-\w+" data-seq="(\d+)"', html)
    assert 0 < len(rows) <= selectors.TRANSCRIPT_PAGE_ROWS


def test_transcript_pages_newest_first_by_keyset(admin_client):
    dressed_session("big", BIG)
    html, _ = captured(admin_client, page_url("big"))
    seqs = [int(s) for s in re.findall(r'data-seq="(\d+)"', html)]
    assert seqs == list(range(BIG, BIG - 50, -1))
    older = re.search(r'id="transcript-older" href="\?before=(\d+)"', html)
    assert older and int(older.group(1)) == BIG - 49
    html, _ = captured(admin_client, page_url("big", f"?before={older.group(1)}"))
    assert [int(s) for s in re.findall(r'data-seq="(\d+)"', html)][:2] == [BIG - 50, BIG - 51]
    # The oldest page has no "older" link.
    html, _ = captured(admin_client, page_url("big", "?before=30"))
    assert [int(s) for s in re.findall(r'data-seq="(\d+)"', html)] == list(range(29, 0, -1))
    assert 'id="transcript-older"' not in html
    # Junk keyset values are ignored, not a 500.
    assert admin_client.get(page_url("big", "?before=abc")).status_code == 200
    assert admin_client.get(page_url("big", "?before=" + "9" * 40)).status_code == 200


def test_transcript_search_on_the_session_page(admin_client):
    dressed_session("big", BIG)
    html, _ = captured(admin_client, page_url("big", "?q=needle"))
    seqs = [int(s) for s in re.findall(r'data-seq="(\d+)"', html)]
    assert seqs == list(range(BIG, 0, -100))[:50] == list(range(3000, 0, -100))
    assert 'id="transcript-q" value="needle"' in html
    html, _ = captured(admin_client, page_url("big", "?q=" + "x" * 201))
    assert 'id="transcript-search-error"' in html and "limit is 200" in html


def test_message_search_page_is_keyset_paged_without_counts(admin_client):
    dressed_session("big", BIG)
    dressed_session("small", 200)
    url = reverse("admin:hermes_sessions_message_changelist")
    assert 'id="message-q"' in admin_client.get(url).content.decode()  # the form alone: no query of messages
    html, queries = captured(admin_client, url + "?q=needle")
    message_queries_are_bounded(queries)
    found = re.findall(r'<a href="/admin/hermes_sessions/session/(\w+)/change/\?q=needle">\w+</a></td>\s*<td>(\d+)</td>', html)
    assert len(found) == 32  # 30 in the big session, 2 in the small one (created later: first)
    assert found[:2] == [("small", "200"), ("small", "100")] and found[2] == ("big", "3000")
    assert 'id="message-older"' not in html
    html, _ = captured(admin_client, url + "?q=hay")
    older = re.search(r'id="message-older" href="\?q=hay&amp;before=(\d+)"', html)
    assert older
    html2, _ = captured(admin_client, url + f"?q=hay&before={older.group(1)}")
    assert html2.count('class="message-result"') == 50
    assert "limit is 200" in admin_client.get(url + "?q=" + "y" * 300).content.decode()


def test_sessions_list_estimates_instead_of_counting_a_big_table(admin_client, monkeypatch):
    for n in range(30):
        SessionFactory(id=f"many-{n:02d}")
    with connection.cursor() as cur:
        cur.execute("ANALYZE hermes_sessions_session")
    monkeypatch.setattr(EstimatedCountPaginator, "exact_below", 10)  # 30 sessions count as "big" here
    html, queries = captured(admin_client, reverse("admin:hermes_sessions_session_changelist"))
    counts = [sql for sql in queries if "COUNT(" in sql.upper()]
    assert all(" WHERE " in sql for sql in counts), counts
    assert html.count('class="action-select"') == 30  # every row shown, none cut by the estimate
    # A search is a filtered list: counted exactly.
    response = admin_client.get(reverse("admin:hermes_sessions_session_changelist") + "?q=many-1")
    assert response.context["cl"].result_count == 10
