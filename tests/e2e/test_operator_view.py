"""What an operator sees, on the real pinned codex (issue 8 item 7):

* a turn whose model call gets HTTP 500 (or 401) fails with a reason naming the status codex saw;
* after a rotation, a ``SLOW`` in the replayed history does not slow down an unrelated turn;
* a real ``celery worker -B`` logs one line per turn end (with the Celery task id that ran it), Celery's
  own line for the task says ``'turn_status': 'failed'`` rather than only "succeeded", and the sweep
  beat runs every second without a line while it has nothing to do.
"""
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.models import IdempotencyKey, Turn
from hermes_sessions.services.rollouts import rollout_forget
from project.celery import app as celery_app
from tests.support.real_codex import use_real_codex

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _api, _database_url, _forget_queue, _run

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SLOW_SECONDS = 8.0
SWEEP_QUEUE = django_settings.CELERY_TASK_DEFAULT_QUEUE


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin):
    with ModelStandIn(slow_seconds=SLOW_SECONDS) as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        yield stand_in


@pytest.mark.parametrize(("status", "kind"), [(500, "internalServerError"), (401, "httpConnectionFailed")])
def test_a_failed_model_call_names_the_http_status(user, real_codex, run_turn_now, status, kind):
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text=f"FAIL{status} please", user=user)
    assert turn.status == Turn.Status.FAILED
    assert turn.error.startswith(f"the model call failed with HTTP {status} (codex: {kind}): "), turn.error
    # the stand-in really answered that status, once (codex's retries are off: docs/codex.md §8)
    assert len(real_codex.requests()) == 1


def test_a_slow_in_the_replayed_history_does_not_slow_a_rotated_turn(user, real_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="SLOW one", user=user)
    assert t1.status == Turn.Status.SUCCEEDED and t1.timings["turn_ms"] >= SLOW_SECONDS * 1000 * 0.9, t1.timings
    # Timings are milliseconds to one decimal place, as the API shows them (initialize_ms is a difference).
    assert {k: v for k, v in t1.timings.items() if k.endswith("_ms") and round(v, 1) != v} == {}
    assert rollout_forget(thread_id=t1.codex_thread_id) == 1  # the thread is lost: the next turn rotates
    seen = len(real_codex.requests())
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED, "rotated"), t2.error
    # The rotated thread's input replayed "SLOW one" (the seed) ahead of the current turn…
    texts = [text for req in real_codex.requests()[seen:] for _, text in real_codex.user_texts(req)]
    assert any("[USER]\nSLOW one" in text and text.endswith("[CURRENT USER TURN]\nhello two") for text in texts)
    # …and the model answered at once: only the current turn steers the stand-in.
    assert t2.timings["turn_ms"] < SLOW_SECONDS * 1000 / 2, t2.timings


@pytest.fixture
def beat_worker(tmp_path, stand_in, real_codex_bin, settings):
    """A real `celery worker -B` (beat embedded, the sweep every second) on the turn queue and the
    sweep's queue, as `make worker` runs it; yields (process, log path)."""
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    env = worker_env(
        database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
        stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "codex_home"),
        HERMES_VAR_DIR=str(tmp_path / "var"),  # beat's schedule file
        HERMES_SWEEP_SECONDS="1",
        CODEX_HOMES_ROOT=str(settings.CODEX_HOMES_ROOT), CODEX_USER_HOME=str(tmp_path / "codex_user_home"),
        CODEX_WORK_ROOT=str(tmp_path / "work"),
    )
    celery = [sys.executable, "-m", "celery", "-A", "project"]
    subprocess.run(celery + ["purge", "-f", "-Q", f"{TURN_QUEUE},{SWEEP_QUEUE}"], env=env, cwd=settings.BASE_DIR,
                   check=True, capture_output=True, timeout=60)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            celery + ["worker", "-B", "-Q", f"{TURN_QUEUE},{SWEEP_QUEUE}", "-c", "1", "--without-gossip",
                      "--without-mingle", "--without-heartbeat", "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
    wait_ready([(proc, log)])
    celery_app.conf.task_always_eager = False
    try:
        yield proc, log
    finally:
        celery_app.conf.task_always_eager = True
        stop_workers([proc])
        _forget_queue(settings.CELERY_BROKER_URL)


def test_the_worker_log_has_one_line_per_turn_end_and_a_quiet_sweep(user, beat_worker, stand_in):
    _, log = beat_worker
    client = _api(user)
    assert client.post("/api/sessions/", {"id": "sess-log"}, format="json").status_code == 201
    ok = _run(client, "sess-log", "hello")
    failed = _run(client, "sess-log", "FAIL500 now")
    assert (ok["status"], failed["status"]) == ("succeeded", "failed"), (ok, failed)
    time.sleep(4)  # beat sends the sweep every second meanwhile; the sweep has nothing to do
    text = log.read_text()

    ends = [line for line in text.splitlines() if " ended status=" in line]
    assert len(ends) == 2, text[-4000:]
    assert re.search(rf'turn {ok["id"]} ended status=succeeded session=sess-log thread_action=started attempt=1 '
                     r'task=[0-9a-f-]{36} reason=""$', ends[0]), ends[0]
    match = re.search(rf'turn {failed["id"]} ended status=failed session=sess-log thread_action=resumed attempt=1 '
                      r'task=([0-9a-f-]{36}|wake) reason="the model call failed with HTTP 500 \(codex: internalServerError\): ',
                      ends[1])
    assert match, ends[1]
    if match.group(1) == "wake":
        # Run on the worker's NOTIFY wake-up (it keeps the session's thread): the wake is the only notification
        # (dispatch.py) — no Celery task for it at all.
        assert f"'turn': '{failed['id']}'" not in text, text[-4000:]
    else:
        # Celery's own line for that task id: the task succeeded, the turn failed.
        assert re.search(rf"Task hermes_sessions\.tasks\.run_turn\[{match.group(1)}\] succeeded in [0-9.]+s: "
                         rf"\{{'turn': '{failed['id']}', 'turn_status': 'failed'\}}", text), text[-4000:]
    # Beat sent the sweep every second and nothing was logged about it: no Celery line, none of its own.
    running = text.split(" ready.", 1)[1]
    assert "sweep_turns" not in running and "sweep:" not in running and "Sending due task" not in running, running

    # Once it acts, it says so in one line (here: an expired Idempotency-Key deleted) — so it was running.
    key = IdempotencyKey.objects.create(user=user, key="old", scope="x", request_hash="h", object_id="o")
    IdempotencyKey.objects.filter(pk=key.pk).update(created_at=timezone.now() - timedelta(days=2))
    deadline = time.monotonic() + 30
    while "sweep: deleted 1 Idempotency-Key rows" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(2)
    running = log.read_text().split(" ready.", 1)[1]
    assert [line for line in running.splitlines() if "sweep" in line] == [
        line for line in running.splitlines() if "sweep: deleted 1 Idempotency-Key rows older than 86400 s" in line
    ] and running.count("sweep") == 1, running
