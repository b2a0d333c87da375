"""The API process's one LISTEN connection, shared by every open event stream (``api/streams.py``).

Workers on any host write ``TurnEvent`` rows and ``NOTIFY hermes_turn_events, '<session> <turn> <id>'``
in the same transaction (``services/events.py``). This hub holds one psycopg ``AsyncConnection`` per
process (per event loop) that LISTENs on that channel while at least one stream is open, and wakes the
streams of the notified session; the streams then read the rows from the table. The connection is
opened on the first subscriber and closed explicitly, in its own task, when the last one leaves (under
ASGI, connections left to garbage collection leak — ``../shared/pitfalls.md``, Django #37066).

A notification nobody listened for is not lost: a stream reads the table from its last id before it
waits, and again on every heartbeat tick, so NOTIFY is only a wake-up. If the LISTEN connection
cannot be opened (SQLite, a database restart), streams fall back to those ticks and the hub tries
again on the next one.

Shutdown: the hub chains itself in front of the process's SIGTERM/SIGINT handlers (uvicorn's own),
and on either sets ``stopping``; open streams then end at once, so the server's graceful shutdown does
not wait on them (uvicorn waits for open responses; gunicorn would kill the worker after its
``graceful_timeout``). Clients reconnect with ``Last-Event-ID`` and lose nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import psycopg
from django.conf import settings

from ..services.events import CHANNEL

logger = logging.getLogger(__name__)

LISTEN_CONNECT_SECONDS = 5.0


def _listen_params() -> dict[str, Any]:
    """Connection parameters of the default database, for a connection of our own (not Django's:
    LISTEN needs a connection that no pool recycles and nothing else uses)."""
    db = settings.DATABASES["default"]
    params: dict[str, Any] = {"dbname": db["NAME"], "user": db.get("USER") or None,
                              "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
                              "port": db.get("PORT") or None, "application_name": "hermes-sse-listener"}
    return {k: v for k, v in params.items() if v is not None}


class EventHub:
    """Wake-ups for the open streams of one event loop. ``subscribe(session_id)`` returns an
    ``asyncio.Event`` set on every notification for that session; ``unsubscribe`` must follow (in a
    ``finally``). ``stopping`` is set when the server is shutting down."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stopping = asyncio.Event()
        self._subscribers: dict[str, set[asyncio.Event]] = {}
        self._count = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.listening = False

    @property
    def open_streams(self) -> int:
        """Streams subscribed right now."""
        return self._count

    async def subscribe(self, session_id: str) -> asyncio.Event:
        """Register a stream of ``session_id`` and make sure the LISTEN is in place before it returns
        (so a notification sent after the stream's first read cannot be missed)."""
        event = asyncio.Event()
        self._subscribers.setdefault(session_id, set()).add(event)
        self._count += 1
        await self.ensure_listening()
        return event

    def unsubscribe(self, session_id: str, event: asyncio.Event) -> None:
        """Forget a stream; the last one out closes the LISTEN connection. Synchronous, so that it
        runs in full even from a ``finally`` of a cancelled stream."""
        waiting = self._subscribers.get(session_id)
        if waiting is not None and event in waiting:
            waiting.discard(event)
            self._count -= 1
            if not waiting:
                del self._subscribers[session_id]
        if self._count == 0 and self._task is not None:
            self._task.cancel()  # its finally closes the connection
            self._task, self.listening = None, False

    async def ensure_listening(self) -> None:
        """Start the listener task if none runs (first stream, or the connection was lost) and wait
        until its LISTEN is in place or it failed (at most ``LISTEN_CONNECT_SECONDS``)."""
        if "postgresql" not in settings.DATABASES["default"]["ENGINE"] or self.stopping.is_set():
            return
        if self._task is None or self._task.done():
            self._ready = asyncio.Event()
            self._task = self.loop.create_task(self._listen(self._ready), name="hermes-sse-listener")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), LISTEN_CONNECT_SECONDS)

    async def _listen(self, ready: asyncio.Event) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(**_listen_params(), autocommit=True)
            await conn.execute(f"LISTEN {CHANNEL}")
            self.listening = True
            ready.set()
            async for note in conn.notifies():
                self._wake(note.payload)
        except psycopg.Error:
            logger.warning("event streams: LISTEN connection lost; streams re-read on their heartbeat", exc_info=True)
        finally:
            self.listening = False
            ready.set()
            if conn is not None:
                await conn.close()

    def _wake(self, payload: str) -> None:
        session_id = payload.split(" ", 1)[0]
        for event in self._subscribers.get(session_id, ()):
            event.set()

    def shut_down(self) -> None:
        """Server shutdown: every open stream ends; new ones end at once."""
        self.stopping.set()
        for waiting in self._subscribers.values():
            for event in waiting:
                event.set()


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
