"""The demo's PostgreSQL: a private server from the pip package ``pgserver`` (pinned in requirements.txt),
used when ``DATABASE_URL`` is not set, so the demo runs the code production runs.

Shape: ``ENGINE = "project.embedded_postgres"`` is Django's PostgreSQL backend, as production runs it, plus
one step before each new connection: ``server(pgdata)``, which initializes the data directory if it is new
(initdb: trust authentication, user ``postgres``, database ``postgres``, UTF-8) and starts PostgreSQL on it
unless it already runs there (pgserver 0.1.4 ships PostgreSQL 16.2; a start takes ~1.5 s, initdb included).
The server listens on no TCP port, only on the Unix socket ``<pgdata>/.s.PGSQL.5432``: settings' ``HOST`` is
the data directory itself, so our own connections (``hermes_sessions.listener.connection_params``: LISTEN) reach it too.

Where the data lives: ``HERMES_VAR_DIR/postgres`` (project/settings.py), server log in ``<pgdata>/log``.
``make clean`` deletes it with the rest of ``var/``; the next start makes a new one.

Two processes: pgserver serializes start and stop with one file lock (``$XDG_RUNTIME_DIR`` or
``/tmp/runtime-<uid>``, ``python_PostgresServer/.lockfile``) and lists the processes using a server in
``<pgdata>/.handle_pids.json``. The first process starts the server; the next ones find it running
(``postmaster.pid``) and use it; each takes itself off the list at exit (atexit), and the last one stops the
server (``pg_ctl stop``, fast mode). So ``make demo``'s ``migrate`` and ``demo`` (one after the other) each
start and stop it; ``make demo-admin`` started during or after the demo shares it or starts it again; a worker
(``celery -A project worker`` in the embedded shape) is one more process on the list, and its pool children
that connect first join it too. A process that ends without running atexit (SIGKILL, SIGTERM with Python's
default handler, a forked child's ``os._exit``) leaves its pid behind and the server running: ``server()``
drops the pids of processes no longer alive, so the last live process still stops it
(tests/test_settings.py::test_the_embedded_postgresql_starts_answers_and_stops_with_its_last_process).

As root (PostgreSQL refuses to run as root), pgserver runs initdb and the server as the system user
``pgserver``, which it creates with ``useradd`` when missing; it makes the data directory that user's and
gives others read and traverse rights (o+rx) on the directory's parents and on its own binaries.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pgserver.postgres_server import PostgresServer

# The longest Unix socket path Linux accepts (sun_path is 108 bytes, NUL included).
SOCKET_PATH_MAX = 107


def server(pgdata: Path) -> PostgresServer:
    """The PostgreSQL server on data directory ``pgdata``, started (and the directory made and initialized)
    if it does not run yet; this process is on its list of users until it exits.

    Raises ``RuntimeError`` when ``pgdata``'s socket path is too long for a Unix socket (pgserver would
    put the socket elsewhere, where ``HOST`` does not point), and ``subprocess.CalledProcessError`` when
    initdb or pg_ctl fails (the server log, ``<pgdata>/log``, says why)."""
    pgdata = pgdata.resolve()
    socket = pgdata / ".s.PGSQL.5432"
    if len(os.fsencode(socket)) > SOCKET_PATH_MAX:
        raise RuntimeError(f"the embedded PostgreSQL's socket path {socket} is longer than {SOCKET_PATH_MAX} "
                           "bytes: set HERMES_VAR_DIR to a shorter path")
    with warnings.catch_warnings():
        # platformdirs warns at pgserver's import when XDG_RUNTIME_DIR is unset; its fallback is fine.
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import PostgresServer, get_server
        from pgserver.utils import DiskList

    if pgdata in PostgresServer._instances:
        return get_server(pgdata)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with PostgresServer._lock:
        handles = DiskList(pgdata / ".handle_pids.json")  # pgserver 0.1.4's list of the server's processes
        for pid in handles.get():
            if not _alive(pid):
                handles.get_and_remove(pid)
    return get_server(pgdata)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
