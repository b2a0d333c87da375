"""Telling a database connection is still sound without a round trip.

Django checks a reused connection before each request or task (``CONN_HEALTH_CHECKS``: ``SELECT 1``), and
psycopg's pool checks each connection it hands out (``DATABASE_POOL``: an empty statement). On the warm
path each check was a round trip of its own — the worker's before the claim, the API's before the turn
``POST`` — paid by every turn on a 2-core machine where the client and PostgreSQL share the CPU
(``make bench-warm``'s per-hop trace, session 8).

PostgreSQL says goodbye before it drops a connection: ``pg_terminate_backend``, a fast or smart shutdown,
``idle_session_timeout`` and a crash restart's backend exit each send a ``FATAL`` ``ErrorResponse`` and
then close the socket (PostgreSQL 15, ``postgres.c``/``ProcessInterrupts``). A connection that is idle (no
transaction open on it) and whose socket has nothing to read has had no such word: it is as sound as a
round trip would say, with one exception that a round trip does not catch either — a network path cut
without a FIN (the round trip waits; the server's keepalives, ``DATABASE_KEEPALIVES_IDLE``, end the
server's side). Anything else — a readable socket (the goodbye, or a message nobody asked for), a
transaction state other than idle, a closed or broken connection — gets the usual round trip.
"""
from __future__ import annotations

import select
from typing import Any

from psycopg.pq import TransactionStatus


def quiet_and_idle(conn: Any) -> bool:
    """Whether psycopg connection ``conn`` is open, not broken, idle (``TransactionStatus.IDLE``) and its
    socket has nothing to read (``select`` with a zero timeout). ``True``: sound without a round trip;
    ``False``: ask the server (the caller's usual check). Never raises."""
    try:
        if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
            return False
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, AttributeError):  # a closed descriptor, or not a psycopg connection
        return False
    return not readable
