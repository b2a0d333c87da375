"""The API process's one LISTEN connection, shared by every open event stream (``api/streams.py``).

Workers on any host write ``TurnEvent`` rows and ``NOTIFY hermes_turn_events, '<session> <turn> <id>'``
in the same transaction (``services/events.py``). This hub holds one LISTEN connection per process (per
event loop: a ``listener.Listener`` run as a task on the loop) on that channel while at least one stream
is open; on a notification it reads the session's new rows from the table once and hands them to every
open stream of that session (one query per batch however many streams watch it). The connection is
opened on the first subscriber and closed explicitly, in its own task, when the last one leaves (under
ASGI, connections left to garbage collection leak — ``../shared/pitfalls.md``, Django #37066). A lost
connection (``pg_terminate_backend``, a database restart) is opened again within a second, and after
every (re)connect the hub reads every watched session from its cursor: what committed meanwhile was
notified to nobody.

The hub's reads run on the event loop, on a second connection of its own opened with the LISTEN one (a
query on the LISTEN connection would wait for its ``notifies()``), as one SQL statement: no thread
hop, no pool checkout, no ORM compile. On the 2-core development machine that took ~2 ms off the
moment a turn's end reaches its watchers and stopped the hub's read of a turn's ``queued`` event from
slowing the ``POST`` that wrote it (whose Celery send runs right after the commit). Without that
connection (lost, not yet open) the hub reads as the streams do, in a thread.

A notification nobody listened for is not lost: a stream reads the table from its last id before it
waits, the hub re-reads at each reconnect, and each stream reads again on every heartbeat tick, so
NOTIFY is only a wake-up. While the LISTEN connection cannot be opened (a database restart),
streams fall back to those ticks; the listener tries again every second.

Shutdown: the hub chains itself in front of the process's SIGTERM/SIGINT handlers (uvicorn's own),
and on either sets ``stopping``; open streams then end at once, so the server's graceful shutdown does
not wait on them (uvicorn waits for open responses; gunicorn would kill the worker after its
``graceful_timeout``). Clients reconnect with ``Last-Event-ID`` and lose nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import psycopg
from asgiref.sync import sync_to_async
from django.db import DatabaseError, connection
from psycopg.rows import dict_row

from .. import selectors
from ..latency_marks import mark
from ..listener import Listener, connection_params
from ..services.events import CHANNEL
from ..sql import query

logger = logging.getLogger(__name__)

LISTEN_CONNECT_SECONDS = 5.0
#: Rows read per query; a longer backlog is read in several.
READ_PAGE = 500
#: The columns a stream sends (``streams._frame``).
ROW_FIELDS = ("id", "turn_id", "attempt", "kind", "data")
T = TypeVar("T")
#: What a read raises when the database cannot serve it (a restart, an exhausted pool: psycopg_pool's
#: ``PoolTimeout`` is a ``psycopg.OperationalError``); streams outlive these.
DATABASE_ERRORS = (DatabaseError, psycopg.Error)


def _close_after(read: Callable[..., T]) -> Callable[..., T]:
    """``read``, closing this thread's database connection afterwards (returned to the pool, or
    closed): nothing in the streaming machinery keeps a connection while it waits."""
    def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return read(*args, **kwargs)
        finally:
            connection.close()
    return wrapped


async def in_thread(read: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the synchronous database read ``read`` in a worker thread (not the request's: an open stream
    must not pin one), its connection closed afterwards."""
    return await sync_to_async(_close_after(read), thread_sensitive=False)(*args, **kwargs)


def _session_rows(session_id: str, after: int) -> list[dict[str, Any]]:
    found = selectors.turn_events_after(after_id=after, limit=READ_PAGE, session_id=session_id)
    return [dict(row) for row in found.values(*ROW_FIELDS)]


@dataclass(eq=False)
class Subscription:
    """One open stream's inbox: ``rows`` the hub read for its session (oldest first, shared dicts),
    ``wake`` set whenever rows arrive, ``reread`` when the hub could not read (read the table yourself)."""

    session_id: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    rows: list[dict[str, Any]] = field(default_factory=list)
    reread: bool = False

    def take(self) -> list[dict[str, Any]]:
        rows, self.rows = self.rows, []
        return rows


