"""Database connections of our own, beside Django's: for ``LISTEN`` (the event hub's, the wake listener's)."""
from __future__ import annotations

from typing import Any

from django.conf import settings


def own_connection_params(application_name: str) -> dict[str, Any]:
    """psycopg connection parameters of the default database for a connection of our own (not Django's:
    LISTEN needs a connection that no pool recycles and nothing else uses), named ``application_name``
    in ``pg_stat_activity``."""
    db = settings.DATABASES["default"]
    params: dict[str, Any] = {"dbname": db["NAME"], "user": db.get("USER") or None,
                              "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
                              "port": db.get("PORT") or None, "application_name": application_name}
    return {k: v for k, v in params.items() if v is not None}
