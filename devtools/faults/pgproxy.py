"""A small TCP proxy between the turn workers and PostgreSQL that the fault harness controls.

The workers reach PostgreSQL only through it (``DATABASE_URL`` with ``sslmode=disable`` and an
``application_name`` per worker); the API, the sweeper and the harness connect directly. It forwards
bytes unchanged and can, from outside the product's code:

* **go down** (:meth:`PgProxy.down`): every proxied connection is closed and new ones are refused
  (the listening socket is closed) until :meth:`PgProxy.up` — PostgreSQL unreachable for the workers;
* **trap a statement** (:meth:`PgProxy.arm`): the first client→server write that contains every one of
  a trap's byte patterns is *held* — never forwarded — so the worker sending it is stopped exactly
  there (inside a restore, inside the finalize transaction) until the harness kills it and
  :meth:`Trap.drop` s the connection; or it makes the proxy go down (``action="down"``); or, with
  ``action="mute"``, it is forwarded but PostgreSQL's answer is withheld (the statement, e.g. a
  ``COMMIT``, takes effect; the worker never learns it).

A trap can require an earlier statement on the same connection (``after``): "the ``COMMIT`` of the
transaction that stored this rollout chunk".

What a write contains, for the patterns: its bytes — SQL text and values, whether Django's cursors inlined
the values (client-side binding) or psycopg sent them in a Bind message (server-side binding, the warm
path's pipelined statements, ``services/pipelining.py``) — plus the SQL text of every prepared statement a
Bind message in it runs: once psycopg has prepared a statement on a connection (``DATABASE_PREPARE_THRESHOLD``)
it sends only its name, so the proxy remembers each connection's named Parse messages (PostgreSQL's
frontend protocol: ``P`` name ``\0`` query ``\0`` …; ``B`` portal ``\0`` statement ``\0`` …).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_MAX_MESSAGE = 1 << 26  # a longer frontend message means the bytes are not PostgreSQL's protocol
_TAIL = 256  # bytes of the previous write kept, so a pattern split across two writes still matches


@dataclass
class Trap:
    """A one-shot trap: see :meth:`PgProxy.arm`. ``fired`` is set when it caught a write; ``app`` is
    the catching connection's ``application_name`` (which worker), ``caught`` the held bytes."""

    patterns: tuple[bytes, ...]
    action: str  # "hold" | "down" | "mute"
    after: tuple[bytes, ...] = ()
    fired: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    app: str = ""
    caught: bytes = b""
    fired_at: float = 0.0
    _pair: _Pair | None = None

    def drop(self) -> None:
        """Close the catching connection without forwarding the held bytes (after its worker died)."""
        if self._pair is not None:
            self._pair.close()
        self.released.set()

    def wait(self, timeout: float) -> bool:
        return self.fired.wait(timeout)


def _startup_app_name(data: bytes) -> str:
    """``application_name`` from a PostgreSQL StartupMessage (``key\\0value\\0`` pairs), or ``""``."""
    key = b"application_name\x00"
    at = data.find(key)
    if at < 0:
        return ""
    start = at + len(key)
    return data[start:data.find(b"\x00", start)].decode(errors="replace")


