"""make bench-streams: open event streams held by one API process while other requests stay fast.

One ASGI worker (gunicorn + ``uvicorn_worker.UvicornWorker``, ``--workers 1``, ``DATABASE_POOL=1``, as
``make run``) on a scratch database beside ``DATABASE_URL``. Times ordinary API requests
(``GET /api/sessions/{id}/``, sequential, after a warm-up) in three phases — no stream open, ``--streams``
idle streams open, and the same streams while a writer appends ``--rate`` delta events per second to the
session they all watch (each event wakes every stream, which reads it from the table) — and prints
p50/p95 per phase, then checks that every stream received every event. Also times the two ways of
writing deltas (``services/events.py``): one commit per delta vs the writer's batches.
"""
from __future__ import annotations

import argparse
import http.client
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from devtools.databases import database_beside, drop_database, recreate_database
from devtools.processes import free_port

BASE = Path(__file__).resolve().parent.parent


def _setup(db_url: str) -> tuple[str, str, object]:
    """This process on the scratch database (migrated): (token, session id, a claimed turn)."""
    os.environ["DATABASE_URL"] = db_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from hermes_sessions import services, tasks

    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench")
    token, _ = Token.objects.get_or_create(user=user)
    session = services.session_create(owner=user, session_id="sess-bench-streams")
    tasks.run_turn.apply_async = lambda *a, **k: None  # this process plays the worker: no task is sent
    turn = services.turn_enqueue(session=session, input_text="bench", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    return token.key, session.id, claim


def _start_server(db_url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DATABASE_URL": db_url, "DATABASE_POOL": "1", "CELERY_TASK_ALWAYS_EAGER": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "project.asgi:application", "-k",
                             "uvicorn_worker.UvicornWorker", "--workers", "1", "--bind", f"127.0.0.1:{port}",
                             "--log-level", "warning"], cwd=BASE, env=env)
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start") from None
            time.sleep(0.1)


def _latencies(port: int, path: str, token: str, n: int) -> list[float]:
    """Milliseconds of ``n`` sequential GETs on one keep-alive connection (after 20 warm-up)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    out = []
    try:
        for i in range(n + 20):
            t0 = time.perf_counter()
            conn.request("GET", path, headers={"Authorization": f"Token {token}"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            if i >= 20:
                out.append((time.perf_counter() - t0) * 1000)
    finally:
        conn.close()
    return out


def open_streams(port: int, path: str, token: str, n: int) -> list[socket.socket]:
    """Open ``n`` raw SSE connections to ``path`` with ``token`` and return them once each has sent its
    ``retry:`` line (the stream started); raises ``RuntimeError`` when one closes first. Also used by
    ``tests/api/test_event_streams.py``."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n\r\n".encode())
        socks.append(sock)
    for sock in socks:
        got = b""
        while b"retry:" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"a stream closed before it started: {got[:600]!r}")
            got += chunk
    return socks


def _count_deltas(socks: list[socket.socket], expected: int, timeout: float) -> list[int]:
    """Events named ``delta`` received by each stream, reading until each has ``expected`` (or timeout)."""
    received = [b""] * len(socks)
    deadline = time.monotonic() + timeout
    pending = set(range(len(socks)))
    while pending and time.monotonic() < deadline:
        ready, _, _ = select.select([socks[i] for i in pending], [], [], 1.0)
        for sock in ready:
            i = socks.index(sock)
            received[i] += sock.recv(1 << 20)
            if received[i].count(b"event: delta\n") >= expected:
                pending.discard(i)
    return [data.count(b"event: delta\n") for data in received]


def _write_events(claim: object, rate: float, stop: threading.Event, written: list[int]) -> None:
    from django.db import connection

    from hermes_sessions.services.events import DELTA, TurnEventWriter

    writer = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id,  # type: ignore[attr-defined]
                             token=claim.token, attempt=claim.attempt)  # type: ignore[attr-defined]
    try:
        while not stop.is_set():
            writer.add(DELTA, {"item_id": "bench", "text": f"delta {written[0]} "})
            writer.flush()
            written[0] += 1
            stop.wait(1 / rate)
    finally:
        connection.close()


def _delta_write_cost(claim: object, n: int = 500) -> tuple[float, float]:
    """(ms per delta committed one by one, ms per delta through the writer's batches, a burst)."""
    from hermes_sessions.services.events import DELTA, TurnEventWriter

    ids = {"turn_id": claim.turn_id, "session_id": claim.session_id, "token": claim.token,  # type: ignore[attr-defined]
           "attempt": claim.attempt}  # type: ignore[attr-defined]
    one_by_one = TurnEventWriter(**ids)
    t0 = time.perf_counter()
    for i in range(n):
        one_by_one.add(DELTA, {"item_id": "cost", "text": f"{i}"})
        one_by_one.flush()
    single = (time.perf_counter() - t0) * 1000 / n
    batched = TurnEventWriter(**ids)
    t0 = time.perf_counter()
    for i in range(n):
        batched.add(DELTA, {"item_id": "cost", "text": f"{i}"})
    batched.flush()
    return single, (time.perf_counter() - t0) * 1000 / n


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main(argv: list[str] | None = None) -> int:
    """Run the phases and print p50/p95 per phase; exit 1 when a stream missed an event."""
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_streams", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--requests", type=int, default=300, help="timed requests per phase")
    parser.add_argument("--rate", type=float, default=10.0, help="delta events per second in the live phase")
    args = parser.parse_args(argv)
    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        sys.exit("make bench-streams needs DATABASE_URL=postgres://… (the Makefile sets it)")
    scratch = database_beside(db_url, "_streams")
    recreate_database(scratch)
    server = None
    try:
        token, session_id, claim = _setup(scratch)
        port = free_port()
        server = _start_server(scratch, port)
        api, stream_path = f"/api/sessions/{session_id}/", f"/api/sessions/{session_id}/events/"
        rows = [("no stream open", _latencies(port, api, token, args.requests))]
        socks = open_streams(port, stream_path, token, args.streams)
        rows.append((f"{args.streams} idle streams open", _latencies(port, api, token, args.requests)))
        stop, written = threading.Event(), [0]
        writer = threading.Thread(target=_write_events, args=(claim, args.rate, stop, written))
        writer.start()
        try:
            rows.append((f"{args.streams} streams, {args.rate:g} events/s", _latencies(port, api, token, args.requests)))
        finally:
            stop.set()
            writer.join()
        counts = _count_deltas(socks, written[0], timeout=30)
        for sock in socks:
            sock.close()
        single, batched = _delta_write_cost(claim)
        print(f"one uvicorn worker, GET {api} ({args.requests} sequential requests per phase), ms:")
        print(f"{'phase':<36} {'p50':>7} {'p95':>7}")
        for name, values in rows:
            print(f"{name:<36} {statistics.median(values):7.2f} {_pct(values, 95):7.2f}")
        missed = sum(1 for c in counts if c < written[0])
        print(f"events written in the live phase: {written[0]}; streams that received all of them: "
              f"{len(counts) - missed}/{len(counts)}")
        print(f"writing deltas: {single:.2f} ms each committed one by one, {batched:.3f} ms each in the writer's batches")
        return 1 if missed else 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        from django.db import connections

        connections.close_all()
        drop_database(scratch)


if __name__ == "__main__":
    sys.exit(main())
