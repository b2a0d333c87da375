"""``ENGINE = "project.postgresql_pool_backend"`` (``DATABASE_POOL``, the ASGI API): Django's PostgreSQL backend
and its psycopg pool (``OPTIONS["pool"]``), whose check of a connection it hands out, when it fails, first
checks every other idle connection of the pool at once.

Why: with ``CONN_HEALTH_CHECKS`` Django gives the pool ``check=ConnectionPool.check_connection``, and
psycopg_pool 3.3's ``getconn`` discards a connection that fails it and then
waits 1 s, 2 s, 4 s … (its reconnection backoff) before it checks the next idle one. After PostgreSQL dropped
the pool's connections (a restart, ``pg_terminate_backend``, a network blip) every idle one is broken, so
request after request waited out the pool's 10 s timeout and answered 503 while the database was back
(``tests/test_asgi_settings.py``). Here the first failed check runs ``ConnectionPool.check`` (public API:
broken connections are discarded and replaced), so the pool's retry finds a sound or a fresh connection.

Django passes its own ``check`` to the pool it builds (a ``check`` in ``OPTIONS["pool"]`` is refused), so this
backend builds the pool as Django 5.2 does (``DatabaseWrapper.pool``) with this check through psycopg_pool's
public ``check`` argument (``tests/test_asgi_settings.py`` pins the behaviour)."""
from __future__ import annotations

import logging
from typing import Any

from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

logger = logging.getLogger(__name__)


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self) -> Any:
        # Django 5.2's own store of its pools (``close_pool`` reads it) and its connection set-up callback,
        # which the stubs do not declare.
        pools: dict[str, ConnectionPool[Any]] = self._connection_pools  # type: ignore[attr-defined]
        options = self.settings_dict["OPTIONS"].get("pool")
        if (self.alias == NO_DB_ALIAS or not options or not self.settings_dict["CONN_HEALTH_CHECKS"]
                or self.settings_dict.get("CONN_MAX_AGE", 0) != 0 or self.alias in pools):
            return super().pool  # no pool, Django's refusal of persistent connections, or the pool built
        params = self.get_connection_params()
        params["autocommit"] = True  # as Django: it sets the mode itself later on
        pool: ConnectionPool[Any] = ConnectionPool(
            kwargs=params, open=False, configure=self._configure_connection,  # type: ignore[attr-defined]
            check=_check_or_sweep, **({} if options is True else options))
        # setdefault: two threads may build one at start-up; the first stored wins (the pool is not open yet).
        return pools.setdefault(self.alias, pool)


def _check_or_sweep(conn: Any) -> None:
    """``ConnectionPool.check_connection`` (an empty statement; raises on a broken connection); when it fails,
    first ``ConnectionPool.check`` the pool of the database alias ``default`` (the one pooled), then re-raise so
    that the pool discards this connection too and retries at once."""
    try:
        ConnectionPool.check_connection(conn)
    except Exception:
        from django.db import connections

        pool = getattr(connections["default"], "pool", None)
        if pool is not None:
            logger.warning("a pooled database connection was broken; checking the pool's idle connections")
            pool.check()
        raise
