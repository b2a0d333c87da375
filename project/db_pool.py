"""The check psycopg's connection pool runs on each connection it hands out (``DATABASE_POOL``, ASGI).

psycopg_pool 3.3's own loop (``ConnectionPool._getconn_with_check_loop``) discards a connection that fails
its check and then waits with exponential backoff (1 s, 2 s, 4 s …) before it checks the next idle one.
After PostgreSQL dropped the pool's connections (a restart, ``pg_terminate_backend``, a network blip)
every idle connection is broken, so one request after another waited out the pool's 10 s timeout and
answered 503 while the database was already back (adversary, session 7: four 10 s 503s on an idle API
after one blip, more minutes later). Here the first failed check has the pool check all its idle
connections at once (``ConnectionPool.check``, public API: broken ones are discarded and replaced), so
the retry that follows finds a good or a fresh connection.
"""
from __future__ import annotations

import logging
from typing import Any

from psycopg_pool import ConnectionPool

from project.db_liveness import quiet_and_idle

logger = logging.getLogger(__name__)


def check_pooled_connection(conn: Any) -> None:
    """``ConnectionPool(check=…)``: nothing when the connection is quiet and idle (``db_liveness``), else
    ``ConnectionPool.check_connection`` (an empty statement; raises on a broken connection). When it fails, first sweep the pool's other idle connections
    (``ConnectionPool.check``) of the database alias ``default`` — the one pooled — then re-raise, so
    that the pool discards this connection too and retries at once with a sound one."""
    if quiet_and_idle(conn):  # no round trip (project/db_liveness.py)
        return
    try:
        ConnectionPool.check_connection(conn)
    except Exception:
        from django.db import connections

        pool = getattr(connections["default"], "pool", None)  # Django's PostgreSQL backend's pool (None: not pooled)
        if pool is not None:
            logger.warning("a pooled database connection was broken; checking the pool's idle connections")
            pool.check()
        raise
