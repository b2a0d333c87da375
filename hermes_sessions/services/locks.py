"""Row and advisory locks, taken only inside ``transaction.atomic`` (they end with the transaction).

Lock order, everywhere: the session row, then the turn row. Every write that touches a turn's state
takes both (``lock_session_and_turn``), so two workers, the sweep and the API serialize per session
(invariant I3) and never deadlock on each other. The turn-event writes (``docs/contract.md`` §8)
follow the same order: their per-session lock *is* the session row (``lock_session_for_events``),
taken before the claim check's share lock of the turn row — never a separate advisory lock taken
after a turn row lock (that order deadlocked against ``lock_session_and_turn``: the event insert's
foreign-key check needs a key-share lock of the session row the API holds ``FOR UPDATE``).
"""
from __future__ import annotations

import hashlib
import uuid
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.transaction import TransactionManagementError
from psycopg.errors import LockNotAvailable

from ..models import Session, Turn
from ..sql import query
from ..sql.rows import instance_from_row
from .pipelining import Batch, Later


def _require_transaction(what: str) -> None:
    if not connection.in_atomic_block:
        # Outside atomic the lock would end with its own statement: it would protect nothing.
        raise TransactionManagementError(f"{what} must run inside transaction.atomic")


def bound_lock_waits(batch: Batch | None = None) -> None:
    """Make every lock wait of the current transaction end after ``HERMES_POST_LOCK_TIMEOUT_MS`` with
    PostgreSQL's ``lock_timeout`` error (SQLSTATE 55P03, ``psycopg.errors.LockNotAvailable`` as the
    ``__cause__`` of Django's ``OperationalError``); until the transaction ends (``set_config(…, true)``).
    For the API's POSTs, so that requests waiting on another's lock do not pile up holding pooled
    connections. ``batch``: batched there (``pipelining``: it travels with the transaction's first
    statements) instead of run now. Raises ``TransactionManagementError`` outside a transaction."""
    _require_transaction("bound_lock_waits")
    statement = (query("lock_timeout_bound"), [f"{int(settings.HERMES_POST_LOCK_TIMEOUT_MS)}ms"])
    if batch is not None:
        batch.add(*statement)
        return
    with connection.cursor() as cursor:
        cursor.execute(*statement)


def lock_wait_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (a Django ``OperationalError``) is PostgreSQL's ``lock_timeout`` (``bound_lock_waits``)."""
    return isinstance(exc.__cause__, LockNotAvailable) or isinstance(exc, LockNotAvailable)


def advisory_xact_lock(name: str) -> None:
    """Take a PostgreSQL transaction-scoped advisory lock named by ``name`` (sha256 → 64-bit key),
    held until the transaction ends. Raises ``TransactionManagementError`` outside ``transaction.atomic``."""
    _require_transaction("advisory_xact_lock")
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute(query("advisory_xact_lock"), [key])


def lock_session_for_events(session_id: str) -> bool:
    """The per-session event lock (``docs/contract.md`` §8: ids in commit order within a session):
    ``SELECT … FOR NO KEY UPDATE`` of the session row, held until the transaction ends. It conflicts
    with itself and with the ``FOR UPDATE`` of ``lock_session_and_turn`` (so event inserts of one
    session commit one at a time, in id order) but not with the key-share locks of foreign-key
    checks. A no-op re-lock for a caller that already holds the row ``FOR UPDATE``; a caller holding
    no lock yet takes it first, before any turn row (the one lock order, I3). ``False``: no such
    session. Raises ``TransactionManagementError`` outside ``transaction.atomic``."""
    _require_transaction("lock_session_for_events")
    return Session.objects.select_for_update(no_key=True).filter(pk=session_id).values_list("pk", flat=True).first() is not None


def lock_session_and_turn(turn_id: uuid.UUID | str, *, skip_locked: bool = False) -> tuple[Session, Turn] | None:
    """Lock the turn's session row, then the turn row (``SELECT … FOR UPDATE``), and return both,
    freshly read; ``None`` when the turn does not exist. Raises ``TransactionManagementError``
    outside ``transaction.atomic``, and Django's ``ValidationError`` for an id that is not a UUID.
    One statement (``queries.sql``: ``lock_session_and_turn``).

    ``skip_locked``: never wait — ``None`` also when another transaction holds either row (``SKIP
    LOCKED`` on both, still session first): for callers that race for the same work and may leave a
    row to whoever holds it (``recovery.leases_take_back``, run by every worker and the sweep)."""
    _require_transaction("lock_session_and_turn")
    pk = Turn._meta.pk.to_python(turn_id)  # ValidationError for an id that is not a UUID
    with connection.cursor() as cursor:
        cursor.execute(query("lock_session_and_turn_skip_locked" if skip_locked else "lock_session_and_turn"),
                       {"turn": pk})
        return _locked_rows(cursor.fetchall())


def lock_session_and_turn_later(batch: Batch, turn_id: uuid.UUID | str) -> Later[tuple[Session, Turn] | None]:
    """``lock_session_and_turn`` as a statement batched in ``batch`` (``pipelining``): it goes to the server
    with the batch's next round trip, so statements added after it (the claim's reads, the finalize's
    rollout store) run under both locks in the same round trip. Raises ``ValidationError`` for an id that is not a UUID, ``TransactionManagementError``
    outside ``transaction.atomic``."""
    _require_transaction("lock_session_and_turn")
    pk = Turn._meta.pk.to_python(turn_id)
    return batch.add(query("lock_session_and_turn"), {"turn": pk}, convert=_locked_rows)


def _locked_rows(rows: list[tuple[Any, ...]]) -> tuple[Session, Turn] | None:
    """The session and turn of ``lock_session_and_turn``'s one row (``None``: no row)."""
    if not rows:
        return None
    split = len(Session._meta.concrete_fields)
    return instance_from_row(Session, rows[0][:split]), instance_from_row(Turn, rows[0][split:])
