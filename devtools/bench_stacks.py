"""``make bench``'s stacks: a gunicorn API plus Celery turn workers on a turn queue of their own, with the
environment that picks the worker's warm behaviour, and the REST client that times turns through them.

Two kinds of stack run side by side in one bench (same database, broker, model stand-in and codex):

* **baseline**: ``HERMES_WARM_IDLE_SECONDS=0 HERMES_WARM_POOL=0 CODEX_PROJECT_DOCS=1`` — the product
  as it was before issue 9: every turn spawns, initializes and resumes its own app-server (with codex's
  AGENTS.md lookups) and closes it after the turn (the cold path);
* **warm**: ``HERMES_WARM_IDLE_SECONDS=120 HERMES_WARM_POOL=1`` (and no project docs, the default) — the
  worker keeps a spare app-server ready and keeps a session's thread loaded between its turns.

Each worker is one process, ``celery -A project worker -Q <queue>,celery -c 1 -n <unique>@%h``, as
session affinity needs (its route is ``<queue>.<node name>``)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.processes import free_port

BASE = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "cancelled")

# The two stacks' worker settings (see the module docstring).
BASELINE_ENV = {"HERMES_WARM_IDLE_SECONDS": "0", "HERMES_WARM_POOL": "0", "CODEX_PROJECT_DOCS": "1"}
WARM_ENV = {"HERMES_WARM_IDLE_SECONDS": "120", "HERMES_WARM_POOL": "1", "CODEX_PROJECT_DOCS": "0"}


def stack_environment(env: dict[str, str], name: str, settings: dict[str, str]) -> dict[str, str]:
    """``env`` with a turn queue of the stack's own (``<queue>-<name>``: its API sends there and only its
    workers consume it) and the worker ``settings``."""
    return {**env, "HERMES_TURN_QUEUE": f"{env['HERMES_TURN_QUEUE']}-{name}", **settings}


@dataclass
class Stack:
    """One gunicorn and the Celery workers of one turn queue. ``name`` goes into the queue and the
    workers' node names; ``http_workers`` / ``http_threads`` size gunicorn (threads > 1: gthread).
    ``asgi``: the API as ``make run`` serves it — ``project.asgi`` on uvicorn workers with psycopg's
    pool (``DATABASE_POOL=1``), which the event streams (``StackClient.timed_turn(watch=True)``) need.

    Give gunicorn processes, not threads, for concurrent POSTs: an API process's first turns, posted at
    once from several threads, race in ``dispatch._run_turn_task`` (one thread's autodiscovery is under
    way, another's lookup raises ``NotRegistered``) and the turn waits for the sweep, which the bench
    does not run."""

    name: str
    env: dict[str, str]
    http_workers: int = 1
    http_threads: int = 1
    asgi: bool = False
    pool: str = "prefork"  # the workers' Celery pool: prefork or solo
    concurrency: int = 1  # each worker's -c: pool processes (prefork); 1 keeps threads loaded (session affinity)
    api: str = ""
    gunicorn: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_workers: int = 0

    def start_api(self) -> str:
        """Start gunicorn on a free port; the API's base URL (``…/api``)."""
        port = free_port()
        app, env = "project.wsgi", self.env
        if self.asgi:
            app, env = "project.asgi:application", {**self.env, "DATABASE_POOL": "1"}
        argv = [str(BASE / ".venv/bin/gunicorn"), app, "--bind", f"127.0.0.1:{port}",
                "--workers", str(self.http_workers), "--log-level", "warning"]
        if self.asgi:
            argv += ["-k", "uvicorn_worker.UvicornWorker"]
        elif self.http_threads > 1:
            argv += ["--threads", str(self.http_threads)]
        self.gunicorn = subprocess.Popen(argv, cwd=BASE, env=env)
        self.api = f"http://127.0.0.1:{port}/api"
        return self.api

    def add_worker(self) -> subprocess.Popen[bytes]:
        """Start one more ``-c <concurrency>`` worker (its own process group; node name unique in the run)."""
        self.started_workers += 1
        node = f"bench-{self.name}-{self.started_workers}-{os.getpid()}@%h"
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker",
                                 "-Q", f"{self.env['HERMES_TURN_QUEUE']},celery", "-P", self.pool, "-c", str(self.concurrency), "-n", node,
                                 "-l", "warning"], cwd=BASE, env=self.env, start_new_session=True,
                                stdout=subprocess.DEVNULL)
        self.workers.append(proc)
        return proc

    def stop_workers(self) -> None:
        """Warm shutdown of every worker (``stop_processes``)."""
        stop_processes(self.workers)
        self.workers = []

    def stop(self) -> None:
        self.stop_workers()
        if self.gunicorn is not None:
            stop_processes([self.gunicorn])
            self.gunicorn = None
        self.forget_queue()

    def forget_queue(self) -> None:
        """Delete the stack's turn queue from the broker: a turn the sweep dispatched again after its worker
        had run it leaves a no-op message behind when the workers stop. Needs Django set up (the bench's
        ``_setup_django``); without it there is nothing to forget."""
        try:
            from celery import current_app
            from kombu import Queue
        except Exception:  # noqa: BLE001 — Django was never set up: the stack never ran a turn
            return
        try:
            with current_app.connection_for_write() as conn:
                Queue(self.env["HERMES_TURN_QUEUE"])(conn.default_channel).delete()
        except Exception:  # noqa: BLE001 — the broker is away: a leftover queue, nothing more
            pass


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each (a Celery worker's main process: a warm shutdown, which closes its pool child and the
    app-servers under it) and wait, SIGKILL after 30 s; then SIGKILL whatever is left in the process
    group of one that led a group (``start_new_session``)."""
    leaders = set()
    for p in reversed(procs):
        try:
            if p.pid == os.getpgid(p.pid):
                leaders.add(p.pid)
        except ProcessLookupError:
            pass
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        if p.pid in leaders:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is empty: nothing was left behind


class StackClient:
    """The REST API as a client sees it, with the ``bench`` user's token: one kept-alive HTTP connection
    per thread (as ``requests.Session`` or a browser keeps one), and, for ``timed_turn(watch=True)``, one
    open event stream per session (``SessionWatch``)."""

    def __init__(self, api: str, token: str, session_id: str | None = None):
        self.api = api
        parsed = urllib.parse.urlsplit(api)
        self.host, self.port, self.prefix = parsed.hostname or "127.0.0.1", parsed.port or 80, parsed.path
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        self.session_id = session_id or f"bench-{int(time.time())}"
        self._local = threading.local()
        self._watches: dict[str, SessionWatch] = {}

    #: A kept-alive connection idle longer than this is reopened before a request (uvicorn closes idle
    #: ones after 5 s): a POST is never sent on a connection the server may be closing.
    IDLE_REOPEN_SECONDS = 2.0

    def _connection(self) -> http.client.HTTPConnection:
        conn, used = getattr(self._local, "conn", None), getattr(self._local, "used", 0.0)
        if conn is not None and time.monotonic() - used > self.IDLE_REOPEN_SECONDS:
            conn.close()
            conn = None
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return conn

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request on this thread's kept-alive connection; the answer's JSON. Raises ``OSError`` when
        the API cannot be reached and ``RuntimeError`` on a status ≥ 400. A ``GET`` whose connection the
        server closed meanwhile is sent once more on a new one (never a ``POST``: it could post twice)."""
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request(method, self.prefix + path, body=data, headers=self.headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                self._local.conn = None
                if attempt == 2 or method != "GET":
                    raise
                continue
            finally:
                self._local.used = time.monotonic()
            if resp.status >= 400:
                raise RuntimeError(f"{method} {path}: {resp.status} {raw[:300]!r}")
            return json.loads(raw or b"null")
        raise AssertionError("unreachable")

    def wait_up(self, *, make_session: bool = True) -> None:
        """Until gunicorn answers (at most about 20 s), then make the client's session."""
        for _ in range(200):
            try:
                self.call("GET", "/sessions/")
                break
            except OSError:
                self._local.conn = None
                time.sleep(0.1)
        if make_session:
            self.make_session(self.session_id)

    def make_session(self, session_id: str) -> None:
        self.call("POST", "/sessions/", {"id": session_id})

    def post_turn(self, text: str, session_id: str) -> dict[str, Any]:
        """``POST`` a turn; ``{"post_start", "post_end"}`` (epoch seconds) and ``"turn"`` as answered."""
        post_start = time.time()
        turn = self.call("POST", f"/sessions/{session_id}/turns/", {"input": text})
        return {"post_start": post_start, "post_end": time.time(), "turn": turn}

    def watch(self, session_id: str) -> SessionWatch:
        """This session's open event stream (opened on first use, kept until ``close``)."""
        w = self._watches.get(session_id)
        if w is None:
            w = self._watches[session_id] = SessionWatch(self, session_id)
        return w

    def unwatch(self, session_id: str) -> None:
        """Close the session's event stream, if open."""
        w = self._watches.pop(session_id, None)
        if w is not None:
            w.close()

    def close(self) -> None:
        for w in self._watches.values():
            w.close()
        self._watches.clear()

    def timed_turn(self, text: str, *, session_id: str | None = None, watch: bool = False) -> dict[str, Any]:
        """POST a turn and wait until it is terminal; it must succeed. ``watch``: as a chat client waits —
        on the session's open event stream (``GET /api/sessions/{id}/events/``, ASGI), until the turn's
        terminal event, then one ``GET`` of the turn for its timings; else polling ``GET /api/turns/{id}/``
        every 5 ms. A record for ``bench_figures.turn_phases``: ``post_start``, ``post_end``, ``seen``
        (epoch seconds: the terminal event read, or the poll that saw it), ``seconds`` (POST → seen,
        monotonic) and ``turn`` (the terminal turn)."""
        sid = session_id or self.session_id
        w = self.watch(sid) if watch else None
        t0 = time.monotonic()
        record = self.post_turn(text, sid)
        turn = record["turn"]
        if w is not None:
            w.wait_terminal(str(turn["id"]))
            seen, seconds = time.time(), time.monotonic() - t0
            turn = self.call("GET", f"/turns/{turn['id']}/")
        else:
            while turn["status"] not in TERMINAL:
                time.sleep(0.005)
                turn = self.call("GET", f"/turns/{turn['id']}/")
            seen, seconds = time.time(), time.monotonic() - t0
        record.update(seen=seen, seconds=seconds, turn=turn)
        assert turn["status"] == "succeeded", turn
        return record

    def turn(self, text: str, *, session_id: str | None = None, watch: bool = False) -> tuple[float, dict[str, Any]]:
        """``timed_turn`` as ``(seconds, the turn)``."""
        record = self.timed_turn(text, session_id=session_id, watch=watch)
        return record["seconds"], record["turn"]


class SessionWatch:
    """An open ``GET /api/sessions/{id}/events/`` stream read by a thread of its own; ``wait_terminal``
    returns once a turn's ``completed`` / ``failed`` / ``cancelled`` event has arrived. The stream starts
    "from now on": open it before posting the turns to wait for."""

    TERMINAL_EVENTS = ("completed", "failed", "cancelled")

    def __init__(self, client: StackClient, session_id: str):
        self.conn = http.client.HTTPConnection(client.host, client.port, timeout=120)
        self.conn.request("GET", f"{client.prefix}/sessions/{session_id}/events/",
                          headers={**client.headers, "Accept": "text/event-stream"})
        self.resp = self.conn.getresponse()
        if self.resp.status != 200:
            raise RuntimeError(f"event stream of {session_id}: {self.resp.status} {self.resp.read()[:300]!r}")
        self.ended: dict[str, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, name=f"watch-{session_id}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        event, data = "", ""
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    return
                text = line.decode().rstrip("\r\n")
                if text.startswith("event:"):
                    event = text[6:].strip()
                elif text.startswith("data:"):
                    data = text[5:].strip()
                elif not text:
                    if event in self.TERMINAL_EVENTS and data:
                        with self._cond:
                            self.ended[str(json.loads(data).get("turn"))] = event
                            self._cond.notify_all()
                    event, data = "", ""
        except Exception:  # noqa: BLE001 — ``close`` shut the socket under the read (http.client raises various)
            return
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def wait_terminal(self, turn_id: str, timeout: float = 120.0) -> str:
        """The turn's terminal event name; raises ``TimeoutError`` or ``RuntimeError`` (stream ended)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while turn_id not in self.ended:
                if self._closed:
                    raise RuntimeError(f"the event stream ended before turn {turn_id} did")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"turn {turn_id}: no terminal event within {timeout:g} s")
                self._cond.wait(left)
            return self.ended.pop(turn_id)

    def close(self) -> None:
        try:
            self.conn.sock and self.conn.sock.shutdown(2)  # wakes the reader
        except OSError:
            pass
        self.conn.close()
        self._thread.join(timeout=5)
