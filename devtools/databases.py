"""Scratch PostgreSQL databases for ``make faults`` and ``make bench``, made beside ``DATABASE_URL``."""
from __future__ import annotations

__all__ = ["create_database", "database_beside", "drop_database", "recreate_database"]


def database_beside(url: str, suffix: str) -> str:
    """``postgres://…/hermes?x=y`` → ``postgres://…/hermes<suffix>?x=y`` (``hermes`` when the URL
    names no database)."""
    base, name = url.rsplit("/", 1)
    name, _, query = name.partition("?")
    return f"{base}/{name or 'hermes'}{suffix}" + (f"?{query}" if query else "")


def _name_and_admin_url(url: str) -> tuple[str, str]:
    """The database's name, and the URL of the ``postgres`` database on the same server."""
    return url.rsplit("/", 1)[1].split("?")[0], url.rsplit("/", 1)[0] + "/postgres"


def recreate_database(url: str) -> None:
    """Drop the database ``url`` names (closing its connections) and create it empty."""
    import psycopg

    name, admin = _name_and_admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def create_database(url: str) -> None:
    """Create the database ``url`` names unless it exists (its tables are left as they are)."""
    import psycopg

    name, admin = _name_and_admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(url: str) -> None:
    """Drop the database ``url`` names, closing its connections. Raises ``psycopg.Error``."""
    import psycopg

    name, admin = _name_and_admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
