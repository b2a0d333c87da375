"""A worker keeps its database connection from one task to the next (``CELERY_DB_REUSE_MAX`` in
settings; ``project/celery.py`` ``_close_old_connections``): Celery's Django fix-up no longer closes it
before and after every task (a new connection per turn, ~3-8 ms of the warm path), while a connection
that broke (PostgreSQL restarted, the backend was killed) or outlived ``DATABASE_CONN_MAX_AGE`` is
still replaced at the next task, as Django does per request. Real PostgreSQL."""
from __future__ import annotations

from types import SimpleNamespace

import psycopg
import pytest
from celery.fixups.django import DjangoWorkerFixup
from django.db import OperationalError, connection

from project.celery import _close_old_connections, app

pytestmark = pytest.mark.django_db(transaction=True)  # no test transaction around: connections really close


def _task(eager: bool = False) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(is_eager=eager))


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _around_a_task(task: SimpleNamespace) -> None:
    """What a worker runs around a task: the fix-up's handlers, then ours (both on task_prerun/postrun)."""
    fixup = DjangoWorkerFixup(app)
    for fixup_handler in (fixup.on_task_prerun, fixup.on_task_postrun):
        fixup_handler(sender=task)
        _close_old_connections(task=task)


def test_the_connection_is_kept_from_one_task_to_the_next():
    assert app.conf.get("CELERY_DB_REUSE_MAX")  # read by celery/fixups/django.py
    pid = _backend_pid()
    for _ in range(3):
        _around_a_task(_task())
        assert _backend_pid() == pid


def test_a_broken_connection_is_replaced_at_the_next_task(settings):
    pid = _backend_pid()
    with psycopg.connect(_dsn(settings), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(OperationalError):
        _backend_pid()  # the task that found it broken fails; Django marks the connection
    _around_a_task(_task())
    assert _backend_pid() != pid


def test_an_obsolete_connection_is_replaced_but_not_inside_an_eager_task():
    pid = _backend_pid()
    connection.close_at = 0  # older than DATABASE_CONN_MAX_AGE
    _close_old_connections(task=_task(eager=True))  # runs inside the caller's request: left alone
    assert _backend_pid() == pid
    connection.close_at = 0
    _close_old_connections(task=_task())
    assert _backend_pid() != pid


def _dsn(settings) -> str:
    db = settings.DATABASES["default"]
    return f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"