class _Pair:
    """One client connection and its upstream connection, pumped by one thread."""

    def __init__(self, proxy: PgProxy, client: socket.socket, upstream: socket.socket):
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.app = ""
        self.seen: set[bytes] = set()  # ``after`` patterns this connection has sent
        self.muted = False
        self.closed = threading.Event()
        self._tail = b""
        self._unparsed = b""  # the start of a frontend message whose end has not arrived yet
        self._started = False  # the StartupMessage (no type byte) was parsed
        self.prepared: dict[bytes, bytes] = {}  # statement name → its SQL text (named Parse messages)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy._forget(self)

    def pump(self) -> None:
        try:
            while not self.closed.is_set():
                readable, _, _ = select.select([self.client, self.upstream], [], [], 0.5)
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is self.client:
                        self._from_client(data)
                    elif not self.muted:
                        self.client.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            self.close()

    def _statements_run(self, data: bytes) -> list[bytes]:
        """The SQL texts of the prepared statements that this write's Bind messages run (learning the named
        Parse messages on the way)."""
        texts = []
        for kind, body in self._messages(data):
            if kind == b"P":
                name, _, rest = body.partition(b"\x00")
                if name:
                    self.prepared[name] = rest.partition(b"\x00")[0]
            elif kind == b"B":
                _portal, _, rest = body.partition(b"\x00")
                text = self.prepared.get(rest.partition(b"\x00")[0])
                if text is not None:
                    texts.append(text)
        return texts

    def _messages(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """PostgreSQL's frontend messages completed by ``data`` (type byte, body), read across writes; the
        StartupMessage (no type byte) is skipped. Bytes that are not the protocol stop the reading."""
        buf, at, out = self._unparsed + data, 0, []
        if not self._started:
            if len(buf) < 4 or len(buf) < struct.unpack_from("!I", buf)[0]:
                self._unparsed = buf
                return out
            self._started, at = True, struct.unpack_from("!I", buf)[0]
        while len(buf) - at >= 5:
            (length,) = struct.unpack_from("!I", buf, at + 1)
            if length < 4 or length > _MAX_MESSAGE:
                self._unparsed = b""  # not PostgreSQL's protocol (a test's raw bytes): nothing to read
                return out
            if len(buf) < at + 1 + length:
                break
            out.append((buf[at:at + 1], buf[at + 5:at + 1 + length]))
            at += 1 + length
        self._unparsed = buf[at:]
        return out

    def _from_client(self, data: bytes) -> None:
        if not self.app:
            self.app = _startup_app_name(data)
        window, tail = self._tail + data, len(self._tail)
        self._tail = window[-_TAIL:]
        texts = self._statements_run(data)
        if texts:  # the prepared statements' texts, searchable with the write's own bytes
            window = window + b"\x00" + b"\x00".join(texts)
        trap = self.proxy._match(self, window, tail)
        if trap is None:
            self.upstream.sendall(data)
            return
        if trap.action == "mute":
            self.muted = True
            self.upstream.sendall(data)
            return
        if trap.action == "down":
            self.proxy.down()
            return
        trap.released.wait()  # "hold": until the harness drops the connection (its worker is dead)
        if not self.closed.is_set():
            self.upstream.sendall(data)


class PgProxy:
    """Listen on 127.0.0.1:``port`` and forward to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int], port: int):
        self.upstream, self.port = upstream, port
        self._lock = threading.RLock()  # a pair closed under it forgets itself under it
        self._pairs: set[_Pair] = set()
        self._traps: list[Trap] = []
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self.downs = 0

    # -- control

    def up(self) -> None:
        """Listen again (or for the first time)."""
        with self._lock:
            if self._listener is not None:
                return
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))
            s.listen(64)
            self._listener = s
            self._accepting = threading.Thread(target=self._accept, args=(s,), name="pgproxy-accept", daemon=True)
            self._accepting.start()

    def down(self) -> None:
        """Close every proxied connection and refuse new ones until :meth:`up`."""
        with self._lock:
            listener, self._listener = self._listener, None
            pairs = list(self._pairs)
            self.downs += 1
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it; stops listening now
            except OSError:
                pass
            listener.close()
        for p in pairs:
            p.close()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def arm(self, *patterns: bytes, action: str = "hold", after: tuple[bytes, ...] = ()) -> Trap:
        """A one-shot trap for the first client write containing all ``patterns`` (on a connection that
        earlier sent all of ``after``): ``hold`` it, go ``down``, or forward it and ``mute`` the answer."""
        trap = Trap(tuple(patterns), action, tuple(after))
        with self._lock:
            self._traps.append(trap)
        return trap

    def disarm(self, trap: Trap) -> None:
        with self._lock:
            if trap in self._traps:
                self._traps.remove(trap)
        trap.released.set()

    def connections(self) -> list[str]:
        """The ``application_name`` of every open proxied connection."""
        with self._lock:
            return [p.app for p in self._pairs]

    def close(self) -> None:
        with self._lock:
            for t in self._traps:
                t.released.set()
            self._traps.clear()
        self.down()

    # -- internals

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = _Pair(self, client, upstream)
            with self._lock:
                late = self._listener is not listener  # went down meanwhile
                if not late:
                    self._pairs.add(pair)
            if late:
                pair.close()
                continue
            threading.Thread(target=pair.pump, name="pgproxy-pair", daemon=True).start()

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)

    def _match(self, pair: _Pair, window: bytes, tail: int) -> Trap | None:
        """The armed trap this write (``window[tail:]``, after ``tail`` bytes of the previous one) fires."""

        def sent(pat: bytes) -> bool:  # in this write, or straddling the previous one and this
            return window.find(pat, max(0, tail - len(pat) + 1)) >= 0

        with self._lock:
            for trap in self._traps:
                for pat in trap.after:
                    if sent(pat):
                        pair.seen.add(pat)
                if all(sent(p) for p in trap.patterns) and all(a in pair.seen for a in trap.after):
                    self._traps.remove(trap)
                    trap.app, trap.caught, trap.fired_at, trap._pair = pair.app, window, time.time(), pair
                    trap.fired.set()
                    return trap
        return None
