"""A real ASGI server process for the event-stream tests (gunicorn + ``uvicorn_worker.UvicornWorker``,
as ``make run``) and a small server-sent-events client on ``http.client``."""
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
    id: int | None
    event: str
    data: dict[str, Any]


@dataclass
class Stream:
    """One open event stream. ``read()`` returns the next event, or ``None`` for a heartbeat (a comment
    line); ``events`` and ``heartbeats`` collect what was read; ``ended`` once the server closed it."""

    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    events: list[Event] = field(default_factory=list)
    heartbeats: int = 0
    ended: bool = False
    raw: list[str] = field(default_factory=list)

    def read(self) -> Event | None:
        """Block (up to the socket timeout) for the next event or heartbeat; ``ended`` at EOF."""
        fields: dict[str, str] = {}
        while True:
            line = self.resp.readline()
            if not line:
                self.ended = True
                raise EOFError("stream ended")
            text = line.decode("utf-8").rstrip("\n")
            self.raw.append(text)
            if text.startswith(":"):
                self.heartbeats += 1
                assert not fields, "a comment inside an event"
                self.resp.readline()  # the blank line after it
                return None
            if text == "":
                if not fields or set(fields) == {"retry"}:
                    fields = {}
                    continue
                event = Event(id=int(fields["id"]) if "id" in fields else None, event=fields.get("event", "message"),
                              data=json.loads(fields["data"]))
                self.events.append(event)
                return event
            name, _, value = text.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value

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


def open_stream(port: int, path: str, token: str, *, last_event_id: int | None = None, timeout: float = 30) -> Stream:
    """GET an event stream; asserts 200 and ``text/event-stream``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": f"Token {token}", "Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read()[:500])
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    return Stream(conn, resp)
