#!/usr/bin/env python
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
database is created beside it) and ``CELERY_BROKER_URL``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BASE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Direct:
    """A minimal newline-delimited JSON-RPC driver for ``codex app-server`` (no threads)."""

    def __init__(self, argv, env, cwd):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=cwd)
        self.next_id = 0

    def send(self, msg):
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, method, params):
        self.next_id += 1
        rid = self.next_id
        self.send({"id": rid, "method": method, "params": params})
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("id") == rid and "method" not in msg:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def wait_turn_completed(self):
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("method") == "turn/completed":
                return msg["params"]["turn"]["status"]

    def initialize(self):
        self.request("initialize", {"clientInfo": {"name": "bench", "title": None, "version": "0"}})
        self.send({"method": "initialized", "params": {}})

    def turn(self, thread_id, text):
        self.request("turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]})
        status = self.wait_turn_completed()
        assert status == "completed", status

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def median_ms(values):
    return round(statistics.median(values) * 1000, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    db_url = os.environ.get("DATABASE_URL", "")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    bench_db_url = db_url.rsplit("/", 1)[0] + "/" + (db_url.rsplit("/", 1)[1] or "hermes") + "_bench"

    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    codex_home, user_home, work = scratch / "codex_home", scratch / "user_home", scratch / "work"
    procs: list[subprocess.Popen] = []
    env = {
        **os.environ,
        "DATABASE_URL": bench_db_url,
        "CELERY_BROKER_URL": broker,
        "CELERY_TASK_ALWAYS_EAGER": "0",
        "CODEX_HOME": str(codex_home),
        "CODEX_USER_HOME": str(user_home),
        "CODEX_WORK_ROOT": str(work),
        "CODEX_MODEL_PROVIDER": "stand-in",
        "HERMES_LOG_LEVEL": "WARNING",
        "HERMES_TURN_QUEUE": f"bench-turns-{os.getpid()}",
    }
    env.pop("CODEX_APP_SERVER_COMMAND", None)
    try:
        # The model stand-in, in its own process.
        port_file = scratch / "stand_in.port"
        procs.append(subprocess.Popen([sys.executable, "-m", "hermes_sessions.model_stand_in", "--port", "0",
                                       "--port-file", str(port_file)], cwd=BASE, stdout=subprocess.DEVNULL))
        while not port_file.exists() or not port_file.read_text().strip():
            time.sleep(0.05)
        env["CODEX_STAND_IN_URL"] = f"http://127.0.0.1:{port_file.read_text().strip()}/v1"
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_TASK_ALWAYS_EAGER", "CODEX_HOME",
                                                "CODEX_USER_HOME", "CODEX_WORK_ROOT", "CODEX_STAND_IN_URL", "HERMES_TURN_QUEUE")})

        _create_database(bench_db_url)
        import django

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        from hermes_sessions.codex.launch import app_server_argv, app_server_env, ensure_codex_home

        user, _ = get_user_model().objects.get_or_create(username="bench")
        token, _ = Token.objects.get_or_create(user=user)
        ensure_codex_home()

        http_port = free_port()
        procs.append(subprocess.Popen([str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind", f"127.0.0.1:{http_port}",
                                       "--workers", "1", "--log-level", "warning"], cwd=BASE, env=env))
        procs.append(subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", env["HERMES_TURN_QUEUE"],
                                       "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                                       "-l", "warning"], cwd=BASE, env=env, start_new_session=True,
                                      stdout=subprocess.DEVNULL))
        api = f"http://127.0.0.1:{http_port}/api"
        headers = {"Authorization": f"Token {token.key}", "Content-Type": "application/json"}

        def call(method, path, body=None):
            req = urllib.request.Request(api + path, method=method, headers=headers,
                                         data=json.dumps(body).encode() if body is not None else None)
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")

        for _ in range(200):
            try:
                call("GET", "/sessions/")
                break
            except OSError:
                time.sleep(0.1)
        session_id = f"bench-{int(time.time())}"
        call("POST", "/sessions/", {"id": session_id})

        def stack_turn(text):
            t0 = time.monotonic()
            turn = call("POST", f"/sessions/{session_id}/turns/", {"input": text})
            while turn["status"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.005)
                turn = call("GET", f"/turns/{turn['id']}/")
            elapsed = time.monotonic() - t0
            assert turn["status"] == "succeeded", turn
            return elapsed, turn

        stack_turn("warm-up")  # starts the session's thread

        argv, codex_env = app_server_argv(), app_server_env()
        work.mkdir(parents=True, exist_ok=True)
        # The direct script's own thread, with one turn so it has a rollout.
        d = Direct(argv, codex_env, str(work))
        d.initialize()
        direct_thread = d.request("thread/start", {"cwd": str(work)})["thread"]["id"]
        d.turn(direct_thread, "warm-up")
        d.close()
        # The warm app-server: a separate thread, kept loaded.
        warm = Direct(argv, codex_env, str(work))
        warm.initialize()
        warm_thread = warm.request("thread/start", {"cwd": str(work)})["thread"]["id"]
        warm.turn(warm_thread, "warm-up")

        stack, same, hot, phases = [], [], [], []
        for i in range(args.runs):
            elapsed, turn = stack_turn(f"bench {i}")
            stack.append(elapsed)
            phases.append(turn["timings"])
            t0 = time.monotonic()
            d = Direct(argv, codex_env, str(work))
            d.initialize()
            d.request("thread/resume", {"threadId": direct_thread, "excludeTurns": True})
            d.turn(direct_thread, f"bench {i}")
            d.close()
            same.append(time.monotonic() - t0)
            t0 = time.monotonic()
            warm.turn(warm_thread, f"bench {i}")
            hot.append(time.monotonic() - t0)
        warm.close()

        s, a, w = median_ms(stack), median_ms(same), median_ms(hot)
        print(f"runs: {args.runs} (interleaved; codex {_codex_version(argv)}; model stand-in; PostgreSQL + Redis)")
        print(f"median_stack_ms: {s}        (POST turn → GET shows succeeded; gunicorn, Celery worker, fresh app-server, resume)")
        print(f"median_same_work_ms: {a}    (direct script: spawn, initialize, thread/resume, turn, close)")
        print(f"median_warm_ms: {w}         (turn on an already-running app-server with the thread loaded)")
        for key in ("initialize_ms", "thread_ms", "turn_ms", "codex_ms", "run_ms"):
            vals = [p[key] for p in phases if key in p]
            if vals:
                print(f"  worker {key}: median {statistics.median(vals)}")
        print(f"ratio_vs_same_work: {s / a:.2f}")
        print(f"ratio_vs_warm: {s / w:.2f}")
        return 0
    finally:
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
        shutil.rmtree(scratch, ignore_errors=True)


def _create_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def _codex_version(argv) -> str:
    try:
        return subprocess.run([argv[0], "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
