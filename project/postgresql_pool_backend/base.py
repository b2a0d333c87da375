"""``ENGINE = "project.postgresql_pool_backend"`` (``DATABASE_POOL``, the ASGI API): Django's PostgreSQL backend
whose psycopg pool checks connections with ``project.db_pool.check_pooled_connection``.

Django builds the pool itself and passes it ``check=ConnectionPool.check_connection`` when
``CONN_HEALTH_CHECKS`` is on (a ``check`` in ``OPTIONS["pool"]`` is refused as a second value). That
check is kept, after a check without a round trip (``project/db_liveness.py``), and what follows its
failure changes (``project/db_pool.py``). The pool keeps the
callable as ``_check`` (psycopg_pool 3.3; ``tests/test_asgi_settings.py`` fails if that stops holding)."""
from __future__ import annotations

from typing import Any

from project.db_pool import check_pooled_connection
from project.postgresql_backend import base


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self) -> Any:
        pool = super().pool
        if pool is not None and getattr(pool, "_check", None) is not None:
            pool._check = check_pooled_connection
        return pool
