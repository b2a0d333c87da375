"""A real ASGI server process for the event-stream tests (gunicorn + ``uvicorn_worker.UvicornWorker``,
as ``make run``) and a server-sent-events client: ``http.client`` for the bytes, httpx-sse's decoder for the parsing."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from httpx_sse._decoders import SSEDecoder  # the parser of httpx-sse (pinned) that its EventSource runs

from devtools.processes import free_port


def database_url() -> str:
    """The test database (pytest-django's ``test_…``) as a URL for a child process."""
    db = settings.DATABASES["default"]
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


class ApiServer:
    """``gunicorn project.asgi:application -k uvicorn_worker.UvicornWorker`` on the test database, with
    the pool on (``DATABASE_POOL=1``) and ``heartbeat`` seconds between heartbeats."""

    def __init__(self, log: Path, *, heartbeat: float = 2.0, workers: int = 1, env: dict[str, str] | None = None):
        self.log, self.heartbeat, self.workers = log, heartbeat, workers
        self.extra_env = env or {}
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ApiServer:
        # Not eager: a turn posted to this server goes to the broker, to a real worker.
        env = {**os.environ, "DATABASE_URL": database_url(), "DATABASE_POOL": "1", "CELERY_TASK_ALWAYS_EAGER": "0",
               "DJANGO_SETTINGS_MODULE": "project.settings_test",
               "HERMES_SSE_HEARTBEAT_SECONDS": str(self.heartbeat), **self.extra_env}
        argv = [sys.executable, "-m", "gunicorn", "project.asgi:application", "-k", "uvicorn_worker.UvicornWorker",
                "--bind", f"127.0.0.1:{self.port}", "--workers", str(self.workers), "--graceful-timeout", "10"]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(argv, env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"API server exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"API server not up: {self.log.read_text()[-3000:]}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)

    def terminate(self, timeout: float = 20) -> float:
        """SIGTERM to gunicorn's master; returns the seconds it took to exit."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                pass

    def post(self, path: str, token: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A JSON POST: status and the decoded body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def get(self, path: str, token: str | None) -> tuple[int, dict[str, str], bytes]:
        """A plain GET (no streaming): status, headers (names lower-cased: HTTP's are case-insensitive, and
        uvicorn's httptools writer and its h11 one spell them differently), body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path, headers={"Authorization": f"Token {token}"} if token else {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@dataclass
class Event:
    """One dispatched event: ``id`` is the id field of its own frame (``None``: the frame had none, as
    ``event: gone``), not the last id the client keeps (``Stream.last_event_id``)."""

    id: int | None
    event: str
    data: dict[str, Any]


@dataclass
class Stream:
    """One open event stream, parsed as the SSE specification says a client does (httpx-sse's
    ``SSEDecoder``, fed the raw lines). ``read()`` returns the next event, or ``None`` for a heartbeat (a
    block with a ``:`` comment and no data); ``events`` and ``heartbeats`` count what was read;
    ``last_event_id`` is the id a reconnect sends (the last ``id:`` field seen, on any block, an event with
    no data included); ``frames`` holds each block's raw bytes, the blank line that ends it included;
    ``ended`` once the server closed it."""

    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    events: list[Event] = field(default_factory=list)
    heartbeats: int = 0
    heartbeat_frames: list[bytes] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)
    ended: bool = False
    raw: list[str] = field(default_factory=list)
    # Every block goes through this one decoder: it keeps the last id across blocks, as the spec's
    # "last event ID buffer" (a block without an ``id:`` leaves it; ``id:`` with no value empties it).
    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    last_event_id: str | None = None

    def read(self) -> Event | None:
        """Block (up to the socket timeout) for the next event or heartbeat; ``ended`` at EOF."""
        block: list[bytes] = []
        while True:
            line = self.resp.readline()
            if not line:
                self.ended = True
                raise EOFError("stream ended")
            block.append(line)
            if line not in (b"\n", b"\r\n"):
                continue
            event = self._dispatch(block)
            if event is not None or any(b.startswith(b":") for b in block):
                return event
            block = []  # neither data nor a comment (the opening ``retry:``): read on

    def _dispatch(self, block: list[bytes]) -> Event | None:
        """Feed one block (its lines, the blank one that ends it last) to the stream's decoder and to
        one of its own; the event dispatched, or ``None`` when the block has no data (the spec
        dispatches nothing then, but an ``id:`` in it still sets the id a reconnect sends)."""
        own = SSEDecoder()  # this block's fields alone: the frame's own id
        for line in block:
            text = line.decode("utf-8").removesuffix("\n").removesuffix("\r")
            self.raw.append(text)
            kept, mine = self.decoder.decode(text), own.decode(text)
        frame = b"".join(block)
        self.frames.append(frame)
        # ``decode("")`` returns None only while no id was ever kept (and the block set nothing).
        self.last_event_id = (kept.id if kept is not None else "") or None
        if kept is None or kept.data == "":
            if any(b.startswith(b":") for b in block):
                self.heartbeats += 1
                self.heartbeat_frames.append(frame)
            return None
        own_id = mine.id if mine is not None else ""
        event = Event(id=int(own_id) if own_id else None, event=kept.event, data=kept.json())
        self.events.append(event)
        return event

    def read_until(self, predicate: Any, timeout: float = 30) -> list[Event]:
        """Events read until ``predicate(event)`` holds (inclusive)."""
        got: list[Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            event = self.read()
            if event is not None:
                got.append(event)
                if predicate(event):
                    return got
        raise AssertionError(f"no matching event within {timeout} s; got {got}")

    def read_to_end(self, timeout: float = 30) -> list[Event]:
        got: list[Event] = []
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                event = self.read()
                if event is not None:
                    got.append(event)
        except EOFError:
            return got
        raise AssertionError(f"stream did not end within {timeout} s; got {got}")

    def close(self) -> None:
        """Drop the connection as a client that goes away does."""
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


def open_stream(port: int, path: str, token: str, *, last_event_id: int | str | None = None,
                timeout: float = 30) -> Stream:
    """GET an event stream (``Last-Event-ID``: ``last_event_id`` when given); asserts 200 and
    ``text/event-stream``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": f"Token {token}", "Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read()[:500])
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    stream = Stream(conn, resp)
    OPENED.append(stream)
    return stream


#: Every stream ``open_stream`` opened and nobody closed yet; ``close_open_streams`` closes them, so a
#: test that fails with a stream open does not leave the server's LISTEN to the tests after it.
OPENED: list[Stream] = []


def close_open_streams() -> None:
    while OPENED:
        OPENED.pop().close()
