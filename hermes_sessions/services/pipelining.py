"""One transaction's statements sent to PostgreSQL together: psycopg 3's pipeline mode, with the
transaction's ``BEGIN`` and ``COMMIT`` travelling in the first and last batch.

Why: a warm turn's three transactions (the POST's enqueue, the worker's claim, its finalize) were
5–7 round trips each — ``BEGIN``, a statement per step, ``COMMIT`` — and on a loaded 2-core host each
round trip costs ~0.3–0.5 ms of wake-ups (PostgreSQL's log of a warm turn, ``make bench-warm``), most
of what the stack adds over codex. Queued statements that do not need each other's results in Python
go in one round trip; the server still runs them one after another, in order, in the transaction.

Use::

    with pipelined_atomic(durable=True) as batch:
        lock = batch.add(sql, params)          # batched, not sent yet
        reads = batch.add(sql2, params2)
        row = lock.one()                       # sends BEGIN, both statements and a Sync: one round trip
        batch.add(write_sql, write_params)     # batched …
    # … and sent with the COMMIT: one round trip; then Django's on_commit callbacks run

Rules that keep it safe, enforced here rather than left to callers:

* **Order.** Any other statement run on the connection while statements wait in a batch (an ORM query, a
  raw cursor) first sends the batched ones (a Django ``execute_wrapper``), so statements always reach
  the server in program order.
* **Row counts.** psycopg knows a statement's row count only once its results arrived (in pipeline
  mode ``rowcount`` is -1 right after ``execute``; an ORM ``save(update_fields=…)`` would raise). Only
  statements added with ``batch.add`` are pipelined, and their ``Later`` results are read after the
  round trip; everything else runs as usual.
* **Errors.** A failing statement fails its round trip: the error is raised where the batch was sent
  (a ``Later`` read, another statement, or the block's end) and Django's ``atomic`` rolls back; a
  COMMIT never runs after a failed statement (PostgreSQL answers ``ROLLBACK`` to it).
* **Only the outermost transaction commits here.** Inside another ``atomic`` block (a test's, a
  caller's), the block is a plain ``transaction.atomic`` and ``add`` runs each statement at once.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from django.conf import settings
from django.db import connection, transaction

T = TypeVar("T")


class Later(Generic[T]):
    """The result of a statement added to a ``Batch``, read once its round trip is done. ``one()`` /
    ``all()`` / ``rowcount`` / ``get()`` send the batch first when it is still unsent. ``convert`` turns
    the fetched rows (a list of tuples) into the value ``get()`` returns."""

    def __init__(self, batch: Batch | None, convert: Callable[[list[tuple[Any, ...]]], T] | None = None,
                 *, value: Any = None) -> None:
        self._batch = batch
        self._convert = convert
        self._rows: list[tuple[Any, ...]] | None = None
        self._rowcount = -1
        self._value = value
        self._done = batch is None

    @classmethod
    def ready(cls, value: T) -> Later[T]:
        """A value already known (the same interface on paths that need no statement)."""
        return cls(None, value=value)

    def _resolve(self) -> None:
        if not self._done:
            assert self._batch is not None
            self._batch.send()
        assert self._done, "a statement's result was read after its batch failed"

    def _set(self, rows: list[tuple[Any, ...]] | None, rowcount: int) -> None:
        self._rows, self._rowcount, self._done = rows, rowcount, True
        if self._convert is not None:
            self._value = self._convert(rows or [])

    def get(self) -> T:
        """The converted value (``convert(rows)``), or the value of ``ready``."""
        self._resolve()
        return self._value

    def one(self) -> tuple[Any, ...] | None:
        """The statement's first row, ``None`` when it returned none (or returns no rows)."""
        self._resolve()
        return self._rows[0] if self._rows else None

    def all(self) -> list[tuple[Any, ...]]:
        self._resolve()
        return list(self._rows or [])

    @property
    def rowcount(self) -> int:
        """Rows the statement returned or changed (psycopg's ``rowcount``)."""
        self._resolve()
        return self._rowcount


