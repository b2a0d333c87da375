"""Celery is configured for at-least-once delivery of turns (issue 3 §4)."""
import pytest
from django.conf import settings

from hermes_sessions.tasks import run_turn, sweep_turns
from project.celery import app


def test_turns_are_acknowledged_late_and_requeued_when_a_worker_is_lost():
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1


def test_turns_have_a_queue_of_their_own():
    assert app.amqp.router.route({}, run_turn.name)["queue"].name == settings.CELERY_TASK_ROUTES[run_turn.name]["queue"]
    # The sweep stays on the default queue: long turns filling every turn slot cannot delay it.
    assert app.amqp.router.route({}, sweep_turns.name)["queue"].name == "celery"


def test_redelivery_and_time_limits_outlast_the_longest_turn():
    assert app.conf.broker_transport_options["visibility_timeout"] > settings.CODEX_TURN_TIMEOUT
    assert settings.CODEX_TURN_TIMEOUT < run_turn.soft_time_limit < run_turn.time_limit


def test_the_sweep_is_scheduled():
    schedule = app.conf.beat_schedule["sweep-turns"]
    assert schedule["task"] == sweep_turns.name and schedule["schedule"] <= settings.HERMES_LEASE_SECONDS


def test_an_api_process_has_the_tasks_registered_before_its_first_dispatch():
    """Threads of a fresh API process (gunicorn gthread, 50 turns posted at once) must not race on
    importing the tasks lazily: one would get ``NotRegistered`` and its turn wait for the sweep. ``django.setup()`` alone must register them, and concurrent first lookups succeed."""
    import subprocess
    import sys

    code = "\n".join([
        "import sys, threading, django",
        "django.setup()",
        "assert 'hermes_sessions.tasks' in sys.modules, 'tasks not imported at setup'",
        "from hermes_sessions.services import dispatch",
        "errors = []",
        "def look():",
        "    try:",
        "        dispatch._run_turn_task()",
        "    except Exception as exc:",
        "        errors.append(repr(exc))",
        "threads = [threading.Thread(target=look) for _ in range(16)]",
        "[t.start() for t in threads]",
        "[t.join() for t in threads]",
        "assert not errors, errors",
        "print('ok')",
    ])
    env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "project.settings", "DJANGO_SECRET_KEY": "x",
           "DATABASE_URL": "postgres://127.0.0.1/none", "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.django_db
def test_a_workers_transaction_left_idle_is_ended_by_postgresql(settings):
    """A worker frozen (SIGSTOP) between a claim's round trips would hold the session's row locks for as
    long as it stayed frozen, and every writer of that session and the sweep would wait behind it. A worker's connections now carry ``idle_in_transaction_session_timeout``
    (``project/celery.py``, at ``worker_init``): PostgreSQL ends such a transaction and its locks go."""
    import time

    import psycopg
    from django.db import connections

    from project import celery as project_celery

    settings.HERMES_WORKER_IDLE_IN_TRANSACTION_SECONDS = 0.5
    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    saved = options.get("options")
    try:
        project_celery._bound_idle_transactions()
        project_celery._bound_idle_transactions()  # once: a second start adds nothing
        assert options["options"].count("idle_in_transaction_session_timeout=500") == 1
        params = connections["default"].get_connection_params()
        with psycopg.connect(**{k: v for k, v in params.items() if k not in ("context", "cursor_factory")}) as conn:
            assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "500ms"
            conn.execute("SELECT 1")  # a transaction begins (psycopg's default), then the client goes quiet
            time.sleep(1.5)
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
                conn.execute("SELECT 1")
    finally:
        if saved is None:
            options.pop("options", None)
        else:
            options["options"] = saved


def test_behind_pgbouncer_a_worker_sends_no_startup_options(settings):
    """PgBouncer 1.18 refuses a connection with startup ``options``: behind it (``DATABASE_PGBOUNCER``) the
    worker's idle-transaction bound is PgBouncer's ``idle_transaction_timeout`` (docs/operating.md)."""
    from django.db import connections

    from project import celery as project_celery

    settings.DATABASE_PGBOUNCER = True
    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    saved = options.get("options")
    project_celery._bound_idle_transactions()
    assert options.get("options") == saved
