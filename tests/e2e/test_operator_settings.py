"""Operator settings reach running sessions (issue 27 §5; docs/operating.md §3, "What follows the
operator"), through the real stack: a real worker with the real codex binary runs a session's first turn
under ``CODEX_MODEL=model-a`` against one model stand-in; the operator restarts the worker with
``CODEX_MODEL=model-b`` and ``CODEX_STAND_IN_URL`` pointing at a second stand-in; the session's next turn
resumes its thread, and the provider it now reaches is asked for ``model-b``. A session that chose its own
model keeps it.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from devtools.model_stand_in import ModelStandIn
from hermes_sessions.models import Turn
from project.celery import app as celery_app

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def _start_worker(tmp_path: Path, n: int, codex_bin: str, stand_in: ModelStandIn, model: str) -> subprocess.Popen:
    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "codex_home"),
                     CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_USER_HOME=str(tmp_path / "codex_user_home"),
                     CODEX_WORK_ROOT=str(tmp_path / "work"), CODEX_MODEL=model)
    if n == 1:
        subprocess.run([sys.executable, "-m", "celery", "-A", "project", "purge", "-f", "-Q", TURN_QUEUE], env=env,
                       cwd=settings.BASE_DIR, check=True, capture_output=True, timeout=60)
    log = tmp_path / f"worker{n}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", TURN_QUEUE, "-c", "1", "-n", f"op{n}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready([(proc, log)])
    return proc


def _run(client: APIClient, session_id: str, text: str) -> dict:
    resp = client.post(f"/api/sessions/{session_id}/turns/", {"input": text}, format="json")
    assert resp.status_code == 202, resp.content
    deadline = time.monotonic() + 90
    while True:
        turn = client.get(f"/api/turns/{resp.json()['id']}/").json()
        if turn["status"] in ("succeeded", "failed", "cancelled"):
            return turn
        assert time.monotonic() < deadline, f"turn stuck: {turn}"
        time.sleep(0.05)


def _models(stand_in: ModelStandIn, text: str) -> set[str]:
    """The models the provider was asked for by requests whose last user text is ``text``."""
    return {r["body"]["model"] for r in stand_in.requests()
            if any(role == "user" and t == text for role, t in stand_in.user_texts(r)[-1:])}


def test_a_restarted_worker_s_model_and_provider_reach_an_existing_session(tmp_path, user, real_codex_bin):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    assert client.post("/api/sessions/", {"id": "sess-follows"}, format="json").status_code == 201
    assert client.post("/api/sessions/", {"id": "sess-own", "model_config": {"model": "own-model"}},
                       format="json").status_code == 201
    celery_app.conf.task_always_eager = False
    workers: list[subprocess.Popen] = []
    try:
        with ModelStandIn() as before, ModelStandIn() as after:
            workers.append(_start_worker(tmp_path, 1, real_codex_bin, before, "model-a"))
            for session in ("sess-follows", "sess-own"):
                turn = _run(client, session, f"{session} one")
                assert (turn["status"], turn["thread_action"]) == ("succeeded", "started"), turn
            assert _models(before, "sess-follows one") == {"model-a"}
            assert _models(before, "sess-own one") == {"own-model"}

            stop_workers(workers)  # the operator's restart, with the new settings
            workers.append(_start_worker(tmp_path, 2, real_codex_bin, after, "model-b"))
            seen_before = len(before.requests())
            for session in ("sess-follows", "sess-own"):
                turn = _run(client, session, f"{session} two")
                assert (turn["status"], turn["thread_action"]) == ("succeeded", "resumed"), turn
                assert Turn.objects.get(pk=turn["id"]).codex_methods == ["thread/resume"]  # as the contract pins
            assert _models(after, "sess-follows two") == {"model-b"}
            assert _models(after, "sess-own two") == {"own-model"}
            assert len(before.requests()) == seen_before  # the old provider URL is asked nothing
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([w for w in workers if w.poll() is None])
        _forget_queue(settings.CELERY_BROKER_URL)
