"""What a turn's POST and a turn's GET cost in database round trips, pinned so that none comes back
unnoticed: counted over the whole request with the real Token authentication, and for the POST with
the send after the commit included, Celery not eager (an eager app routes nothing, so it would hide a
routing read after the commit)."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from hermes_sessions.models import Turn, TurnWorker, WarmThread
from hermes_sessions.services import routing
from project.celery import app as celery_app
from tests.factories import SessionFactory
from tests.support.round_trips import counting, round_trips_counted

pytestmark = pytest.mark.django_db(transaction=True)

# The token, then one transaction in one round trip (psycopg's pipeline mode, ``services.pipelining``;
# ``turns._enqueue_in_one_trip``): BEGIN, the transaction's lock timeout (set_config), the UPDATE
# that locks the session and draws the seq — only the caller's session: the ownership is checked there, not
# by a read before —, the turn's INSERT (its seq read from the locked row), the queued event's
# INSERT with its NOTIFY for the event streams, the busy turn and the route with the conditional wake, and
# COMMIT. The send after the commit reads nothing. (A standalone ``pg_notify`` transaction after the
# task's send would be a third round trip: ~0.8 ms of PostgreSQL's time in the PostgreSQL log, while the
# woken worker claims the turn and codex starts it.) Round trips on the wire
# (``tests.support.round_trips``); statements as Django records them (with its own BEGIN and COMMIT entries,
# which send nothing here).
TURN_POST_ROUND_TRIPS = 2
TURN_POST_QUERIES = 10
# The token, the turn (joined to its session's owner).
TURN_GET_QUERIES = 2


@pytest.fixture
def token_client(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return api


@pytest.fixture
def sends(monkeypatch) -> list[tuple[str, str | None, float | None]]:
    """``run_turn.apply_async`` calls as ``(turn id, queue, countdown)``, nothing sent; Celery's app not
    eager meanwhile, so the dispatch routes as an API process does."""
    from hermes_sessions import tasks

    calls: list[tuple[str, str | None, float | None]] = []
    monkeypatch.setattr(tasks.run_turn, "apply_async",
                        lambda args, **kw: calls.append((args[0], kw.get("queue"), kw.get("countdown"))))
    celery_app.conf.task_always_eager = False
    try:
        yield calls
    finally:
        celery_app.conf.task_always_eager = True


def test_a_turn_post_costs_two_round_trips_with_its_routing(token_client, user, sends, settings,
                                                            django_assert_max_num_queries, monkeypatch):
    from django.db import connection

    from hermes_sessions import tasks

    sent_at_query: list[int] = []  # how many queries the request had made when each send happened
    record = tasks.run_turn.apply_async
    monkeypatch.setattr(tasks.run_turn, "apply_async",
                        lambda args, **kw: (sent_at_query.append(len(connection.queries) - base), record(args, **kw)))
    session = SessionFactory(owner=user)
    queue = routing.route_name("round-trips@host")  # a worker keeps the session's thread loaded
    TurnWorker.objects.create(queue=queue, node="round-trips@host", heartbeat_at=timezone.now())
    WarmThread.objects.create(session=session, queue=queue, thread_id="t", generation=1,
                              until=timezone.now() + timedelta(seconds=60))
    with round_trips_counted() as wire, counting(wire) as trips, \
            django_assert_max_num_queries(TURN_POST_QUERIES) as captured:
        base = len(connection.queries)
        response = token_client.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                                     content_type="application/json")
    assert response.status_code == 202, response.content
    assert trips == [TURN_POST_ROUND_TRIPS]
    turn = Turn.objects.get(pk=response.json()["id"])
    sqls = [q["sql"] for q in captured.captured_queries]
    assert sqls[-1] == "COMMIT"  # nothing read or sent to PostgreSQL after the commit
    events_insert = next(s for s in sqls if "INSERT INTO \"hermes_sessions_turnevent\"" in s)
    assert "pg_notify(" in events_insert  # the queued event's wake-up for the streams, in the transaction
    assert sends == [(str(turn.id), None, None)]  # its holder does not listen: the shared queue, no countdown
    assert sent_at_query == [len(sqls)], "the task is sent after the COMMIT"
    assert turn.dispatched_at is not None and turn.seq == 1
    assert list(turn.events.values_list("kind", "data")) == [("queued", {"seq": 1})]


def test_a_turn_post_that_wakes_its_holder_costs_the_same_round_trips(token_client, user, sends, settings,
                                                                    django_assert_max_num_queries):
    """The wake's ``pg_notify`` is sent by the enqueue's last statement, in its one round trip (``worker/wake.py``,
    ``turns._enqueue_in_one_trip``); nobody gets a Celery message (should the holder not claim the turn, the
    sweep dispatches it, ``recovery.turns_dispatch_unclaimed``)."""
    session = SessionFactory(owner=user)
    queue = routing.route_name("round-trips-wake@host")
    TurnWorker.objects.create(queue=queue, node="round-trips-wake@host", heartbeat_at=timezone.now(), wakeable=True)
    WarmThread.objects.create(session=session, queue=queue, thread_id="t", generation=1,
                              until=timezone.now() + timedelta(seconds=60))
    with round_trips_counted() as wire, counting(wire) as trips, \
            django_assert_max_num_queries(TURN_POST_QUERIES) as captured:
        response = token_client.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                                     content_type="application/json")
    assert response.status_code == 202, response.content
    assert trips == [TURN_POST_ROUND_TRIPS]
    sqls = [q["sql"] for q in captured.captured_queries]
    commit = sqls.index("COMMIT")
    assert any("pg_notify(" in s for s in sqls[:commit]), sqls  # in the transaction
    assert sends == []


def test_a_turn_post_without_a_warm_worker_goes_to_the_shared_queue_alone(token_client, user, sends,
                                                                          django_assert_max_num_queries):
    session = SessionFactory(owner=user)
    with round_trips_counted() as wire, counting(wire) as trips, django_assert_max_num_queries(TURN_POST_QUERIES):
        response = token_client.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                                     content_type="application/json")
    assert response.status_code == 202, response.content
    assert trips == [TURN_POST_ROUND_TRIPS]
    assert sends == [(response.json()["id"], None, None)]


def test_a_turn_get_costs_two_round_trips(token_client, user, sends, django_assert_max_num_queries):
    session = SessionFactory(owner=user)
    posted = token_client.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                               content_type="application/json").json()
    with django_assert_max_num_queries(TURN_GET_QUERIES):
        response = token_client.get(f"/api/turns/{posted['id']}/")
    assert response.status_code == 200
    assert response.json() == posted
