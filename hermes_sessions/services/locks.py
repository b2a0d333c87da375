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

from django.db import connection
from django.db.transaction import TransactionManagementError

from ..models import Session, Turn


def _require_transaction(what: str) -> None:
    if not connection.in_atomic_block:
        # Outside atomic the lock would end with its own statement: it would protect nothing.
        raise TransactionManagementError(f"{what} must run inside transaction.atomic")


def advisory_xact_lock(name: str) -> None:
    """Take a PostgreSQL transaction-scoped advisory lock named by ``name`` (sha256 → 64-bit key),
    held until the transaction ends. A no-op on other databases (SQLite serializes writers anyway).
    Raises ``TransactionManagementError`` outside ``transaction.atomic``."""
    _require_transaction("advisory_xact_lock")
    if connection.vendor != "postgresql":
        return
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


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


def lock_session_and_turn(turn_id: uuid.UUID | str) -> tuple[Session, Turn] | None:
    """Lock the turn's session row, then the turn row (``SELECT … FOR UPDATE``), and return both,
    freshly read; ``None`` when the turn does not exist. Raises ``TransactionManagementError``
    outside ``transaction.atomic``, and Django's ``ValidationError`` for an id that is not a UUID."""
    _require_transaction("lock_session_and_turn")
    found = Turn.objects.filter(pk=turn_id).only("session_id").first()
    if found is None:
        return None
    session = Session.objects.select_for_update().get(pk=found.session_id)
    turn = Turn.objects.select_for_update().get(pk=turn_id)
    return session, turn