class Batch:
    """Statements batched for one round trip (see the module docstring). ``pipelined``: False on other
    databases and inside another transaction — then ``add`` runs each statement at once."""

    def __init__(self, *, pipelined: bool) -> None:
        self.pipelined = pipelined
        self._unsent: list[tuple[str, Sequence[Any] | dict[str, Any], Later[Any]]] = []
        self._sending = False
        self.round_trips = 0  # batches sent (tests and the bench read it)

    def add(self, sql: str, params: Sequence[Any] | dict[str, Any] = (),
            convert: Callable[[list[tuple[Any, ...]]], T] | None = None) -> Later[T]:
        """Hold ``sql`` (a single statement; ``%s`` / ``%(name)s`` parameters as Django's cursors take
        them) for the next round trip; its ``Later`` result."""
        later: Later[T] = Later(self, convert)
        self._unsent.append((sql, params, later))
        if not self.pipelined:
            self.send()
        return later

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def send(self, *, commit: bool = False) -> None:
        """Send what is batched (and ``COMMIT`` after it when ``commit``) in one round trip and set each
        statement's ``Later``. Raises the first failing statement's error as Django's database exceptions
        (``IntegrityError``, ``OperationalError``, …), as a statement run alone would."""
        if not self._unsent and (not commit or _idle()):
            return  # nothing to send; a transaction that never began has nothing to commit
        unsent, self._unsent = self._unsent, []
        self._sending = True
        try:
            if self.pipelined:
                self._send_pipelined(unsent, commit=commit)
                return
            for sql, params, later in unsent:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    later._set(_rows(cursor), cursor.rowcount)
        finally:
            self._sending = False

    def _send_pipelined(self, unsent: list[tuple[str, Sequence[Any] | dict[str, Any], Later[Any]]], *,
                        commit: bool) -> None:
        raw = connection.connection
        # The transaction's first statements: in its default mode psycopg would send its own BEGIN followed by
        # a Sync of its own (psycopg 3.3 ``Connection._start_query`` in pipeline mode), one more round trip;
        # this BEGIN goes with them instead. psycopg's public ``autocommit`` (settable while no transaction is
        # open, no round trip) is turned on for that and stays on to the block's end: psycopg's commit and
        # rollback act on the server's transaction status, not on this flag, and the outermost ``atomic``
        # sets it again on exit (``set_autocommit(True)``). tests/services/test_query_counts.py and
        # tests/services/test_pipelining.py pin the round trips and the rollback.
        begin = _idle()
        texts: list[tuple[str, Sequence[Any] | dict[str, Any]]] = [("BEGIN", ())] if begin else []
        texts += [(sql, params) for sql, params, _later in unsent]
        texts += [("COMMIT", ())] if commit else []
        cursors = []
        try:
            if begin:
                raw.autocommit = True
            # Errors surface when the pipeline ends, outside the cursors' own wrapping: wrapped here.
            with connection.wrap_database_errors, _server_binding(raw), raw.pipeline():
                for sql, params in texts:
                    cursor = connection.cursor()
                    cursors.append(cursor)
                    cursor.execute(sql, params)
            self.round_trips += 1
            for cursor, (_sql, _params, later) in zip(cursors[1:] if begin else cursors, unsent, strict=False):
                later._set(_rows(cursor), cursor.rowcount)
        finally:
            for cursor in cursors:
                cursor.close()

    def _before_other(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        """Django ``execute_wrapper``: a statement not in the batch first sends what the batch has unsent."""
        if self._unsent and not self._sending:
            self.send()
        return execute(sql, params, many, context)


@contextmanager
def _server_binding(raw: Any) -> Iterator[None]:
    """Within the block, Django's cursors (``connection.cursor()``: ``connection.queries``, ``execute_wrapper``
    and the error wrapping see their statements) bind their parameters server-side — psycopg's public
    ``cursor_factory``, set back after — on ``raw`` with ``DATABASE_PREPARE_THRESHOLD`` set: the batch's
    statements, the same texts on every turn, are prepared there after that many runs instead of parsed
    and planned each time (Django's own cursors bind client-side, inlining the values: every text differs,
    psycopg's ``ClientCursor`` never prepares). 0: server-side binding, nothing prepared."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    threshold = settings.DATABASE_PREPARE_THRESHOLD or None
    if raw.prepare_threshold != threshold:
        raw.prepare_threshold = threshold
    factory, raw.cursor_factory = raw.cursor_factory, ServerBindingCursor
    try:
        yield
    finally:
        raw.cursor_factory = factory


def _idle() -> bool:
    """No transaction open on the connection (psycopg's view of the server's last status)."""
    from psycopg import pq

    return bool(connection.connection.info.transaction_status == pq.TransactionStatus.IDLE)


def _rows(cursor: Any) -> list[tuple[Any, ...]] | None:
    return cursor.fetchall() if cursor.description is not None else None


@contextmanager
def pipelined_atomic(*, durable: bool = False) -> Iterator[Batch]:
    """``transaction.atomic(durable=durable)`` with a ``Batch``: as the outermost block,
    batched statements go in round trips of their own and the block's last ones carry the ``COMMIT``
    (Django's commit then finds the transaction closed and runs the ``on_commit`` callbacks). Raises
    what ``atomic`` raises (``RuntimeError`` for ``durable`` inside another block) and the database
    errors of the statements."""
    outermost = not connection.in_atomic_block
    with transaction.atomic(durable=durable):
        batch = Batch(pipelined=outermost)
        if not batch.pipelined:
            yield batch
            batch.send()
            return
        with connection.execute_wrapper(batch._before_other):
            yield batch
        if connection.needs_rollback:
            return  # an inner atomic failed and was caught: atomic's exit rolls back, never commit here
        batch.send(commit=True)
