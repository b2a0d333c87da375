"""``make bench`` — wall time of one turn through the whole stack against codex driven directly.

Everything runs in one go on this machine with the same model stand-in and the same pinned codex:

* **stack**: ``POST /api/sessions/{id}/turns/`` on gunicorn → Redis → a Celery worker → a fresh
  ``codex app-server`` that resumes the session's thread → PostgreSQL, until ``GET /api/turns/{id}/``
  reports ``succeeded`` (polled every 5 ms);
* **same work**: a minimal script spawns the app-server, ``initialize``, ``thread/resume``,
  ``turn/start`` → ``turn/completed``, closes it (what the worker must do for a restarted session);
* **warm**: ``turn/start`` → ``turn/completed`` on an app-server already running with the thread loaded.

Runs are interleaved (stack, same work, warm, …) so drift hits all three alike. Prints the medians
and ``ratio_vs_same_work`` / ``ratio_vs_warm``. Needs ``DATABASE_URL`` (PostgreSQL; a ``*_bench``
database is created beside it and dropped after the run) and ``CELERY_BROKER_URL``. Run as ``python -m devtools.bench [--runs N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from devtools.databases import create_database, database_beside, drop_database
from devtools.processes import free_port, stand_in_argv, wait_for_port_file

BASE = Path(__file__).resolve().parent.parent


class Direct:
    """A minimal newline-delimited JSON-RPC driver for ``codex app-server`` (no threads)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=cwd)
        self.next_id = 0

    def send(self, msg: dict[str, Any]) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any]) -> Any:
        self.next_id += 1
        rid = self.next_id
        self.send({"id": rid, "method": method, "params": params})
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("id") == rid and "method" not in msg:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def wait_turn_completed(self) -> str:
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("method") == "turn/completed":
                return msg["params"]["turn"]["status"]

    def initialize(self) -> None:
        self.request("initialize", {"clientInfo": {"name": "bench", "title": None, "version": "0"}})
        self.send({"method": "initialized", "params": {}})

    def turn(self, thread_id: str, text: str) -> None:
        self.request("turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]})
        status = self.wait_turn_completed()
        assert status == "completed", status

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


class StackClient:
    """The REST API as a client sees it, with the ``bench`` user's token."""

    def __init__(self, api: str, token: str):
        self.api = api
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        self.session_id = f"bench-{int(time.time())}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.api + path, method=method, headers=self.headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")

    def wait_up(self) -> None:
        """Until gunicorn answers (at most about 20 s), then make the bench session."""
        for _ in range(200):
            try:
                self.call("GET", "/sessions/")
                break
            except OSError:
                time.sleep(0.1)
        self.call("POST", "/sessions/", {"id": self.session_id})

    def turn(self, text: str) -> tuple[float, dict[str, Any]]:
        """POST a turn and poll it every 5 ms until terminal; ``(seconds, the turn)``; it must succeed."""
        t0 = time.monotonic()
        turn = self.call("POST", f"/sessions/{self.session_id}/turns/", {"input": text})
        while turn["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.005)
            turn = self.call("GET", f"/turns/{turn['id']}/")
        elapsed = time.monotonic() - t0
        assert turn["status"] == "succeeded", turn
        return elapsed, turn


def _environment(bench_db_url: str, broker: str, scratch: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": bench_db_url,
        "CELERY_BROKER_URL": broker,
        "CELERY_TASK_ALWAYS_EAGER": "0",
        "CODEX_HOME": str(scratch / "codex_home"),
        "CODEX_HOMES_ROOT": str(scratch / "homes"),
        "CODEX_USER_HOME": str(scratch / "user_home"),
        "CODEX_WORK_ROOT": str(scratch / "work"),
        "CODEX_MODEL_PROVIDER": "stand-in",
        "HERMES_LOG_LEVEL": "WARNING",
        "HERMES_TURN_QUEUE": f"bench-turns-{os.getpid()}",
    }
    env.pop("CODEX_APP_SERVER_COMMAND", None)
    return env


def _start_stand_in(env: dict[str, str], scratch: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """The model stand-in, in its own process; its URL goes into ``env``."""
    port_file = scratch / "stand_in.port"
    stand_in = subprocess.Popen(stand_in_argv(port_file), cwd=BASE, stdout=subprocess.DEVNULL)
    procs.append(stand_in)
    port = wait_for_port_file(port_file, timeout=30,
                              failed=lambda: None if stand_in.poll() is None else "the model stand-in exited")
    env["CODEX_STAND_IN_URL"] = f"http://127.0.0.1:{port}/v1"


def _setup_django(env: dict[str, str]) -> str:
    """This process on the bench database (created, migrated); returns the ``bench`` user's token."""
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_TASK_ALWAYS_EAGER", "CODEX_HOME",
                                            "CODEX_HOMES_ROOT", "CODEX_USER_HOME", "CODEX_WORK_ROOT", "CODEX_STAND_IN_URL", "HERMES_TURN_QUEUE")})
    create_database(env["DATABASE_URL"])
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from hermes_sessions.codex.launch import ensure_codex_home

    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench")
    token, _ = Token.objects.get_or_create(user=user)
    ensure_codex_home()
    return token.key


