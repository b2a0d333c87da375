"""Persistent connections (``DATABASE_CONN_MAX_AGE``; the workers, WSGI and the suite) are checked by Django's
``CONN_HEALTH_CHECKS`` at the first query of each request or task: a connection PostgreSQL dropped (a restart,
``pg_terminate_backend``) is replaced, and the caller sees no error. Real PostgreSQL."""
from __future__ import annotations

import psycopg
import pytest
from django.db import close_old_connections, connection

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(30)]


def test_the_backend_is_djangos_with_health_checks(settings):
    db = settings.DATABASES["default"]
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert db["CONN_HEALTH_CHECKS"] is True and db["CONN_MAX_AGE"] > 0


def test_a_terminated_connection_is_replaced_before_the_next_query():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        # With a timeout it returns once the backend is gone (PostgreSQL 14+).
        assert other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone() == (True,)
    close_old_connections()  # a request's or a task's start
    with connection.cursor() as cursor:  # the health check replaces it: no error reaches the caller
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid
