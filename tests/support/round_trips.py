"""Database round trips as the wire shows them: a TCP proxy in front of the test database that counts,
per connection, each time the client starts speaking again after the server last spoke. A statement
sent alone is one round trip; statements sent together in psycopg's pipeline mode
(``hermes_sessions.services.pipelining``), ``BEGIN`` and ``COMMIT`` included, are one. Counting
``connection.queries`` cannot tell the two apart: Django records every statement, and its own ``BEGIN`` /
``COMMIT`` entries even when no such message went out."""
from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.db import connection


@dataclass
class RoundTrips:
    """``count``: round trips of every connection made through the proxy so far."""

    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self) -> None:
        with self._lock:
            self.count += 1


def _proxy(listener: socket.socket, upstream: tuple[str, int], counter: RoundTrips, stop: threading.Event) -> None:
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    peer: dict[socket.socket, tuple[socket.socket, bool]] = {}  # socket → (its other end, is the client's)
    client_spoke_last: dict[socket.socket, bool] = {}  # keyed by the client's socket
    while not stop.is_set():
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                client, _addr = listener.accept()
                server = socket.create_connection(upstream)
                for s in (client, server):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(s, selectors.EVENT_READ, None)
                peer[client], peer[server] = (server, True), (client, False)
                client_spoke_last[client] = False
                continue
            other, from_client = peer[sock]
            data = sock.recv(65536)
            if not data:
                for s in (sock, other):
                    sel.unregister(s)
                    s.close()
                    peer.pop(s, None)
                    client_spoke_last.pop(s, None)
                continue
            client = sock if from_client else other
            if from_client and not client_spoke_last[client]:
                counter.add()
            client_spoke_last[client] = from_client
            other.sendall(data)
    for s in list(peer):
        s.close()
    sel.close()


@contextmanager
def round_trips_counted() -> Iterator[RoundTrips]:
    """Route Django's default connection through a counting proxy while the block runs (reconnecting
    before and after it); yields the ``RoundTrips``, connected and idle: read ``count`` before and after
    the work to measure. The connection's opening (startup, authentication, Django's time-zone set-up)
    happens before the block and is not in the count."""
    settings = connection.settings_dict
    host, port = settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    counter, stop = RoundTrips(), threading.Event()
    thread = threading.Thread(target=_proxy, args=(listener, (host, port), counter, stop), daemon=True)
    thread.start()
    saved = settings["HOST"], settings["PORT"]
    connection.close()
    settings["HOST"], settings["PORT"] = "127.0.0.1", str(listener.getsockname()[1])
    try:
        connection.ensure_connection()
        yield counter
    finally:
        connection.close()
        settings["HOST"], settings["PORT"] = saved
        stop.set()
        thread.join(timeout=5)
        listener.close()


@contextmanager
def counting(counter: RoundTrips) -> Iterator[list[int]]:
    """The round trips made while the block runs: yields a list that holds one number after it."""
    before = counter.count
    out: list[int] = []
    yield out
    out.append(counter.count - before)