def _start_api_and_worker(env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> str:
    """gunicorn (one worker) and a Celery turn worker (``-c 1``); returns the API's base URL."""
    http_port = free_port()
    procs.append(subprocess.Popen([str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind", f"127.0.0.1:{http_port}",
                                   "--workers", "1", "--log-level", "warning"], cwd=BASE, env=env))
    procs.append(subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", env["HERMES_TURN_QUEUE"],
                                   "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                                   "-l", "warning"], cwd=BASE, env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL))
    return f"http://127.0.0.1:{http_port}/api"


def _direct_thread(argv: list[str], codex_env: dict[str, str], work: str) -> tuple[Direct, str]:
    """A fresh app-server with a new thread that has had one turn (so it has a rollout)."""
    d = Direct(argv, codex_env, work)
    d.initialize()
    thread = d.request("thread/start", {"cwd": work})["thread"]["id"]
    d.turn(thread, "warm-up")
    return d, thread


def _measure(client: StackClient, runs: int, work: str) -> dict[str, Any]:
    """``runs`` interleaved rounds of stack, same work and warm; the seconds of each and the worker's
    phase timings."""
    from hermes_sessions.codex.launch import app_server_argv, app_server_env

    client.turn("warm-up")  # starts the session's thread
    argv, codex_env = app_server_argv(), app_server_env()
    Path(work).mkdir(parents=True, exist_ok=True)
    d, direct_thread = _direct_thread(argv, codex_env, work)  # the direct script's own thread
    d.close()
    warm, warm_thread = _direct_thread(argv, codex_env, work)  # the warm app-server: kept loaded
    out: dict[str, Any] = {"stack": [], "same": [], "warm": [], "phases": [], "argv": argv}
    for i in range(runs):
        elapsed, turn = client.turn(f"bench {i}")
        out["stack"].append(elapsed)
        out["phases"].append(turn["timings"])
        t0 = time.monotonic()
        d = Direct(argv, codex_env, work)
        d.initialize()
        d.request("thread/resume", {"threadId": direct_thread, "excludeTurns": True})
        d.turn(direct_thread, f"bench {i}")
        d.close()
        out["same"].append(time.monotonic() - t0)
        t0 = time.monotonic()
        warm.turn(warm_thread, f"bench {i}")
        out["warm"].append(time.monotonic() - t0)
    warm.close()
    return out


def _print_results(runs: int, m: dict[str, Any]) -> None:
    s, a, w = median_ms(m["stack"]), median_ms(m["same"]), median_ms(m["warm"])
    print(f"runs: {runs} (interleaved; codex {_codex_version(m['argv'])}; model stand-in; PostgreSQL + Redis)")
    print(f"median_stack_ms: {s}        (POST turn → GET shows succeeded; gunicorn, Celery worker, fresh app-server, resume)")
    print(f"median_same_work_ms: {a}    (direct script: spawn, initialize, thread/resume, turn, close)")
    print(f"median_warm_ms: {w}         (turn on an already-running app-server with the thread loaded)")
    for key in ("initialize_ms", "thread_ms", "turn_ms", "codex_ms", "run_ms"):
        vals = [p[key] for p in m["phases"] if key in p]
        if vals:
            print(f"  worker {key}: median {statistics.median(vals)}")
    print(f"ratio_vs_same_work: {s / a:.2f}")
    print(f"ratio_vs_warm: {s / w:.2f}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM) if p.pid == os.getpgid(p.pid) else p.terminate()
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its medians; exits with a message without PostgreSQL and a broker."""
    parser = argparse.ArgumentParser(prog="python -m devtools.bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)

    db_url = os.environ.get("DATABASE_URL", "")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    env = _environment(database_beside(db_url, "_bench"), broker, scratch)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start_stand_in(env, scratch, procs)
        token = _setup_django(env)
        client = StackClient(_start_api_and_worker(env, procs), token)
        client.wait_up()
        _print_results(args.runs, _measure(client, args.runs, env["CODEX_WORK_ROOT"]))
        return 0
    finally:
        _stop(procs)
        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(env["DATABASE_URL"])  # a scratch database: nothing in it outlives the run


def _codex_version(argv: list[str]) -> str:
    try:
        return subprocess.run([argv[0], "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
