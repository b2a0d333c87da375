"""The health checks that cost no round trip (``project/db_liveness.py``): Django's of a reused connection
(``project.postgresql_backend``, the workers and the suite) and psycopg's pool's (``project/db_pool.py``,
the ASGI API). Real PostgreSQL: a connection is ended by ``pg_terminate_backend`` as a restart ends it."""
from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connection, transaction
from django.db.backends.postgresql import base as django_postgresql

from hermes_sessions.listener import connection_params
from project.db_liveness import quiet_and_idle
from project.db_pool import check_pooled_connection

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(30)]


def _terminate(pid: int) -> None:
    with psycopg.connect(**connection_params("test-terminator"), autocommit=True) as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_suites_and_workers_backend_is_ours(settings):
    assert settings.DATABASES["default"]["ENGINE"] == "project.postgresql_backend"


def test_a_quiet_idle_connection_is_usable_without_a_round_trip(monkeypatch):
    asked: list = []
    monkeypatch.setattr(django_postgresql.DatabaseWrapper, "is_usable", lambda self: asked.append(1) or True)
    connection.ensure_connection()
    assert connection.is_usable() and asked == []
    with transaction.atomic():  # a transaction open on it: the usual round trip
        connection.cursor().execute("SELECT 1")
        assert not quiet_and_idle(connection.connection)
        assert connection.is_usable() and asked == [1]


def test_a_terminated_connection_is_found_and_replaced_before_the_next_query():
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    _terminate(pid)
    _until(lambda: not quiet_and_idle(connection.connection))  # its goodbye is on the socket
    assert connection.is_usable() is False
    connection.close_if_unusable_or_obsolete()  # a task's or request's start (close_old_connections)
    with connection.cursor() as cursor:  # the health check replaces it: no error reaches the caller
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid


def test_a_closed_or_broken_connection_is_not_quiet():
    conn = psycopg.connect(**connection_params("test-liveness"), autocommit=True)
    assert quiet_and_idle(conn)
    conn.close()
    assert not quiet_and_idle(conn)
    assert not quiet_and_idle(object())  # not a psycopg connection: never raises


def test_the_pools_check_asks_only_a_connection_that_is_not_quiet(monkeypatch):
    from psycopg_pool import ConnectionPool

    asked: list = []
    real = ConnectionPool.check_connection
    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(lambda c: (asked.append(1), real(c))))
    conn = psycopg.connect(**connection_params("test-liveness"), autocommit=True)
    try:
        check_pooled_connection(conn)
        assert asked == []
        _terminate(conn.info.backend_pid)
        _until(lambda: not quiet_and_idle(conn))
        with pytest.raises(psycopg.OperationalError):
            check_pooled_connection(conn)  # the pool discards it and hands out another
        assert asked == [1]
    finally:
        conn.close()
