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
heartbeat tick. The lock, the claim check, the insert and the NOTIFY are one statement
(``queries.sql``: ``events_append``), in that order.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from ..models import Turn, TurnEvent
from ..sanitize import clean_json, clean_text
from ..sql import query
from .locks import lock_session_and_turn
from .pipelining import Batch, Later

logger = logging.getLogger(__name__)

#: The LISTEN/NOTIFY channel (``api/streams.py`` listens on it).
CHANNEL = "hermes_turn_events"

#: Event kinds (the SSE ``event:`` names), ``docs/contract.md`` §8.
QUEUED, RUNNING, RETRYING, THREAD, DELTA, ITEM, USAGE = "queued", "running", "retrying", "thread", "delta", "item", "usage"
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
TERMINAL_KINDS = (COMPLETED, FAILED, CANCELLED)
#: A turn's terminal status → its terminal event.
TERMINAL_KIND = {Turn.Status.SUCCEEDED: COMPLETED, Turn.Status.FAILED: FAILED, Turn.Status.CANCELLED: CANCELLED}

#: A streamed delta or item is written at most this many seconds after codex sent it, with everything
#: else that arrived meanwhile (one transaction per window); what is still buffered when the turn ends
#: commits in the turn's finalize transaction instead, before its last events (``take_pending``). A short
#: turn thus costs no stream transaction at all: on this 2-core machine each one, with the API's read
#: and send that its NOTIFY wakes, took ~10 ms from codex's own turn (``make bench-warm``).
DELTA_FLUSH_SECONDS = 0.05
#: A batch is written once it holds this many characters, whatever the window.
DELTA_FLUSH_CHARS = 16_000


def event_append(*, turn: Turn, kind: str, data: dict[str, Any] | None = None, notify: bool = True) -> TurnEvent:
    """Append one event of ``turn`` (at its current ``attempt``) inside the caller's transaction
    (raises ``TransactionManagementError`` outside one) and notify the listeners at commit.
    ``data`` is the event's JSON payload (cleaned of NUL bytes and lone surrogates). One statement:
    the session's event lock, the insert and the NOTIFY (``_insert_events``). ``notify``
    False: no NOTIFY in the transaction — the caller sends it later (``event_notify_on_commit``)."""
    (event,) = event_append_many(turn=turn, items=[(kind, data)], notify=notify)
    return event


def event_notify_on_commit(event: TurnEvent | BatchedEvents) -> None:
    """Once the current transaction commits (and after the commit callbacks registered before this
    one), wake the listeners for ``event``, written with ``notify=False``: one ``pg_notify`` of its own.
    The two-trip enqueue (``turns._enqueue``: ``on_busy=reject``, or inside a caller's transaction) sends
    the ``queued`` event's wake-up after the turn's task: the API process's own event-stream read it
    triggers then does not compete with that send (~2 ms of a warm turn on 2 cores, ``make bench-warm``);
    the one-trip enqueue sends it with its COMMIT instead (``turns._enqueue_in_one_trip``). If it cannot be sent, nothing is lost — streams re-read on their heartbeat.
    ``event``: a written event, or ``event_append_batched``'s events (their last id, read after the commit)."""

    def send() -> None:
        last = event.pk if isinstance(event, TurnEvent) else event.last_id()
        payload = f"{event.session_id} {event.turn_id} {last if last is not None else ''}".rstrip()
        try:
            with connection.cursor() as cursor:
                cursor.execute(query("notify"), [CHANNEL, payload])
        except DatabaseError:
            logger.warning("event %s of turn %s: the wake-up NOTIFY could not be sent; streams re-read on their "
                           "heartbeat", last, event.turn_id, exc_info=True)

    transaction.on_commit(send)


@dataclass(frozen=True)
class BatchedEvents:
    """Events written by a statement batched in a ``pipelining.Batch`` (``event_append_batched``): their ids
    are known once its round trip is done."""

    session_id: str
    turn_id: uuid.UUID
    ids: Later[list[int] | None]

    def last_id(self) -> int | None:
        """The newest event's id (``None``: nothing was written)."""
        ids = self.ids.get()
        return ids[-1] if ids else None


def event_append_many(*, turn: Turn, items: Sequence[tuple[str, dict[str, Any] | None]],
                      notify: bool = True) -> list[TurnEvent]:
    """``event_append`` of several events of ``turn`` at once, ids in the order of ``items`` (one
    insert and one NOTIFY: the finalize's ``thread``, ``usage`` and terminal events)."""
    if not connection.in_atomic_block:
        raise TransactionManagementError("event_append runs inside the transaction of the change it reports")
    rows = [(kind, clean_json(data or {})) for kind, data in items]
    now = timezone.now()
    ids = _insert_events(turn.session_id, turn.pk, turn.attempt, rows, now=now, notify=notify)
    if ids is None:  # no such session (the caller holds its turn: it cannot happen)
        raise IntegrityError(f"session {turn.session_id} of turn {turn.pk} does not exist; no event written")
    made = []
    for pk, (kind, data) in zip(ids, rows, strict=True):
        event = TurnEvent(id=pk, session_id=turn.session_id, turn=turn, attempt=turn.attempt, kind=kind, data=data,
                          created_at=now)
        event._state.adding, event._state.db = False, connection.alias
        made.append(event)
    return made


