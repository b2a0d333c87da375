"""``make bench``'s stacks: a gunicorn API plus Celery turn workers on a turn queue of their own, with the
environment that picks the worker's warm behaviour, and the REST client that times turns through them.

Two kinds of stack run side by side in one bench (same database, broker, model stand-in and codex):

* **baseline**: ``HERMES_WARM_IDLE_SECONDS=0 HERMES_WARM_POOL=0 CODEX_PROJECT_DOCS=1`` — the product
  as it was before issue 9: every turn spawns, initializes and resumes its own app-server (with codex's
  AGENTS.md lookups) and closes it after the turn (the cold path);
* **warm**: ``HERMES_WARM_IDLE_SECONDS=120 HERMES_WARM_POOL=1`` (and no project docs, the default) — the
  worker keeps a spare app-server ready and keeps a session's thread loaded between its turns.

Each worker is one process, ``celery -A project worker -Q <queue>,celery -c 1 -n <unique>@%h``, as
session affinity needs (it adds the worker's own queue ``<queue>.<node name>`` itself)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
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

    Give gunicorn processes, not threads, for concurrent POSTs: an API process's first turns, posted at
    once from several threads, race in ``dispatch._run_turn_task`` (one thread's autodiscovery is under
    way, another's lookup raises ``NotRegistered``) and the turn waits for the sweep, which the bench
    does not run."""

    name: str
    env: dict[str, str]
    http_workers: int = 1
    http_threads: int = 1
    api: str = ""
    gunicorn: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_workers: int = 0

    def start_api(self) -> str:
        """Start gunicorn on a free port; the API's base URL (``…/api``)."""
        port = free_port()
        argv = [str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind", f"127.0.0.1:{port}",
                "--workers", str(self.http_workers), "--log-level", "warning"]
        if self.http_threads > 1:
            argv += ["--threads", str(self.http_threads)]
        self.gunicorn = subprocess.Popen(argv, cwd=BASE, env=self.env)
        self.api = f"http://127.0.0.1:{port}/api"
        return self.api

    def add_worker(self) -> subprocess.Popen[bytes]:
        """Start one more ``-c 1`` worker (its own process group; node name unique in the run)."""
        self.started_workers += 1
        node = f"bench-{self.name}-{self.started_workers}-{os.getpid()}@%h"
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker",
                                 "-Q", f"{self.env['HERMES_TURN_QUEUE']},celery", "-c", "1", "-n", node,
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
    """The REST API as a client sees it, with the ``bench`` user's token."""

    def __init__(self, api: str, token: str, session_id: str | None = None):
        self.api = api
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        self.session_id = session_id or f"bench-{int(time.time())}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.api + path, method=method, headers=self.headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")

    def wait_up(self, *, make_session: bool = True) -> None:
        """Until gunicorn answers (at most about 20 s), then make the client's session."""
        for _ in range(200):
            try:
                self.call("GET", "/sessions/")
                break
            except OSError:
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

    def timed_turn(self, text: str, *, session_id: str | None = None) -> dict[str, Any]:
        """POST a turn and poll it every 5 ms until terminal; it must succeed. A record for
        ``bench_figures.turn_phases``: ``post_start``, ``post_end``, ``seen`` (epoch seconds), ``seconds``
        (POST → seen, monotonic) and ``turn`` (the terminal turn)."""
        t0 = time.monotonic()
        record = self.post_turn(text, session_id or self.session_id)
        turn = record["turn"]
        while turn["status"] not in TERMINAL:
            time.sleep(0.005)
            turn = self.call("GET", f"/turns/{turn['id']}/")
        record.update(seen=time.time(), seconds=time.monotonic() - t0, turn=turn)
        assert turn["status"] == "succeeded", turn
        return record

    def turn(self, text: str, *, session_id: str | None = None) -> tuple[float, dict[str, Any]]:
        """``timed_turn`` as ``(seconds, the turn)``."""
        record = self.timed_turn(text, session_id=session_id)
        return record["seconds"], record["turn"]
