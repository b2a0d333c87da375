"""Turn events: the durable rows behind the live streams (``docs/contract.md`` §8) — the only writer
of ``TurnEvent``.

Two ways in:

* ``event_append`` — inside a caller's transaction (enqueue, claim, requeue, cancel, finalize, the
  sweep): the event commits, or not, with the state change it reports.
* ``TurnEventWriter`` — the worker's writer for what codex streams during a turn (agent-message
  deltas, completed items): deltas are buffered and written in batches, each batch one short
  transaction that first takes the session's event lock, then checks the claim token (``SELECT … FOR
  SHARE`` of the turn row), so a worker that lost its claim appends nothing (I2), and waits for a
  claim in progress.

Every insert takes the session's event lock (``locks.lock_session_for_events``: the session row,
``FOR NO KEY UPDATE``) before its ids are drawn, so within a session the ids are in commit order: a
stream that has shown id N and reads ``id > N`` never skips a row that commits later with a smaller
id. It is the session row, not an advisory lock, and it is taken before the turn row, in the order of
``locks.lock_session_and_turn`` (I3): a batch taking the turn's share lock and an advisory lock
first deadlocked with a post or cancel holding the session row (its insert's foreign-key check waits
for that row). The transaction also sends
``NOTIFY hermes_turn_events, '<session id> <turn id> <last id>'`` — ids only (NOTIFY payloads are
limited to 8,000 bytes, ``../shared/pitfalls.md``); PostgreSQL delivers it at commit, and listeners
read the rows from the table. Nothing depends on the notification arriving: streams re-read on their
heartbeat tick.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction

from ..models import Turn, TurnEvent
from ..sanitize import clean_json, clean_text
from .locks import lock_session_and_turn, lock_session_for_events

logger = logging.getLogger(__name__)

#: The LISTEN/NOTIFY channel (``api/streams.py`` listens on it).
CHANNEL = "hermes_turn_events"

#: Event kinds (the SSE ``event:`` names), ``docs/contract.md`` §8.
QUEUED, RUNNING, RETRYING, THREAD, DELTA, ITEM, USAGE = "queued", "running", "retrying", "thread", "delta", "item", "usage"
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
TERMINAL_KINDS = (COMPLETED, FAILED, CANCELLED)
#: A turn's terminal status → its terminal event.
TERMINAL_KIND = {Turn.Status.SUCCEEDED: COMPLETED, Turn.Status.FAILED: FAILED, Turn.Status.CANCELLED: CANCELLED}

#: Deltas arriving within this many seconds of the last write are batched into the next one: the
#: first delta after a pause is written at once, a burst costs one transaction per window.
DELTA_FLUSH_SECONDS = 0.05
#: A batch is written once it holds this many characters, whatever the window.
DELTA_FLUSH_CHARS = 16_000


def _lock_and_notify(session_id: str, turn_id: uuid.UUID | str, last_id: int | None) -> None:
    """NOTIFY the listeners (ids only); delivered when the caller's transaction commits."""
    if connection.vendor != "postgresql" or last_id is None:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, f"{session_id} {turn_id} {last_id}"])


def _session_lock(session_id: str) -> bool:
    """The session's event lock, the only one (``locks.lock_session_for_events``, §8)."""
    return lock_session_for_events(session_id)


def event_append(*, turn: Turn, kind: str, data: dict[str, Any] | None = None) -> TurnEvent:
    """Append one event of ``turn`` (at its current ``attempt``) inside the caller's transaction
    (raises ``TransactionManagementError`` outside one) and notify the listeners at commit.
    ``data`` is the event's JSON payload (cleaned of NUL bytes and lone surrogates)."""
    _session_lock(turn.session_id)
    return event_append_session_locked(turn=turn, kind=kind, data=data)


def event_append_session_locked(*, turn: Turn, kind: str, data: dict[str, Any] | None = None) -> TurnEvent:
    """``event_append`` for a caller that has taken the session's row lock itself in this transaction,
    before any turn row (``turn_enqueue``: the UPDATE of the session that draws the turn's seq, FOR NO
    KEY UPDATE), so the event lock would be a no-op re-lock — a round trip saved. Anyone else: call
    ``event_append``."""
    event = TurnEvent(session_id=turn.session_id, turn=turn, attempt=turn.attempt, kind=kind, data=clean_json(data or {}))
    if connection.vendor != "postgresql":
        event.save(force_insert=True)
        return event
    _insert_and_notify(event)
    return event


def _insert_and_notify(event: TurnEvent) -> None:
    """INSERT ``event`` and send its NOTIFY (``_lock_and_notify``'s payload: ids only) in one statement,
    one round trip instead of two; sets ``event.pk``. PostgreSQL only."""
    meta = TurnEvent._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    values = [f.get_db_prep_save(f.pre_save(event, True), connection) for f in fields]  # pre_save: created_at
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column or f.attname) for f in fields)  # a concrete field always has its column
    sql = (f"WITH e AS (INSERT INTO {quote(meta.db_table)} ({columns}) "
           f"VALUES ({', '.join(['%s'] * len(fields))}) RETURNING id) "
           "SELECT e.id, pg_notify(%s, %s || e.id::text) FROM e")
    with connection.cursor() as cursor:
        cursor.execute(sql, [*values, CHANNEL, f"{event.session_id} {event.turn_id} "])
        event.pk = cursor.fetchone()[0]
    event._state.adding, event._state.db = False, connection.alias


