"""``ENGINE = "project.postgresql_backend"`` (PostgreSQL without ``DATABASE_POOL``: the Celery workers, the test
suite, WSGI): Django's PostgreSQL backend whose health check (``CONN_HEALTH_CHECKS``, before the first query
of each request or task on a reused connection) costs no round trip when the connection is quiet and idle
(``project/db_liveness.py``); otherwise Django's ``SELECT 1``, as before."""
from __future__ import annotations

from django.db.backends.postgresql import base

from project.db_liveness import quiet_and_idle


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        if self.connection is not None and quiet_and_idle(self.connection):
            return True
        return bool(super().is_usable())
