"""Our ``LISTEN`` connections, and their one reconnect rule: one implementation for the API's event hub
(``api/event_hub.py``) and the worker's wake listener (``worker/wake.py``).

A ``Listener`` holds a psycopg connection of its own (``connection_params``: not Django's, so no pool
recycles it and nothing else runs on it), in autocommit, that ``LISTEN``s on one channel and hands each
notification's payload to ``on_notify``. Payloads carry ids only (``../shared/pitfalls.md``: NOTIFY's
8,000-byte limit); the rows stay the truth.

The reconnect rule: when the connection breaks (``pg_terminate_backend``, a database restart, a network
error) the listener opens a new one at once; attempts are at least ``RECONNECT_SECONDS`` apart, so a
database that refuses costs one attempt a second and a listener is back within a second of the database.
PostgreSQL delivers a notification only to the sessions listening when it commits, so one sent while no
connection listened is gone: after every connect — the first and each reconnect — once the ``LISTEN`` is
in place, the listener calls ``on_connect`` so that its user re-reads from the tables what it may have
missed (the event hub: every open stream's rows since its last id). Tests:
``tests/test_listener.py``, ``tests/api/test_event_streams.py::test_after_the_listen_backend_is_killed_the_next_event_reaches_an_open_stream_within_two_seconds``,
``tests/services/test_wake.py::test_a_wake_sent_1_5_s_after_the_listeners_backend_is_killed_is_received``.

Two ways to wait on the same connection code — the connection's socket is watched and the notifications
it received are read without blocking (``Connection.notifies(timeout=0)``, psycopg 3.2+):

- ``start()`` / ``stop()``: a daemon thread of its own, waiting on the socket and on a wake-up socket
  that ``stop()`` writes to, so stop is immediate. ``on_notify`` and ``on_connect`` run on that thread
  (the wake listener runs its turns there).
- ``await listener.run()`` on an asyncio event loop, cancelled to stop (the event hub's task):
  ``loop.add_reader`` on the socket; ``on_notify`` and ``on_connect`` run on the loop and must not
  block (``on_connect`` may return an awaitable, awaited before any notification is handed over). The
  connect itself runs in a thread: a blocking connect must not hold the loop.

Either way the connection is closed explicitly when the listener stops (under ASGI a connection left to
garbage collection leaks: ``../shared/pitfalls.md``, Django #37066).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from django.conf import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from .sql import query

logger = logging.getLogger(__name__)

#: Attempts to connect are at least this far apart; the first after a break is at once.
RECONNECT_SECONDS = 1.0
#: libpq's ``connect_timeout`` for a listener's connection (whole seconds).
CONNECT_TIMEOUT_SECONDS = 5


def connection_params(application_name: str) -> dict[str, Any]:
    """psycopg connection parameters for a connection of our own (not Django's: LISTEN needs a connection
    that no pool recycles and nothing else uses), named ``application_name`` in ``pg_stat_activity``:
    ``DATABASE_LISTEN_URL`` when set (PostgreSQL itself, when ``DATABASE_URL`` is PgBouncer's: a ``LISTEN``
    through PgBouncer's transaction mode lands on a server connection the next client gets, and no
    notification comes back), else the default database. Every user of a connection that LISTENs or keeps
    state between transactions (prepared statements) takes its parameters from here
    (``tests/e2e/test_pgbouncer.py``)."""
    if settings.DATABASE_LISTEN_URL:
        return {**conninfo_to_dict(settings.DATABASE_LISTEN_URL), "application_name": application_name}
    db = settings.DATABASES["default"]
    params: dict[str, Any] = {"dbname": db["NAME"], "user": db.get("USER") or None,
                              "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
                              "port": db.get("PORT") or None, "application_name": application_name}
    return {k: v for k, v in params.items() if v is not None}


class Listener:
    """``LISTEN channel`` on a connection of its own named ``name`` in ``pg_stat_activity``; each
    notification's payload goes to ``on_notify(payload)``, ``on_connect()`` follows every connect once
    the ``LISTEN`` is in place, and ``on_down()`` every failed attempt and every loss (not the stop).
    Either ``start()``/``stop()`` (a thread) or ``await run()`` (an event loop), not both. An exception
    from a callback is logged; the listener goes on."""

    def __init__(self, channel: str, *, name: str, on_notify: Callable[[str], object],
                 on_connect: Callable[[], object] = lambda: None, on_down: Callable[[], object] = lambda: None) -> None:
        self.channel, self.name = channel, name
        self.on_notify, self.on_connect, self.on_down = on_notify, on_connect, on_down
        #: Set while the ``LISTEN`` is in place (from just before ``on_connect``).
        self.listening = threading.Event()
        #: Connects so far (tests and logs).
        self.connects = 0
        self._stopping = threading.Event()
        self._last_attempt = float("-inf")
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._wakeup_lock = threading.Lock()

    # --- the connection: the same for both ways of waiting ---------------------------------------------

    def _pause(self) -> float:
        """Seconds until the next attempt may start (``RECONNECT_SECONDS`` after the last one)."""
        return max(0.0, self._last_attempt + RECONNECT_SECONDS - time.monotonic())

    def _open(self) -> psycopg.Connection[Any] | None:
        """A new connection with the ``LISTEN`` in place, or ``None`` (logged) when it could not be had."""
        self._last_attempt = time.monotonic()
        try:
            conn = psycopg.Connection.connect(**connection_params(self.name), autocommit=True,
                                              connect_timeout=CONNECT_TIMEOUT_SECONDS)
        except psycopg.Error as exc:
            logger.warning("%s: could not connect to LISTEN %s (%s); trying again in %.1f s",
                           self.name, self.channel, exc, RECONNECT_SECONDS)
            self._call(self.on_down)
            return None
        try:
            conn.execute(sql.SQL(query("listen")).format(channel=sql.Identifier(self.channel)))
        except psycopg.Error as exc:
            conn.close()
            logger.warning("%s: LISTEN %s failed (%s); trying again in %.1f s",
                           self.name, self.channel, exc, RECONNECT_SECONDS)
            self._call(self.on_down)
            return None
        self.connects += 1
        self.listening.set()
        return conn

    def _deliver(self, conn: psycopg.Connection[Any]) -> None:
        """Hand every notification ``conn`` has received to ``on_notify``, without waiting. Raises
        ``psycopg.OperationalError`` when the connection broke."""
        for note in conn.notifies(timeout=0):  # timeout=0: one poll of what arrived, no wait
            self._call(functools.partial(self.on_notify, note.payload))
        if conn.broken:  # libpq read the server's goodbye without raising: the socket is at its end
            raise psycopg.OperationalError("the LISTEN connection was closed by the server")

    def _lost(self, conn: psycopg.Connection[Any], exc: BaseException | None) -> None:
        """Close ``conn``; ``exc``: it broke (logged, ``on_down``), ``None``: the listener stops."""
        self.listening.clear()
        conn.close()
        if exc is not None:
            logger.warning("%s: LISTEN %s lost (%s); listening again in %.1f s", self.name, self.channel,
                           exc, self._pause())
            self._call(self.on_down)

    def _call(self, hook: Callable[[], object]) -> object:
        """``hook()``, an exception logged (``None`` then)."""
        try:
            return hook()
        except Exception:  # noqa: BLE001 — a callback's failure must not stop the listening
            logger.exception("%s: a callback of LISTEN %s failed", self.name, self.channel)
            return None

    # --- a thread of its own ----------------------------------------------------------------------------

    def start(self, *, thread_name: str | None = None, long_lived: bool = False,
              at_exit: Callable[[], object] | None = None) -> None:
        """Listen on a daemon thread of its own (named ``thread_name``, default ``name``);
        ``long_lived`` marks it ``hermes_long_lived`` (it may spawn processes that outlive a turn:
        ``worker/wake.in_long_lived_thread``); ``at_exit()`` runs on that thread as it ends."""
        self._wakeup = socket.socketpair()
        self._thread = threading.Thread(target=self._run_thread, args=(at_exit,), name=thread_name or self.name,
                                        daemon=True)
        if long_lived:
            self._thread.hermes_long_lived = True  # type: ignore[attr-defined]
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop listening and close the connection; waits for the thread ``timeout`` seconds at most (a
        callback it is running ends when it ends). A no-op join from the listener's own thread."""
        self._stopping.set()
        with self._wakeup_lock:
            if self._wakeup is not None:
                try:
                    self._wakeup[1].send(b"\0")
                except OSError:
                    pass  # its buffer is full: the thread is woken already
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called."""
        return self._stopping.is_set()

    def is_alive(self) -> bool:
        """Whether the listener's thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run_thread(self, at_exit: Callable[[], object] | None) -> None:
        assert self._wakeup is not None
        woken = self._wakeup[0]
        try:
            while not self._stopping.wait(self._pause()):
                conn = self._open()
                if conn is None:
                    continue
                # epoll where there is one: select() refuses descriptors past 1023, and a worker that
                # keeps app-servers holds many.
                with selectors.DefaultSelector() as watch:
                    watch.register(conn.fileno(), selectors.EVENT_READ)
                    watch.register(woken, selectors.EVENT_READ)
                    try:
                        self._call(self.on_connect)
                        while not self._stopping.is_set():
                            watch.select()
                            if self._stopping.is_set():
                                break
                            self._deliver(conn)
                    except psycopg.Error as exc:
                        self._lost(conn, exc)
                    else:
                        self._lost(conn, None)
        finally:
            with self._wakeup_lock:
                for end in self._wakeup:
                    end.close()
                self._wakeup = None
            if at_exit is not None:
                at_exit()

    # --- on an event loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Listen on the running event loop until the task is cancelled; the connection is closed then."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._pause())
            conn = await self._open_in_thread()
            if conn is None:
                continue
            readable = asyncio.Event()
            fd = conn.fileno()
            loop.add_reader(fd, readable.set)
            try:
                called = self._call(self.on_connect)
                if inspect.isawaitable(called):
                    try:
                        await called
                    except Exception:  # noqa: BLE001 — as _call
                        logger.exception("%s: on_connect of LISTEN %s failed", self.name, self.channel)
                while True:
                    await readable.wait()
                    readable.clear()
                    self._deliver(conn)
            except psycopg.Error as exc:
                loop.remove_reader(fd)
                self._lost(conn, exc)
            except BaseException:  # cancelled: the listener stops
                loop.remove_reader(fd)
                self._lost(conn, None)
                raise

    async def _open_in_thread(self) -> psycopg.Connection[Any] | None:
        """``_open`` in a thread; cancelled meanwhile, the connection it opens is closed when it comes."""
        opening = asyncio.get_running_loop().run_in_executor(None, self._open)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            def close(done: asyncio.Future[psycopg.Connection[Any] | None]) -> None:
                conn = None if done.cancelled() or done.exception() else done.result()
                if conn is not None:
                    self._lost(conn, None)
            opening.add_done_callback(close)
            raise