def event_terminal(*, turn: Turn) -> TurnEvent:
    """The terminal event of a finished ``turn`` (``completed`` | ``failed`` | ``cancelled``) with its
    status, error and final text; inside the transaction that ends it."""
    return event_append(turn=turn, kind=TERMINAL_KIND[Turn.Status(turn.status)],
                        data={"status": turn.status, "error": turn.error, "final_text": turn.final_text})


def event_terminal_ensure(*, turn_id: uuid.UUID | str) -> TurnEvent | None:
    """Write the missing terminal event of a finished turn, durably (its own transaction; raises
    ``TransactionManagementError`` inside another), and return it; ``None`` when the turn does not
    exist, has not ended, or already has one. Turns imported by ``import_sessions`` before it wrote
    them, and turns that ended before the ``0003_turn_events`` migration, have none: a turn stream
    opened on such a turn calls this first, so it still ends with its terminal event, which gets a
    real id and a NOTIFY like any other (``docs/contract.md`` §8, "A finished turn's stream always
    ends with its terminal event").

    Locking in the one order (I3): the session row, then the turn row (``lock_session_and_turn``; two
    streams opening at once: the second waits and then finds the first one's row). Locking the turn
    first could deadlock with an API cancel of the same turn, which locks the session first."""
    with transaction.atomic(durable=True):
        try:
            locked = lock_session_and_turn(turn_id)
        except ValidationError:  # not a UUID: no such turn
            return None
        if locked is None:
            return None
        turn = locked[1]
        if turn.status not in Turn.TERMINAL or TurnEvent.objects.filter(turn_id=turn.pk, kind__in=TERMINAL_KINDS).exists():
            return None
        return event_terminal(turn=turn)


class TurnEventWriter:
    """The worker's writer of one claimed turn's streamed events (codex's deltas and completed items,
    the retry notes), fenced by the claim ``token``. Thread-safe; used as ``TurnSpec.on_event``.

    ``add(kind, data)`` buffers a ``delta`` (written once ``DELTA_FLUSH_SECONDS`` have passed since
    the last write, or ``DELTA_FLUSH_CHARS`` are buffered) and writes anything else at once, after the
    buffered deltas. ``flush()`` writes what is buffered; the execution service calls it before it
    commits the turn, so the stream's order is the order codex sent. A lost claim (``fenced``) drops
    everything from then on; a database error is logged and the batch kept for the next write: the
    stream is a view, the turn never fails for it."""

    def __init__(self, *, turn_id: uuid.UUID, session_id: str, token: uuid.UUID, attempt: int) -> None:
        self.turn_id, self.session_id, self.token, self.attempt = turn_id, session_id, token, attempt
        self.fenced = False
        self.written = 0  # events committed (for tests and timings)
        self._buffer: list[tuple[str, dict[str, Any]]] = []
        self._chars = 0
        self._last_write = 0.0
        self._lock = threading.Lock()

    def add(self, kind: str, data: dict[str, Any]) -> None:
        """Record one event of the running turn (see the class docstring)."""
        with self._lock:
            if self.fenced:
                return
            self._buffer.append((kind, data))
            if kind == DELTA:
                self._chars += len(str(data.get("text") or ""))
                due = time.monotonic() - self._last_write >= DELTA_FLUSH_SECONDS or self._chars >= DELTA_FLUSH_CHARS
                if not due:
                    return
            self._write()

    __call__ = add

    def flush(self) -> None:
        """Write whatever is buffered (one transaction)."""
        with self._lock:
            if self._buffer and not self.fenced:
                self._write()

    def _write(self) -> None:
        batch = self._buffer
        try:
            written = self._insert(batch)
        except DatabaseError:
            logger.warning("turn %s: %s stream event(s) not written yet", self.turn_id, len(batch), exc_info=True)
            connection.close()  # the next write opens a fresh connection
            return
        self._buffer, self._chars, self._last_write = [], 0, time.monotonic()
        if written is None:
            self.fenced = True
            logger.info("turn %s: claim %s no longer held; stream events dropped", self.turn_id, self.token)
        else:
            self.written += written

    def _insert(self, batch: list[tuple[str, dict[str, Any]]]) -> int | None:
        """One durable transaction: the session's event lock (the session row, first: the order of
        ``lock_session_and_turn``, I3), the claim check (turn row share lock: a claim or finalize in
        progress is waited for), the rows, one NOTIFY. ``None``: claim not held (§8)."""
        with transaction.atomic(durable=True):
            if not _session_lock(self.session_id) or not _claim_held(self.turn_id, self.token):
                return None
            rows = TurnEvent.objects.bulk_create([
                TurnEvent(session_id=self.session_id, turn_id=self.turn_id, attempt=self.attempt, kind=kind,
                          data=clean_json(_clean_data(data)))
                for kind, data in batch
            ])
            _lock_and_notify(self.session_id, self.turn_id, rows[-1].pk if rows else None)
            return len(rows)


def _clean_data(data: dict[str, Any]) -> dict[str, Any]:
    if "text" in data:
        return {**data, "text": clean_text(data["text"])}
    return data


def _claim_held(turn_id: uuid.UUID, token: uuid.UUID) -> bool:
    """Whether ``token`` still holds the running turn, read under ``FOR SHARE`` of the turn row: it
    conflicts with the ``FOR UPDATE`` that claim, requeue, finalize and the sweep take, so a write
    either happens before a take-back commits or sees it (and is dropped)."""
    if connection.vendor != "postgresql":
        return Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).exists()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT 1 FROM {Turn._meta.db_table} WHERE id = %s AND claim_token = %s AND status = %s FOR SHARE",
            [turn_id, token, Turn.Status.RUNNING],
        )
        return cursor.fetchone() is not None
