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
    """``count``: round trips of every connection made through the proxy so far. ``cut_after``: when a
    client write containing these bytes has been forwarded, the proxy cuts that client off — PostgreSQL
    gets the write and runs it (a COMMIT commits), the client never gets the answer and sees its
    connection closed: a lost answer, as a network cut or a crash of the proxy in between would make it;
    with ``cut_forwards`` False the write is dropped and the connection closed on both sides (lost on its
    way; PostgreSQL rolls the transaction back). One-shot (``cut`` tells whether it fired)."""

    count: int = 0
    cut_after: bytes | None = None
    cut_forwards: bool = True  # False: the cutting write itself never reaches PostgreSQL
    cut: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self) -> None:
        with self._lock:
            self.count += 1


class _Proxy:
    """The proxy's state, run by ``run`` in a thread of its own."""

    def __init__(self, listener: socket.socket, upstream: tuple[str, int], counter: RoundTrips) -> None:
        self.listener, self.upstream, self.counter = listener, upstream, counter
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.peer: dict[socket.socket, tuple[socket.socket, bool]] = {}  # socket → (its other end, is the client's)
        self.client_spoke_last: dict[socket.socket, bool] = {}  # keyed by the client's socket
        self.cut_off: set[socket.socket] = set()  # clients cut off (``cut_after``); their servers stay connected

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    self._accept()
                elif sock in self.peer:  # not dropped by an earlier event of this same select
                    self._pump(sock)
        for s in list(self.peer):
            s.close()
        self.sel.close()

    def _accept(self) -> None:
        client, _addr = self.listener.accept()
        server = socket.create_connection(self.upstream)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sel.register(s, selectors.EVENT_READ, None)
        self.peer[client], self.peer[server] = (server, True), (client, False)
        self.client_spoke_last[client] = False

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            if s in self.peer:
                self.sel.unregister(s)
                s.close()
                self.peer.pop(s, None)
                self.client_spoke_last.pop(s, None)

    def _pump(self, sock: socket.socket) -> None:
        other, from_client = self.peer[sock]
        data = sock.recv(65536)
        if not data:
            self._drop(sock, other)
            return
        if other in self.cut_off:  # a cut-off client's server: its answers go nowhere
            return
        counter, client = self.counter, sock if from_client else other
        if from_client and not self.client_spoke_last[client]:
            counter.add()
        self.client_spoke_last[client] = from_client
        cutting = from_client and counter.cut_after is not None and counter.cut_after in data
        if not cutting or counter.cut_forwards:
            other.sendall(data)
        if cutting:
            counter.cut_after, counter.cut = None, True
            if not counter.cut_forwards:  # the connection is gone for both: PostgreSQL ends its transaction
                self._drop(sock, other)
                return
            # The client only: its server keeps what it got (and runs it); its answers go nowhere.
            self.sel.unregister(sock)
            self.peer.pop(sock, None)
            self.client_spoke_last.pop(sock, None)
            sock.close()
            self.cut_off.add(sock)


@contextmanager
def round_trips_counted(*, cut_after: bytes | None = None, cut_forwards: bool = True) -> Iterator[RoundTrips]:
    """Route Django's default connection through a counting proxy while the block runs (reconnecting
    before and after it); yields the ``RoundTrips``, connected and idle: read ``count`` before and after
    the work to measure. The connection's opening (startup, authentication, Django's time-zone set-up)
    happens before the block and is not in the count."""
    settings = connection.settings_dict
    host, port = settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    counter, stop = RoundTrips(cut_after=cut_after, cut_forwards=cut_forwards), threading.Event()
    thread = threading.Thread(target=_Proxy(listener, (host, port), counter).run, args=(stop,), daemon=True)
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
