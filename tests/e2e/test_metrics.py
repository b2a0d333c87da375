"""Acceptance (issue 27 §1): on the production shape — gunicorn with 2 API processes, 2 real Celery
worker processes, the real codex binary and the model stand-in — ``GET /metrics`` shows the turn
counters moving after a turn and the histograms; after 20 turns its figures, parsed with
prometheus-client's parser, agree with the database, whichever API process answers; a worker's kept
threads and their memory and an API process's open event stream show as gauges."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token

from hermes_sessions.models import Turn
from project.celery import app as celery_app
from tests.support.sse import ApiServer, open_stream

from .conftest import stop_workers, wait_ready, worker_env
from .test_multi_host import _start_host
from .test_seed_e2e import _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(150)]

REPORT_SECONDS = "0.5"  # every process's report interval in this test
SESSIONS = 4
TURNS = 20

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def production_shape(tmp_path, stand_in, real_codex_bin, django_user_model):
    """2 Celery workers (``-c 1``, own node names) and gunicorn with 2 uvicorn workers, all reporting
    metrics every ``REPORT_SECONDS``; yields the API server and a staff user's token."""
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "legacy_home"),
                     HERMES_METRICS_REPORT_SECONDS=REPORT_SECONDS)
    started = [_start_host(f"metrics{i}", tmp_path / f"worker{i}", env) for i in range(2)]
    server = ApiServer(tmp_path / "api.log", workers=2, env={"HERMES_METRICS_REPORT_SECONDS": REPORT_SECONDS})
    try:
        wait_ready(started)
        server.start()
        celery_app.conf.task_always_eager = False
        staff = django_user_model.objects.create_user(username="operator", password="pw", is_staff=True)
        yield server, Token.objects.create(user=staff).key
    finally:
        celery_app.conf.task_always_eager = True
        server.stop()
        stop_workers([proc for proc, _ in started])
        _forget_queue(settings.CELERY_BROKER_URL)


def scrape(server: ApiServer, token: str) -> Samples:
    status, headers, body = server.get("/metrics", token)
    assert status == 200, body[:500]
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def scrape_until(server: ApiServer, token: str, holds: Callable[[Samples], bool], timeout: float = 10.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        found = scrape(server, token)
        if holds(found):
            return found
        assert time.monotonic() < deadline, sorted((k, v) for k, v in found.items() if v)
        time.sleep(0.2)


def ended(samples: Samples, status: str, action: str) -> float:
    return samples[("hermes_turns_ended_total", (("status", status), ("thread_action", action)))]


def post_turn(server: ApiServer, token: str, session: str, text: str) -> str:
    status, body = server.post(f"/api/sessions/{session}/turns/", token, {"input": text})
    assert status == 202, body
    return body["id"]


def wait_ended(turn_ids: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while Turn.objects.filter(pk__in=turn_ids).exclude(status__in=Turn.TERMINAL).exists():
        assert time.monotonic() < deadline, list(Turn.objects.filter(pk__in=turn_ids).values_list("status", flat=True))
        time.sleep(0.1)


def test_metrics_move_with_turns_and_agree_with_the_database(production_shape):
    server, token = production_shape
    # Who may read it: no credentials 401, JSON (the staff token is the way in here).
    status, _, body = server.get("/metrics", None)
    assert status == 401 and b"not_authenticated" in body

    before = scrape(server, token)
    assert ended(before, "succeeded", "started") == 0
    for i in range(SESSIONS):
        assert server.post("/api/sessions/", token, {"id": f"metrics-{i}"})[0] == 201

    # One turn: the counter moves, and the histograms have an observation.
    first = post_turn(server, token, "metrics-0", "hello metrics")
    wait_ended([first])
    moved = scrape_until(server, token, lambda m: ended(m, "succeeded", "started") == 1)
    assert moved[("hermes_turn_duration_seconds_count", ())] == 1
    assert moved[("hermes_turn_phase_seconds_count", (("phase", "codex"),))] == 1
    assert moved[("hermes_turn_duration_seconds_bucket", (("le", "+Inf"),))] == 1

    # An open event stream is counted by the API process serving it.
    stream = open_stream(server.port, "/api/sessions/metrics-1/events/", token)
    try:
        scrape_until(server, token, lambda m: m[("hermes_event_stream_clients", (("stream", "session"),))] == 1)
    finally:
        stream.close()

    # 19 more turns, the sessions' turns interleaved: each round posts one turn per session at once.
    turn_ids = [first]
    n = 1
    while n < TURNS:
        batch = []
        for i in range(SESSIONS):
            if n < TURNS:
                batch.append(post_turn(server, token, f"metrics-{i}", f"turn {n} of session {i}"))
                n += 1
        wait_ended(batch)
        turn_ids += batch

    turns = list(Turn.objects.filter(pk__in=turn_ids))
    by_end = Counter((t.status, t.thread_action or "none") for t in turns)
    assert sum(by_end.values()) == TURNS
    assert by_end[("succeeded", "started")] == SESSIONS and by_end[("succeeded", "resumed")] == TURNS - SESSIONS, by_end

    def agrees(m: Samples) -> bool:
        return all(ended(m, status, action) == count for (status, action), count in by_end.items())

    final = scrape_until(server, token, agrees)
    ran = [t for t in turns if t.started_at is not None]
    assert final[("hermes_turn_duration_seconds_count", ())] == len(ran) == TURNS
    assert final[("hermes_turn_duration_seconds_sum", ())] == pytest.approx(
        sum((t.finished_at - t.started_at).total_seconds() for t in ran), rel=1e-6)
    assert final[("hermes_turn_phase_seconds_sum", (("phase", "codex"),))] == pytest.approx(
        sum(t.timings["turn_ms"] for t in turns) / 1000, rel=1e-6)
    for phase in ("queue", "claim_restore", "codex", "finalize"):
        assert final[("hermes_turn_phase_seconds_count", (("phase", phase),))] == TURNS, phase
    assert final[("hermes_turns", (("status", "queued"),))] == 0
    assert final[("hermes_turns", (("status", "running"),))] == 0
    assert final[("hermes_thread_rotations_total", ())] == 0
    assert final[("hermes_metric_reports", (("role", "worker"),))] == 2
    assert final[("hermes_event_stream_clients", (("stream", "session"),))] == 0

    # The workers keep the sessions' threads loaded: counted, with their memory (a copy another worker
    # took over is released at its holder's next heartbeat, hence the wait).
    def kept(m: Samples) -> dict:
        return {k: v for k, v in m.items() if k[0] == "hermes_worker_kept_threads"}

    held = scrape_until(server, token, lambda m: len(kept(m)) == 2 and sum(kept(m).values()) == SESSIONS)
    uss = [v for (name, labels), v in held.items()
           if name == "hermes_worker_codex_memory_bytes" and ("holder", "kept") in labels and ("measure", "uss") in labels]
    assert len(uss) == 2 and sum(uss) > SESSIONS * (10 << 20), uss  # a kept app-server holds tens of MiB of its own

    # Whichever API process answers, the counters are the same (they come from PostgreSQL).
    for _ in range(6):
        again = scrape(server, token)
        assert agrees(again) and again[("hermes_turn_duration_seconds_count", ())] == TURNS
