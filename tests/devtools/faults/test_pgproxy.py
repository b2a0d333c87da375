"""The harness's PostgreSQL proxy against a stand-in upstream (an echo server): it forwards, holds a
trapped write, goes down and comes back, and mutes an answer — no PostgreSQL, a fraction of a second."""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from devtools.faults.pgproxy import PgProxy
from devtools.processes import free_port


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    upstream = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(b"echo:" + data)

    def serve() -> None:
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    p = PgProxy(upstream.getsockname(), free_port())
    p.up()
    yield p
    p.close()
    upstream.close()


def connect(p: PgProxy, app: str = "worker7") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=2)
    params = b"user\x00postgres\x00application_name\x00" + app.encode() + b"\x00\x00"
    s.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)  # a StartupMessage
    assert s.recv(1024).startswith(b"echo:")
    return s


def test_forwards_and_names_the_connection(proxy):
    s = connect(proxy)
    s.sendall(b"Q SELECT 1")
    assert s.recv(1024) == b"echo:Q SELECT 1"
    assert proxy.connections() == ["worker7"]


def test_a_hold_trap_stops_the_write_until_dropped(proxy):
    s = connect(proxy)
    trap = proxy.arm(b'FROM "chunks"', b"'thread-1'")
    s.sendall(b"SELECT * FROM \"chunks\" WHERE id = 'thread-2'")
    assert s.recv(1024).startswith(b"echo:")  # the other thread's statement passes
    s.sendall(b"SELECT * FROM \"chunks\" WHERE id = 'thread-1'")
    assert trap.wait(2) and trap.app == "worker7"
    s.settimeout(0.3)
    with pytest.raises(TimeoutError):
        s.recv(1024)  # held: PostgreSQL never saw it
    trap.drop()
    s.settimeout(2)
    assert s.recv(1024) == b""  # the connection is closed, the write never forwarded


def test_down_cuts_connections_and_refuses_new_ones_until_up(proxy):
    s = connect(proxy)
    trap = proxy.arm(b"RESTORE", action="down")
    s.sendall(b"RESTORE thread-1")
    assert trap.wait(2)
    assert s.recv(1024) == b""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.up()
    assert connect(proxy).sendall(b"x") is None


def test_mute_forwards_the_write_after_the_named_statement_and_withholds_the_answer(proxy):
    s = connect(proxy)
    trap = proxy.arm(b"COMMIT", action="mute", after=(b"INSERT chunk",))
    s.sendall(b"COMMIT")  # no chunk inserted on this connection yet: not this trap's COMMIT
    assert s.recv(1024) == b"echo:COMMIT"
    s.sendall(b"INSERT chunk 5")
    assert s.recv(1024) == b"echo:INSERT chunk 5"
    s.sendall(b"COMMIT")
    assert trap.wait(2)
    s.settimeout(0.3)
    with pytest.raises(TimeoutError):
        s.recv(1024)


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", 4 + len(body)) + body


def test_a_trap_sees_the_text_of_a_prepared_statement_that_a_write_only_binds(proxy):
    """psycopg sends a prepared statement's text once (a named Parse), then only its name in each Bind
    (the warm path's pipelined statements, server-side bound): the trap still matches that text, with the
    Bind's values."""
    s = connect(proxy)
    parse = _message(b"P", b"_pg3_1\x00UPDATE turn SET status = $1 WHERE thread = $2\x00\x00\x00")
    s.sendall(parse)
    assert s.recv(1024).startswith(b"echo:")
    trap = proxy.arm(b"UPDATE turn SET status", b"thread-abc")
    bind = _message(b"B", b"\x00_pg3_1\x00\x00\x00\x00\x02\x00\x00\x00\x04done\x00\x00\x00\x0athread-abc\x00\x00")
    other = _message(b"B", b"\x00_pg3_1\x00\x00\x00\x00\x02\x00\x00\x00\x04done\x00\x00\x00\x0athread-xyz\x00\x00")
    s.sendall(other + _message(b"E", b"\x00\x00\x00\x00\x00"))  # another thread: forwarded
    assert s.recv(1024).startswith(b"echo:")
    half = bind + _message(b"E", b"\x00\x00\x00\x00\x00")
    s.sendall(half[:7])  # a message split across writes is still read whole
    assert s.recv(1024) == b"echo:" + half[:7]  # the first part alone matches nothing: forwarded
    s.sendall(half[7:])
    assert trap.wait(2) and trap.app == "worker7"
    s.settimeout(0.3)
    with pytest.raises(TimeoutError):
        s.recv(1024)  # held
    trap.drop()
