"""The seed scenario end to end: REST API → Redis broker → a real Celery worker process → the real
pinned codex app-server (one process per turn) → PostgreSQL, with the model stand-in as provider."""
import subprocess
import sys
import time

import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from devtools.processes import codex_pids
from hermes_sessions.services.rollouts import rollout_forget
from project.celery import app as celery_app

from .conftest import stop_workers, wait_ready, worker_env

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NOTICE = "Codex thread could not be resumed; starting a new one."
TURN_QUEUE = settings.CELERY_TASK_ROUTES["hermes_sessions.tasks.run_turn"]["queue"]


def _database_url() -> str:
    db = settings.DATABASES["default"]
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture
def celery_worker(tmp_path, stand_in, real_codex_bin, settings):
    """A real `celery worker` process on the test database and the test broker."""
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    settings.CODEX_HOME = tmp_path / "codex_home"
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    env = worker_env(
        database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
        stand_in_url=stand_in.base_url, codex_home=str(settings.CODEX_HOME),
        CODEX_HOMES_ROOT=str(settings.CODEX_HOMES_ROOT), CODEX_USER_HOME=str(tmp_path / "codex_user_home"),
        CODEX_WORK_ROOT=str(tmp_path / "work"),
    )
    celery = [sys.executable, "-m", "celery", "-A", "project"]
    subprocess.run(celery + ["purge", "-f", "-Q", TURN_QUEUE], env=env, cwd=settings.BASE_DIR, check=True,
                   capture_output=True, timeout=60)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            celery + ["worker", "-Q", TURN_QUEUE, "-c", "1", "--without-gossip", "--without-mingle",
                      "--without-heartbeat", "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
    wait_ready([(proc, log)])
    celery_app.conf.task_always_eager = False  # this process now sends to the real broker
    try:
        yield proc
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([proc])
        _forget_queue(settings.CELERY_BROKER_URL)
        assert codex_pids(settings.CODEX_HOMES_ROOT) == [], "codex processes left behind"


def _forget_queue(broker_url: str) -> None:
    """Drop the per-run queue's binding keys, so test runs leave nothing behind on a shared Redis."""
    if broker_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(broker_url)
        for key in client.scan_iter(match=f"_kombu.binding*{TURN_QUEUE}*"):
            client.delete(key)
        for key in client.scan_iter(match=f"{TURN_QUEUE}.*"):  # -c 1 workers' own queues (session affinity)
            client.delete(key)
        client.delete(TURN_QUEUE)


def _api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def _run(client, session_id: str, text: str) -> dict:
    resp = client.post(f"/api/sessions/{session_id}/turns/", {"input": text}, format="json")
    assert resp.status_code == 202, resp.content
    turn_id = resp.json()["id"]
    deadline = time.monotonic() + 90
    while True:
        turn = client.get(f"/api/turns/{turn_id}/").json()
        if turn["status"] in ("succeeded", "failed", "cancelled"):
            return turn
        assert time.monotonic() < deadline, f"turn stuck: {turn}"
        time.sleep(0.05)


def test_restart_resumes_and_dead_thread_rotates_through_the_real_stack(user, celery_worker, stand_in, settings):
    client = _api(user)
    assert client.post("/api/sessions/", {"id": "sess-codex-restart"}, format="json").status_code == 201

    t1 = _run(client, "sess-codex-restart", "hello one")
    assert (t1["status"], t1["thread_action"], t1["final_text"]) == ("succeeded", "started", "echo: hello one"), t1
    thread1 = t1["codex_thread_id"]
    assert client.get("/api/sessions/sess-codex-restart/").json()["codex_thread_id"] == thread1

    seen = len(stand_in.requests())
    t2 = _run(client, "sess-codex-restart", "hello two")
    assert (t2["status"], t2["thread_action"], t2["codex_thread_id"]) == ("succeeded", "resumed", thread1), t2
    turn2_requests = stand_in.requests()[seen:]
    texts = [text for req in turn2_requests for _, text in stand_in.user_texts(req)]
    assert "hello one" in texts and "echo: hello one" in texts and "hello two" in texts

    # The rollout is lost (an operator-lost rollout): PostgreSQL, which each turn's home is made from,
    # no longer has it, and codex, given a fresh home without it, says "no rollout found".
    assert rollout_forget(thread_id=thread1) == 1
    t3 = _run(client, "sess-codex-restart", "hello three")
    assert (t3["status"], t3["thread_action"]) == ("succeeded", "rotated"), t3
    assert t3["codex_thread_id"] != thread1
    notices = client.get("/api/sessions/sess-codex-restart/notices/").json()
    notices = notices.get("results", notices) if isinstance(notices, dict) else notices
    assert [n["text"] for n in notices] == [NOTICE]
    assert client.get("/api/sessions/sess-codex-restart/").json()["codex_thread_id"] == t3["codex_thread_id"]