class EventHub:
    """Wake-ups and shared reads for the open streams of one event loop.

    ``subscribe(session_id)`` returns a ``Subscription``; ``unsubscribe`` must follow (in a ``finally``).
    On a notification for a session, the hub reads that session's new rows once — from its cursor, the
    highest id it has read — and hands them to every stream of the session: 200 streams of one session
    cost one query per batch, not 200 (``make bench-streams``). Reads of one session are coalesced (one
    at a time; a notification during a read triggers one more). ``stopping`` is set at shutdown."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stopping = asyncio.Event()
        self._subscribers: dict[str, set[Subscription]] = {}
        self._cursor: dict[str, int] = {}
        self._reading: set[str] = set()
        self._dirty: set[str] = set()
        self._count = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._listener: Listener | None = None
        self._reader: psycopg.AsyncConnection[dict[str, Any]] | None = None

    @property
    def open_streams(self) -> int:
        """Streams subscribed right now."""
        return self._count

    async def subscribe(self, session_id: str) -> Subscription:
        """Register a stream of ``session_id`` and make sure the LISTEN is in place before it returns:
        rows committed after it returns reach the subscription; the stream reads older ones itself."""
        sub = Subscription(session_id)
        self._subscribers.setdefault(session_id, set()).add(sub)
        self._count += 1
        try:
            if session_id not in self._cursor:
                # Rows up to here committed before the stream's own first read, which will find them.
                try:
                    newest = await in_thread(lambda: selectors.session_last_event_id(session_id=session_id))
                except DATABASE_ERRORS as exc:
                    # No cursor: the hub leaves the session alone until a stream's own read succeeds
                    # (``reads_from``); the stream reads on its heartbeat meanwhile.
                    logger.warning("event streams: session %s's newest event could not be read: %s", session_id, exc)
                else:
                    self._cursor.setdefault(session_id, newest)
            await self.ensure_listening()
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    def reads_from(self, session_id: str, after: int) -> None:
        """A stream of ``session_id`` read every row up to ``after``: the hub's reads of the session start
        there if they had no start yet (``subscribe`` could not read the newest id)."""
        if session_id in self._subscribers:
            self._cursor.setdefault(session_id, after)

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget a stream; the last one out closes the LISTEN connection. Synchronous, so that it
        runs in full even from a ``finally`` of a cancelled stream."""
        waiting = self._subscribers.get(sub.session_id)
        if waiting is not None and sub in waiting:
            waiting.discard(sub)
            self._count -= 1
            if not waiting:
                del self._subscribers[sub.session_id]
                self._cursor.pop(sub.session_id, None)
        if self._count == 0 and self._task is not None:
            self._task.cancel()  # the listener closes its connection, the task's finally the reader
            self._task, self._listener = None, None

    @property
    def listening(self) -> bool:
        """Whether the hub's ``LISTEN`` is in place now."""
        return self._listener is not None and self._listener.listening.is_set()

    async def ensure_listening(self) -> None:
        """Start the listener task if none runs (first stream, or it ended) and wait until its LISTEN is
        in place or its first attempt failed (at most ``LISTEN_CONNECT_SECONDS``). The task reconnects by
        itself within a second of a loss (``listener.py``'s rule) and re-reads every watched session then."""
        if self.stopping.is_set():
            return
        if self._task is None or self._task.done():
            ready = self._ready = asyncio.Event()
            self._listener = Listener(CHANNEL, name="hermes-sse-listener", on_notify=self._notified,
                                      on_connect=functools.partial(self._connected, ready), on_down=ready.set)
            self._task = self.loop.create_task(self._listen(self._listener), name="hermes-sse-listener")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), LISTEN_CONNECT_SECONDS)

    async def _listen(self, listener: Listener) -> None:
        """The listener task: ``listener.run()`` until cancelled (the last stream left), then the reader
        connection is closed too (the LISTEN one ``run`` closes itself)."""
        try:
            await listener.run()
        except Exception:  # noqa: BLE001 — a stream's next heartbeat tick starts the task again
            logger.exception("event streams: the LISTEN task ended; streams re-read on their heartbeat")
        finally:
            reader, self._reader = self._reader, None
            if reader is not None:
                await reader.close()

    async def _connected(self, ready: asyncio.Event) -> None:
        """After every (re)connect of the LISTEN: open the reader (now, not at the first notification),
        then read every watched session from its cursor — rows committed while no connection listened
        were notified to nobody (``tests/api/test_event_streams.py::test_an_event_committed_while_the_listen_connection_was_down_is_read_at_the_reconnect``).
        One read per session, however many streams watch it; a session without a cursor yet has its
        streams read for themselves."""
        await self._open_reader()
        ready.set()
        for session_id, waiting in list(self._subscribers.items()):
            if session_id in self._cursor:
                self._read(session_id)
            else:
                for sub in waiting:
                    sub.reread = True
                    sub.wake.set()

    def _notified(self, payload: str) -> None:
        """``'<session> <turn> <last id>'``: read the session's new rows unless already read."""
        mark("hub.notified", payload.split(" ")[1] if payload.count(" ") >= 2 else "-")
        session_id, _, last = payload.partition(" ")
        if session_id not in self._cursor:
            return  # nobody listens, or its first stream is still subscribing (its own read comes after)
        last_id = last.rpartition(" ")[2]
        if last_id.isdigit() and int(last_id) <= self._cursor.get(session_id, 0):
            return
        self._read(session_id)

    def _read(self, session_id: str) -> None:
        """Read ``session_id``'s new rows for its streams, coalesced: one read at a time per session,
        and a request during a read makes it read once more."""
        if session_id in self._reading:
            self._dirty.add(session_id)
            return
        self._reading.add(session_id)
        self.loop.create_task(self._read_session(session_id))

    async def _read_session(self, session_id: str) -> None:
        try:
            while session_id in self._cursor:
                self._dirty.discard(session_id)
                rows = await self._rows(session_id, self._cursor[session_id])
                if rows and session_id in self._cursor:
                    self._cursor[session_id] = rows[-1]["id"]
                    for sub in self._subscribers.get(session_id, ()):
                        sub.rows.extend(rows)
                        sub.wake.set()
                if len(rows) < READ_PAGE and session_id not in self._dirty:
                    return
        except DATABASE_ERRORS:
            logger.warning("event streams: reading session %s failed; its streams read themselves", session_id,
                           exc_info=True)
            for sub in self._subscribers.get(session_id, ()):
                sub.reread = True
                sub.wake.set()
        finally:
            self._reading.discard(session_id)

    async def _rows(self, session_id: str, after: int) -> list[dict[str, Any]]:
        """The session's rows after ``after`` (at most ``READ_PAGE``): on the hub's reader connection
        when it is open, else in a thread through the ORM. Raises ``psycopg.Error`` / ``DatabaseError``."""
        reader = await self._open_reader()
        if reader is None:
            return await in_thread(_session_rows, session_id, after)
        cursor = await reader.execute(query("turn_events_after"), (session_id, after, READ_PAGE))
        return await cursor.fetchall()

    async def _open_reader(self) -> psycopg.AsyncConnection[dict[str, Any]] | None:
        """The hub's reader connection, opened (again, after a loss) only while the hub listens — its
        listener task closes it — else ``None``."""
        if self._reader is not None and not self._reader.closed:
            return self._reader
        if not self.listening:
            return None
        try:
            reader = await psycopg.AsyncConnection.connect(
                **connection_params("hermes-sse-reader"), autocommit=True,
                row_factory=dict_row, connect_timeout=int(LISTEN_CONNECT_SECONDS))
        except psycopg.Error:
            logger.warning("event streams: reader connection could not be opened; reading in threads", exc_info=True)
            return None
        if not self.listening or (self._reader is not None and not self._reader.closed):
            await reader.close()  # the listener stopped meanwhile, or another read opened one first
            return None if not self.listening else self._reader
        self._reader = reader
        return reader

    def shut_down(self) -> None:
        """Server shutdown: every open stream ends; new ones end at once."""
        self.stopping.set()
        for waiting in self._subscribers.values():
            for sub in waiting:
                sub.wake.set()


_hubs: dict[asyncio.AbstractEventLoop, EventHub] = {}
_signals_chained = False


def hub() -> EventHub:
    """The hub of the running event loop (one per process under uvicorn)."""
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None:
        for old in [k for k in _hubs if k.is_closed()]:
            del _hubs[old]
        found = _hubs[loop] = EventHub(loop)
        _chain_shutdown_signals()
    return found


def _chain_shutdown_signals() -> None:
    """Put a handler in front of the current SIGTERM/SIGINT handlers (uvicorn's) that ends every open
    stream, then calls the previous handler. Only the main thread may set handlers."""
    global _signals_chained
    if _signals_chained or threading.current_thread() is not threading.main_thread():
        return
    _signals_chained = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            for loop, each in list(_hubs.items()):
                if not loop.is_closed():
                    loop.call_soon_threadsafe(each.shut_down)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default action: end the process as it would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