def event_terminal(*, turn: Turn) -> TurnEvent:
    """The terminal event of a finished ``turn`` (``completed`` | ``failed`` | ``cancelled``) with its
    status, error and final text; inside the transaction that ends it."""
    kind, data = terminal_item(turn)
    return event_append(turn=turn, kind=kind, data=data)


def terminal_item(turn: Turn) -> tuple[str, dict[str, Any]]:
    """``(kind, data)`` of ``turn``'s terminal event (``event_terminal``), for ``event_append_many``."""
    return TERMINAL_KIND[Turn.Status(turn.status)], {"status": turn.status, "error": turn.error,
                                                     "final_text": turn.final_text}


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
    the retry notes), fenced by the claim ``token``. Thread-safe; ``add`` is ``TurnSpec.on_event`` and
    ``tick`` its ``on_tick`` (``codex/runner.py``: called on the reading thread between notifications).

    ``add(kind, data)`` buffers a ``delta`` or ``item``: ``tick`` writes the buffer once the oldest of it
    is ``DELTA_FLUSH_SECONDS`` old (or at once past ``DELTA_FLUSH_CHARS``); anything else (a retry note)
    is written at once, after the buffered events. At the end of a turn that reached ``turn/completed``
    the execution service takes what is still buffered (``take_pending``) into the finalize transaction,
    which writes it before the turn's last events; on every other end it calls ``flush()``, which writes
    it now. So the stream's order is the order codex sent. A lost claim (``fenced``) drops everything from
    then on; a database error is logged and the batch kept for the next write: the stream is a view, the
    turn never fails for it."""

    def __init__(self, *, turn_id: uuid.UUID, session_id: str, token: uuid.UUID, attempt: int) -> None:
        self.turn_id, self.session_id, self.token, self.attempt = turn_id, session_id, token, attempt
        self.fenced = False
        self.written = 0  # events committed (for tests and timings)
        self._buffer: list[tuple[str, dict[str, Any]]] = []
        self._chars = 0
        self._due = 0.0  # monotonic time by which the buffer is to be written (0: empty)
        self._lock = threading.Lock()

    def add(self, kind: str, data: dict[str, Any]) -> None:
        """Record one event of the running turn (see the class docstring)."""
        with self._lock:
            if self.fenced:
                return
            self._buffer.append((kind, data))
            if kind in (DELTA, ITEM):
                self._chars += len(str(data.get("text") or ""))
                self._due = self._due or time.monotonic() + DELTA_FLUSH_SECONDS
                if self._chars < DELTA_FLUSH_CHARS:
                    return
            self._write()

    __call__ = add

    def tick(self) -> float | None:
        """Write the buffer if it is due; seconds until it will be (``None``: nothing buffered)."""
        with self._lock:
            if not self._buffer or self.fenced:
                return None
            left = self._due - time.monotonic()
            if left > 0:
                return left
            self._write()
            return None if not self._buffer else DELTA_FLUSH_SECONDS  # a failed write is tried again

    def flush(self) -> None:
        """Write whatever is buffered (one transaction)."""
        with self._lock:
            if self._buffer and not self.fenced:
                self._write()

    def take_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """What is buffered and not written — ``(kind, data)`` in codex's order, ``data`` cleaned as a write
        cleans it — handed to the caller (the finalize transaction writes it); the buffer is emptied."""
        with self._lock:
            batch = [] if self.fenced else [(kind, _clean_data(data)) for kind, data in self._buffer]
            self._buffer, self._chars, self._due = [], 0, 0.0
            return batch

    def _write(self) -> None:
        batch = self._buffer
        try:
            written = self._insert(batch)
        except DatabaseError:
            logger.warning("turn %s: %s stream event(s) not written yet", self.turn_id, len(batch), exc_info=True)
            connection.close()  # the next write opens a fresh connection
            return
        self._buffer, self._chars, self._due = [], 0, 0.0
        if written is None:
            self.fenced = True
            logger.info("turn %s: claim %s no longer held; stream events dropped", self.turn_id, self.token)
        else:
            self.written += written

    def _insert(self, batch: list[tuple[str, dict[str, Any]]]) -> int | None:
        """One durable transaction: the session's event lock (the session row, first: the order of
        ``lock_session_and_turn``, I3), the claim check (turn row share lock: a claim or finalize in
        progress is waited for), the rows, one NOTIFY — one statement
        (``_insert_events``). ``None``: claim not held (§8)."""
        with transaction.atomic(durable=True):
            ids = _insert_events(self.session_id, self.turn_id, self.attempt,
                                 [(kind, clean_json(_clean_data(data))) for kind, data in batch],
                                 now=timezone.now(), token=self.token)
            return None if ids is None else len(ids)


def _insert_events(session_id: str, turn_id: uuid.UUID | str, attempt: int, rows: list[tuple[str, Any]], *,
                   now: datetime, token: uuid.UUID | None = None, notify: bool = True) -> list[int] | None:
    """Insert ``rows`` (``(kind, cleaned data)``) as events of the turn, in order, inside the caller's
    transaction, under the session's event lock (``locks.lock_session_for_events``), and NOTIFY their
    last id. With ``token``: only while that claim holds the running turn. Returns the
    new ids, or ``None`` when nothing was written (claim not held, or no such session)."""
    if not rows:
        return []
    with connection.cursor() as cursor:
        cursor.execute(*_events_statement(session_id, turn_id, attempt, rows, now=now, token=token, notify=notify))
        found = cursor.fetchone()
    return None if found is None else list(found[0])


def event_append_batched(batch: Batch, *, turn: Turn, items: Sequence[tuple[str, dict[str, Any] | None]],
                         notify: bool = True, drawn_seq: bool = False) -> BatchedEvents:
    """``event_append_many`` as a statement batched in ``batch`` (``pipelining``): it goes with
    the batch's next round trip (the claim's and the finalize's: the one carrying the COMMIT), and its
    ids are read from the result afterwards. For writers that hold the session lock already (the
    enqueue, the claim, the finalize). Raises
    ``TransactionManagementError`` outside a transaction.

    ``drawn_seq``: ``items`` is the one-trip enqueue's ``queued`` event, whose data (``{"seq": …}``) is read
    from the turn row inserted before it in the same round trip (``queries.sql``: ``events_append_queued``)."""
    if not connection.in_atomic_block:
        raise TransactionManagementError("event_append runs inside the transaction of the change it reports")
    rows = [(kind, clean_json(data or {})) for kind, data in items]
    if not rows:
        return BatchedEvents(turn.session_id, turn.pk, Later.ready([]))
    statement = _events_statement(turn.session_id, turn.pk, turn.attempt, rows, now=timezone.now(), notify=notify,
                                  drawn_seq=drawn_seq)
    return BatchedEvents(turn.session_id, turn.pk, batch.add(*statement, convert=_event_ids))


def _event_ids(rows: list[tuple[Any, ...]]) -> list[int] | None:
    return list(rows[0][0]) if rows else None


def event_append_claimed_batched(batch: Batch, *, turn_id: uuid.UUID, token: uuid.UUID,
                              items: Sequence[tuple[str, dict[str, Any] | None]]) -> Later[list[int] | None]:
    """``event_append_batched`` for a claim whose writes travel in the same round trip (``turns._claim_in_one_trip``):
    the events are written only if claim ``token`` holds the running turn once the statements
    before it have run — nothing when the claim did not happen — in the turn's session and at its ``attempt``
    as the claim set it (both read from the turn row: the caller knows neither before the round trip). Their
    ids once the round trip is done (``None``: nothing written)."""
    rows = [(kind, clean_json(data or {})) for kind, data in items]
    statement = _events_statement("", turn_id, 0, rows, now=timezone.now(), token=token, attempt_of_claim=True)
    return batch.add(*statement, convert=_event_ids)


def _events_statement(session_id: str, turn_id: uuid.UUID | str, attempt: int, rows: list[tuple[str, Any]], *,
                      now: datetime, token: uuid.UUID | None = None, notify: bool = True,
                      attempt_of_claim: bool = False, drawn_seq: bool = False) -> tuple[str, dict[str, Any]]:
    """``_insert_events``'s statement and its parameters: one of ``queries.sql``'s ``events_append*``, its
    ``{values}`` the rows' placeholders. One round trip where the ORM needs four (the lock, the claim check,
    the insert, the NOTIFY), each compiled. ``token``: only while that claim holds the running turn
    (``events_append_claimed``); ``attempt_of_claim`` (with ``token``): the session and attempt are the
    claimed turn row's (``events_append_of_claim``); ``notify`` False: no NOTIFY (``events_append``'s
    ``%(notify)s``); ``drawn_seq``: the one-trip enqueue's ``queued`` event
    (``events_append_queued``, one row)."""
    json_field = TurnEvent._meta.get_field("data")  # the ORM's adaptation of the jsonb value (no SQL)
    params: dict[str, Any] = {"session": session_id, "turn": turn_id, "attempt": attempt, "now": now,
                              "token": token, "running": Turn.Status.RUNNING, "channel": CHANNEL,
                              "prefix": f"{session_id} {turn_id} ", "turn_part": f" {turn_id} ", "notify": notify}
    if drawn_seq:
        assert len(rows) == 1 and token is None and notify
        params["k0"] = rows[0][0]
        return query("events_append_queued"), params
    values = []
    for i, (kind, data) in enumerate(rows):
        params[f"k{i}"], params[f"d{i}"] = kind, json_field.get_db_prep_value(data, connection)
        values.append(f"({i}, %(k{i})s, %(d{i})s::jsonb)")
    if token is None:
        name = "events_append"
    else:
        assert notify  # a claimed write always notifies
        name = "events_append_of_claim" if attempt_of_claim else "events_append_claimed"
    return query(name).replace("{values}", ", ".join(values)), params


def _clean_data(data: dict[str, Any]) -> dict[str, Any]:
    if "text" in data:
        return {**data, "text": clean_text(data["text"])}
    return data
