"""``make bench-admin``'s pieces with tiny sizes: the bulk seed (in the test database), the pages it
times (through the test client, on the seeded rows), and its figures."""
from __future__ import annotations

import pytest
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from devtools import bench_admin
from devtools.bench_admin import (
    BIG_SESSION,
    SEARCH_WORD,
    SeedSizes,
    drf_cursor,
    pages,
    percentile,
    report,
    seed,
    summarize,
)
from hermes_sessions.models import CodexBinding, Message, Notice, Session, Turn
from tests.factories import UserFactory


@pytest.fixture
def seeded(db, django_user_model):
    admin = django_user_model.objects.create_superuser("bench-admin-test", "a@example.com", "pw")
    owners = [UserFactory().pk for _ in range(3)]
    with connection.cursor() as cur:
        steps = seed(cur, owner_ids=owners, sizes=SeedSizes(sessions=100, per_session=20, big=3_000))
    return admin, owners, steps


def test_seed_makes_the_sizes_asked_for(seeded):
    _, owners, steps = seeded
    assert set(steps) == {"sessions", "messages", "turns", "bindings_notices", "search_index", "analyze"}
    assert Session.objects.count() == 101
    assert Message.objects.count() == 100 * 20 + 3_000
    big = Session.objects.get(pk=BIG_SESSION)
    assert big.owner_id == owners[0] and big.last_message_seq == 3_000
    assert Message.objects.filter(session=big).order_by("-seq").values_list("seq", flat=True)[:1].get() == 3_000
    assert Turn.objects.filter(session=big).count() == bench_admin.BIG_TURNS
    assert Turn.objects.filter(session=big, thread_action="rotated").count() == 1
    assert CodexBinding.objects.filter(status="active").count() == 101
    assert Notice.objects.filter(acknowledged_at__isnull=True).count() == 2  # bench-big and bench-s-000050
    assert Session.objects.filter(owner_id=owners[0]).count() == 1 + 100 // 3
    # User rows ≈ 200 characters, assistant rows ≈ 600; the vocabulary word occurs in ≈ 0.3 % of rows.
    user_row = Message.objects.filter(role="user").first()
    assistant_row = Message.objects.filter(role="assistant").first()
    assert 150 < len(user_row.content) < 260 and 500 < len(assistant_row.content) < 700
    with connection.cursor() as cur:
        cur.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [bench_admin.SEARCH_INDEX])
        assert "gin" in cur.fetchone()[0]  # rebuilt after the load
    hits = Message.objects.filter(content__contains=f" {SEARCH_WORD} ").count()
    assert 5 <= hits <= 40


def test_every_timed_page_answers_with_its_marker(seeded, client):
    admin, owners, _ = seeded
    client.force_login(admin)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user_id=owners[0]).key}")
    for name, (kind, path, marker) in pages(deep_after=2_000).items():
        response = (client if kind == "admin" else api).get(path)
        assert response.status_code == 200, name
        assert marker in response.content.decode(), name


def test_drf_cursor_starts_after_the_position(seeded):
    _, owners, _ = seeded
    api = APIClient()
    api.force_authenticate(Session.objects.get(pk=BIG_SESSION).owner)
    rows = api.get(f"/api/sessions/{BIG_SESSION}/messages/", {"cursor": drf_cursor(1234), "page_size": 3}).json()["results"]
    assert [r["seq"] for r in rows] == [1235, 1236, 1237]


def test_figures_and_targets():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.95) == 5.0
    assert percentile(list(map(float, range(1, 101))), 0.95) == 95.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
    rows = summarize({"sessions_list": [100.0, 120.0, 400.0], "session_page": [250.0, 260.0, 10.0],
                      "api_transcript_deep": [1000.0]})
    assert rows == [("sessions_list", 120.0, 400.0, 150, True), ("session_page", 250.0, 260.0, 200, False),
                    ("api_transcript_deep", 1000.0, 1000.0, None, True)]
    text = report(rows)
    assert "MISSED" in text.splitlines()[2] and "ok" in text.splitlines()[1]
