#!/usr/bin/env python
"""``make faults`` — fault injection against the real stack; nothing lost, nothing doubled, nothing stuck.

One private stack per run, all real processes on this machine:

* PostgreSQL: a database ``<name>_faults`` beside ``DATABASE_URL``, dropped and created afresh, migrated;
* a **private** ``redis-server`` started by this script on a free port (the broker; the shared Redis is
  never touched — ``broker-restart`` kills and restarts only this one, which keeps nothing on disk);
* the model stand-in (``python -m hermes_sessions.model_stand_in``; an input with ``SLOW`` streams its
  reply over ``--slow-seconds``, so a kill lands mid-turn);
* gunicorn serving the REST API, driven over HTTP with a token user, as a client would;
* Celery turn workers (``-Q <unique queue> -c 2``), each in its own process group so a whole worker
  (MainProcess and prefork children) can be ``kill -9``-ed, plus one sweep worker with embedded beat
  (``hermes_sessions.tasks.sweep_turns`` every second) on the default queue;
* codex 0.169.0 app-servers, spawned per turn by the workers, with ``CODEX_HOME`` under a temp dir.

Every process imports the project from a snapshot of the working tree taken at start-up (tracked and
untracked files, as they are then), so edits made while the suite runs cannot mix two versions of the
code in one run. ``scripts/faults_selftest.py`` plants defects in the database and shows the checks
report each of them.

Scenarios (``--scenarios``, comma-separated; all by default):

``kill-worker``         SLOW turns on several sessions; again and again ``kill -9`` the worker running one
                        (found through the codex process working in that session's directory), start a
                        replacement; normal turns keep coming.
``duplicate-delivery``  every turn's ``run_turn`` task is also sent straight to the broker again — while it is
                        queued, while it runs and after it finished; late duplicates must change nothing.
``concurrent-posts``    50 concurrent POSTs to one session, some pairs sharing an ``Idempotency-Key``.
``broker-restart``      the private redis-server is killed mid-run (queued task messages are lost) and
                        restarted on the same port; posts go on before, during and after; the sweep
                        re-dispatches lost turns.

After each scenario (every accepted turn terminal, bounded by ``--bound``) the database is checked:
each accepted input (a 202) has exactly one turn and it is terminal; succeeded turns have their user row
and their assistant reply (else *lost*); no doubled user row, codex item or assistant reply, no seq gap or
repeat (else *duplicates*); bindings obey I1–I3 (one active binding per session, naming the thread of the
session's latest succeeded turn, bound only by a succeeded turn; one thread per session without
rotations; no two turns of a session running at once, turns run in accepted order); one notice per
rotation; no 5xx answer; no codex app-server left over. Exits 0 only when every row is clean.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

BASE = Path(__file__).resolve().parent.parent

TERMINAL = ("succeeded", "failed", "cancelled")
SCENARIOS = ("kill-worker", "duplicate-delivery", "concurrent-posts", "broker-restart")


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------- processes


class Proc:
    """A child process in its own session/process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict, logdir: Path):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(argv, cwd=env.get("PYTHONPATH") or BASE, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill9(self) -> None:
        """``kill -9`` the whole process group (a Celery MainProcess and its prefork children)."""
        self.signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # stragglers of the group (e.g. prefork children)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def snapshot_tree(dest: Path) -> Path:
    """Copy the project's files (tracked and untracked, not ignored — the working tree as it is now)
    to ``dest``; every process of the run imports the code from there, so edits made to the working
    tree while the suite runs cannot mix two versions of the code in one run."""
    import shutil

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=BASE,
                            capture_output=True, check=True).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = BASE / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def _last_error(proc: Proc) -> str:
    lines = [ln for ln in proc.log_tail(400).splitlines() if "CRITICAL" in ln or "Unrecoverable" in ln]
    return (lines[-1] if lines else proc.log_tail(1))[:200]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return 0


def codex_processes(codex_home: str) -> list[dict]:
    """Processes that codex spawned for this run: their (allow-listed) environment carries our
    ``CODEX_HOME`` and, unlike our own Python processes, no ``DATABASE_URL``."""
    marker = f"CODEX_HOME={codex_home}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        env = _read(f"/proc/{pid}/environ").split(b"\0")
        if marker not in env or any(e.startswith(b"DATABASE_URL=") for e in env):
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        found.append({"pid": pid, "ppid": _ppid(pid), "cwd": cwd, "cmd": cmd})
    return found


def ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1 and len(out) < 20:
        pid = _ppid(pid)
        out.append(pid)
    return out


# --------------------------------------------------------------------------------------- the stack


class Stack:
    def __init__(self, args, scratch: Path):
        self.args = args
        self.scratch = scratch
        self.logdir = scratch / "logs"
        self.logdir.mkdir(parents=True)
        self.codex_home = str((scratch / "codex_home").resolve())
        self.work_root = str((scratch / "work").resolve())
        self.queue = f"faults-turns-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.procs: list[Proc] = []
        self.workers: list[Proc] = []
        self.worker_seq = 0
        self.redis: Proc | None = None
        self.redis_starts = 0
        self.redis_port = free_port()
        self.env: dict = {}
        self.api = ""
        self.headers: dict = {}
        self.celery_app = None

    # -- start-up

    def start(self, db_url: str) -> None:
        a = self.args
        self.code = snapshot_tree(self.scratch / "code")
        sys.path.insert(0, str(self.code))
        stand_in_port_file = self.scratch / "stand_in.port"
        self.env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "CELERY_TASK_ALWAYS_EAGER": "0",
            "CODEX_HOME": self.codex_home,
            "CODEX_USER_HOME": str(self.scratch / "user_home"),
            "CODEX_WORK_ROOT": self.work_root,
            "CODEX_MODEL_PROVIDER": "stand-in",
            "HERMES_TURN_QUEUE": self.queue,
            "HERMES_LEASE_SECONDS": "4",
            "HERMES_HEARTBEAT_SECONDS": "0.5",
            "HERMES_SWEEP_SECONDS": "1",
            "HERMES_REDISPATCH_SECONDS": "5",
            "HERMES_MAX_ATTEMPTS": "5",
            "CODEX_TURN_TIMEOUT": "60",
            "HERMES_VISIBILITY_TIMEOUT": "120",
            "HERMES_LOG_LEVEL": "INFO",
            "HERMES_VAR_DIR": str(self.scratch / "var"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(self.code),
            "CODEX_NODE_MODULES": str(BASE / "node_modules"),
        }
        for name in ("CODEX_APP_SERVER_COMMAND", "CODEX_BIN", "CODEX_MODEL", "CODEX_CONFIG_TOML"):
            self.env.pop(name, None)

        self.start_redis()
        self.procs.append(Proc("stand_in", [sys.executable, "-m", "hermes_sessions.model_stand_in", "--port", "0",
                                            "--port-file", str(stand_in_port_file),
                                            "--slow-seconds", str(a.slow_seconds)], self.env, self.logdir))
        deadline = time.monotonic() + 30
        while not (stand_in_port_file.exists() and stand_in_port_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError("the model stand-in did not start:\n" + self.procs[-1].log_tail())
            time.sleep(0.05)
        self.env["CODEX_STAND_IN_URL"] = f"http://127.0.0.1:{stand_in_port_file.read_text().strip()}/v1"

        # This process reads and checks the faults database and sends duplicate tasks to the private broker.
        os.environ.update({k: v for k, v in self.env.items() if k not in ("PYTHONUNBUFFERED", "PYTHONPATH")})
        os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
        recreate_database(db_url)
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        from hermes_sessions.codex.launch import ensure_codex_home

        ensure_codex_home()
        user, _ = get_user_model().objects.get_or_create(username="faults")
        token, _ = Token.objects.get_or_create(user=user)
        self.headers = {"Authorization": f"Token {token.key}", "Content-Type": "application/json"}
        from project.celery import app

        self.celery_app = app

        http_port = free_port()
        self.procs.append(Proc("gunicorn", [str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind",
                                            f"127.0.0.1:{http_port}", "--workers", "2", "--worker-class", "gthread",
                                            "--threads", "8", "--timeout", "120", "--log-level", "warning"],
                               self.env, self.logdir))
        self.api = f"http://127.0.0.1:{http_port}/api"
        # The sweep: beat embedded in a worker of its own on the default queue; never killed.
        self.procs.append(Proc("sweeper", [sys.executable, "-m", "celery", "-A", "project", "worker", "-B",
                                           "-s", str(self.scratch / "celerybeat-schedule"), "-Q", "celery", "-c", "1",
                                           "-n", f"faults-sweeper-{os.getpid()}@%h", "--without-gossip",
                                           "--without-mingle", "--without-heartbeat", "-l", "info"],
                               self.env, self.logdir))
        for _ in range(a.workers):
            self.start_worker()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.call("GET", "/sessions/")
                break
            except (OSError, HttpError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError("gunicorn did not answer:\n" + self.procs[1].log_tail()) from exc
                time.sleep(0.2)
        self.wait_ready(self.procs[2])
        for w in self.workers:
            self.wait_ready(w)

    def start_redis(self) -> None:
        self.redis_starts += 1
        self.redis = Proc(f"redis{self.redis_starts}", ["redis-server", "--port", str(self.redis_port), "--bind",
                                                       "127.0.0.1", "--save", "", "--appendonly", "no",
                                                       "--daemonize", "no"], self.env, self.logdir)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or not self.redis.alive():
                raise RuntimeError("redis-server did not start:\n" + self.redis.log_tail())
            time.sleep(0.05)

    def start_worker(self) -> Proc:
        self.worker_seq += 1
        name = f"worker{self.worker_seq}"
        w = Proc(name, [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", self.queue, "-c",
                        str(self.args.concurrency), "-n", f"faults-{name}-{os.getpid()}@%h", "--without-gossip",
                        "--without-mingle", "--without-heartbeat", "-l", "info"], self.env, self.logdir)
        self.workers.append(w)
        return w

    def wait_ready(self, proc: Proc, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in proc.log_path.read_text(errors="replace"):
                return
            if not proc.alive():
                break
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} did not become ready:\n{proc.log_tail()}")

    def reap_dead(self) -> list[str]:
        """Workers (and the sweeper) that exited although nobody killed them: replaced; their names
        and last log line returned, for the scenario to report."""
        dead = []
        for w in list(self.workers):
            if not w.alive():
                dead.append(f"{w.name} exited on its own (rc {w.popen.returncode}): {_last_error(w)}")
                self.workers.remove(w)
                self.wait_ready(self.start_worker())
        sweeper = self.procs[2]
        if not sweeper.alive():
            dead.append(f"the sweeper (beat) exited on its own (rc {sweeper.popen.returncode}): {_last_error(sweeper)}")
            self.procs[2] = Proc(f"sweeper{self.worker_seq}", sweeper.popen.args, self.env, self.logdir)
            self.wait_ready(self.procs[2])
        return dead

    def broker_backlog(self) -> tuple[int, int]:
        """(messages waiting in the turn queue, messages delivered but unacknowledged)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.redis_port, db=0, socket_timeout=5)
        try:
            return int(client.llen(self.queue)), int(client.hlen("unacked"))
        finally:
            client.close()

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for p in reversed(self.procs):
            p.stop()
        if self.redis is not None:
            self.redis.stop()

    # -- the client

    def call(self, method: str, path: str, body=None, headers=None, timeout: float = 60):
        """One API request; returns ``(status, json)``. Raises ``HttpError`` for a 5xx answer."""
        req = urllib.request.Request(self.api + path, method=method, headers={**self.headers, **(headers or {})},
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                data = json.loads(raw or b"null")
            except ValueError:
                data = raw[:500].decode(errors="replace")
            if exc.code >= 500:
                raise HttpError(exc.code, data) from None
            return exc.code, data

    def send_duplicate(self, turn_id: str) -> None:
        self.celery_app.send_task("hermes_sessions.tasks.run_turn", args=[turn_id], queue=self.queue)

    def queue_length(self) -> int:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.redis_port, db=0, socket_timeout=5)
        try:
            return int(client.llen(self.queue))
        finally:
            client.close()


class HttpError(Exception):
    def __init__(self, code: int, data):
        super().__init__(f"HTTP {code}: {str(data)[:300]}")
        self.code, self.data = code, data


def recreate_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1].split("?")[0]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(url: str) -> None:
    """Remove the scratch database after a clean run (a failed run keeps it for inspection)."""
    import psycopg

    name = url.rsplit("/", 1)[1].split("?")[0]
    try:
        with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception as exc:  # noqa: BLE001 — leaving it behind is harmless
        log(f"could not drop {name}: {exc}")


# --------------------------------------------------------------------------------------- a scenario's record


@dataclass
class Posted:
    turn_id: str
    session_id: str
    text: str
    posted_at: float  # wall clock, just before the POST was sent


@dataclass
class Record:
    name: str
    runs: int = 0
    posted: list[Posted] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    http_5xx: list[str] = field(default_factory=list)
    unanswered: list[tuple[str, str]] = field(default_factory=list)  # (session, text) posts that got no 202
    lock: threading.Lock = field(default_factory=threading.Lock)
    row: dict = field(default_factory=dict)
    worker_restarts: int = 0  # workers that exited on their own and were restarted, as a supervisor would


class Scenario:
    def __init__(self, stack: Stack, args, name: str):
        self.stack, self.args = stack, args
        self.rec = Record(name)
        self.tag = f"{name}-{uuid.uuid4().hex[:6]}"

    def new_session(self) -> str:
        sid = f"{self.tag}-s{len(self.rec.sessions) + 1}"
        status, data = self.stack.call("POST", "/sessions/", {"id": sid, "title": self.rec.name})
        if status != 201:
            raise RuntimeError(f"session create: {status} {data}")
        self.rec.sessions.append(sid)
        return sid

    def post(self, session_id: str, text: str, key: str | None = None) -> dict | None:
        """POST an input; records the 202 (a repeat of an Idempotency-Key is recorded once)."""
        headers = {"Idempotency-Key": key} if key else None
        t0 = time.time()
        try:
            status, data = self.stack.call("POST", f"/sessions/{session_id}/turns/", {"input": text}, headers=headers)
        except HttpError as exc:
            with self.rec.lock:
                self.rec.http_5xx.append(f"POST turns ({text[:40]}…): {exc}")
                self.rec.unanswered.append((session_id, text))
            return None
        except OSError as exc:
            with self.rec.lock:
                self.rec.violations.append(f"POST turns ({text[:40]}…) got no answer: {exc}")
                self.rec.unanswered.append((session_id, text))
            return None
        if status != 202:
            with self.rec.lock:
                self.rec.violations.append(f"POST turns answered {status}: {str(data)[:200]}")
                self.rec.unanswered.append((session_id, text))
            return None
        with self.rec.lock:
            if not any(p.turn_id == data["id"] for p in self.rec.posted):
                self.rec.posted.append(Posted(data["id"], session_id, text, t0))
        return data

    def text(self, i: int, slow: bool = False) -> str:
        return f"{self.tag} input {i} {uuid.uuid4().hex[:8]}" + (" SLOW" if slow else "")

    def turn_statuses(self, ids: list[str]) -> dict[str, dict]:
        out = {}
        for tid in ids:
            try:
                status, data = self.stack.call("GET", f"/turns/{tid}/", timeout=10)
            except (HttpError, OSError) as exc:
                self.rec.http_5xx.append(f"GET turn: {exc}") if isinstance(exc, HttpError) else None
                continue
            if status == 200:
                out[tid] = data
        return out

    def wait_terminal(self) -> None:
        """Until every accepted turn is terminal (via the ORM: cheap), bounded by ``--bound``
        after the last post."""
        from hermes_sessions.models import Turn

        last_post = max((p.posted_at for p in self.rec.posted), default=time.time())
        ids = [p.turn_id for p in self.rec.posted]
        while True:
            open_ = Turn.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).count()
            if open_ == 0:
                return
            if time.time() - last_post > self.args.bound:
                return
            time.sleep(0.5)


# --------------------------------------------------------------------------------------- scenarios


def scenario_kill_worker(sc: Scenario) -> None:
    a, stack = sc.args, sc.stack
    sessions = [sc.new_session() for _ in range(a.kill_sessions)]
    i = 0
    for s in sessions:  # each session starts its thread with a normal turn
        i += 1
        sc.post(s, sc.text(i))
    kills = 0
    killed_turns: Counter = Counter()
    for rnd in range(a.kill_rounds):
        for s in sessions:
            i += 1
            sc.post(s, sc.text(i, slow=True))
            i += 1
            sc.post(s, sc.text(i))
        # Wait for a SLOW turn running on a worker (its codex process is in the session's workdir).
        deadline = time.monotonic() + 60
        victim = None
        while time.monotonic() < deadline and victim is None:
            from hermes_sessions.models import Turn

            running = list(Turn.objects.filter(pk__in=[p.turn_id for p in sc.rec.posted], status="running",
                                               input__endswith="SLOW").values_list("pk", "session_id", "attempt"))
            # Prefer a turn killed least often, so one turn is not killed into HERMES_MAX_ATTEMPTS.
            running.sort(key=lambda r: (killed_turns[str(r[0])], r[2]))
            procs = codex_processes(stack.codex_home)
            for tid, sid, _attempt in running:
                workdir = os.path.join(stack.work_root, sid)
                for cp in procs:
                    if cp["cwd"] != workdir:
                        continue
                    chain = ancestors(cp["pid"])
                    owner = next((w for w in stack.workers if w.pid in chain), None)
                    if owner is not None:
                        victim = (str(tid), sid, owner)
                        break
                if victim:
                    break
            if victim is None:
                time.sleep(0.1)
        if victim is None:
            sc.rec.notes.append(f"round {rnd + 1}: no SLOW turn seen running on a worker within 60 s")
            continue
        tid, sid, owner = victim
        time.sleep(random.uniform(0.0, min(2.5, a.slow_seconds * 0.6)))  # land in different phases of the turn
        log(f"kill-worker round {rnd + 1}: kill -9 {owner.name} (pid group {owner.pid}) running turn {tid[:8]} of {sid}")
        owner.kill9()
        stack.workers.remove(owner)
        kills += 1
        killed_turns[tid] += 1
        replacement = stack.start_worker()
        stack.wait_ready(replacement)
    sc.rec.runs = kills
    sc.rec.notes.append(f"{kills} workers killed mid-turn; {len(killed_turns)} distinct turns hit")


def scenario_duplicate_delivery(sc: Scenario) -> None:
    a, stack = sc.args, sc.stack
    from hermes_sessions.models import Message, Turn

    sessions = [sc.new_session() for _ in range(a.dup_sessions)]
    sent = 0
    i = 0
    for rnd in range(a.dup_turns):
        for s in sessions:
            i += 1
            turn = sc.post(s, sc.text(i, slow=(rnd % 2 == 1)))
            if turn is None:
                continue
            stack.send_duplicate(turn["id"])  # queued (or about to be claimed): a second delivery at once
            sent += 1
    # While running: a duplicate for each turn seen running.
    ids = [p.turn_id for p in sc.rec.posted]
    seen_running: set[str] = set()
    deadline = time.monotonic() + a.bound
    while time.monotonic() < deadline:
        rows = dict(Turn.objects.filter(pk__in=ids).values_list("pk", "status"))
        for tid, status in rows.items():
            if status == "running" and str(tid) not in seen_running:
                seen_running.add(str(tid))
                stack.send_duplicate(str(tid))
                stack.send_duplicate(str(tid))
                sent += 2
        if all(s in TERMINAL for s in rows.values()):
            break
        time.sleep(0.05)
    sc.wait_terminal()
    # After it finished: snapshot, a third delivery of every turn, let them drain, compare.
    def snapshot():
        turns = {str(t["pk"]): t for t in Turn.objects.filter(pk__in=ids).values(
            "pk", "status", "finished_at", "attempt", "codex_thread_id", "final_text")}
        msgs = Counter(str(t) for t in Message.objects.filter(turn_id__in=ids).values_list("turn_id", flat=True))
        return turns, msgs

    before = snapshot()
    for tid in ids:
        stack.send_duplicate(tid)
        sent += 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and stack.queue_length() > 0:
        time.sleep(0.2)
    time.sleep(3)  # the last reserved duplicates run (each is a no-op claim)
    after = snapshot()
    if before != after:
        changed = [tid for tid in ids if before[0].get(tid) != after[0].get(tid) or before[1][tid] != after[1][tid]]
        sc.rec.violations.append(f"a late duplicate delivery changed {len(changed)} finished turn(s): {changed[:3]}")
    sc.rec.runs = sent
    sc.rec.notes.append(f"{sent} extra deliveries of run_turn ({len(seen_running)} while running, {len(ids)} after finishing)")


def scenario_concurrent_posts(sc: Scenario) -> None:
    a = sc.args
    sid = sc.new_session()
    n_keys = a.idem_keys
    plain = a.concurrent_posts - 2 * n_keys
    jobs = [(sc.text(i), None) for i in range(plain)]
    keyed = []
    for k in range(n_keys):
        text, key = sc.text(1000 + k), f"{sc.tag}-key-{k}"
        keyed.append((text, key))
        jobs += [(text, key), (text, key)]
    random.shuffle(jobs)
    barrier = threading.Barrier(len(jobs))
    results: dict[int, dict | None] = {}

    def worker(n, text, key):
        barrier.wait()
        results[n] = sc.post(sid, text, key)

    threads = [threading.Thread(target=worker, args=(n, t, k)) for n, (t, k) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each Idempotency-Key pair must have answered with one and the same turn.
    for _text, key in keyed:
        ids = {r["id"] for n, r in results.items() if r is not None and jobs[n][1] == key}
        if len(ids) != 1:
            sc.rec.violations.append(f"Idempotency-Key {key} answered with {len(ids)} different turns")
    # The same key with another body is refused and creates nothing.
    text, key = keyed[0] if keyed else (None, None)
    if key:
        status, _ = sc.stack.call("POST", f"/sessions/{sid}/turns/", {"input": text + " changed"},
                                  headers={"Idempotency-Key": key})
        if status not in (409, 422):
            sc.rec.violations.append(f"Idempotency-Key reused with another body answered {status}, not 409/422")
    sc.rec.runs = len(jobs)
    sc.rec.notes.append(f"{len(jobs)} concurrent POSTs to one session ({n_keys} keys sent twice)")


def scenario_broker_restart(sc: Scenario) -> None:
    a, stack = sc.args, sc.stack
    sessions = [sc.new_session() for _ in range(a.broker_sessions)]
    i = 0
    stop = threading.Event()

    def poster(s):
        nonlocal i
        n = 0
        while not stop.is_set():
            n += 1
            i += 1
            sc.post(s, sc.text(i, slow=(n % 3 == 0)))
            stop.wait(random.uniform(0.3, 1.2))

    threads = [threading.Thread(target=poster, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    restarts = lost_msgs = 0
    try:
        for rnd in range(a.broker_restarts):
            time.sleep(a.broker_before)
            queued, unacked = stack.broker_backlog()
            lost_msgs += queued + unacked
            log(f"broker-restart round {rnd + 1}: SIGKILL redis-server (port {stack.redis_port}); "
                f"{queued} queued and {unacked} unacknowledged task message(s) are lost")
            stack.redis.kill9()
            stack.redis.stop()
            time.sleep(a.broker_down)
            stack.start_redis()
            restarts += 1
            log(f"broker-restart round {rnd + 1}: redis-server back on port {stack.redis_port}")
            time.sleep(min(a.broker_before, 3.0))  # the workers reconnect (or die) meanwhile
            for dead in stack.reap_dead():
                # Celery 5.7 / kombu 5.7's Redis transport can crash a worker while it restores
                # unacknowledged messages after a broker restart (cf. celery/celery#10205). Production
                # runs workers under a supervisor (systemd Restart=always, README); this harness plays
                # that part and counts it. The data checks below still have to hold.
                log(f"broker-restart round {rnd + 1}: {dead}; restarted (supervisor)")
                sc.rec.worker_restarts += 1
                sc.rec.notes.append(f"after broker restart {rnd + 1}: {dead}; restarted as a supervisor would")
        time.sleep(a.broker_after)
    finally:
        stop.set()
        for t in threads:
            t.join()
    sc.rec.runs = restarts
    sc.rec.notes.append(f"{restarts} broker restarts; {lost_msgs} task message(s) were in the broker when it died")


# --------------------------------------------------------------------------------------- checks


def check(sc: Scenario, bound: float) -> dict:
    from django.db.models import Count

    from hermes_sessions.models import CodexBinding, Message, Notice, Turn

    rec = sc.rec
    v = rec.violations
    posted = {p.turn_id: p for p in rec.posted}
    turns = {str(t.pk): t for t in Turn.objects.filter(session_id__in=rec.sessions)}

    # Every accepted input: exactly one turn (its text names it uniquely), terminal.
    per_text = Counter((t.session_id, t.input) for t in turns.values())
    terminal = stuck = lost = dups = 0
    longest = 0.0
    failed: Counter = Counter()
    for tid, p in posted.items():
        t = turns.get(tid)
        if t is None:
            v.append(f"accepted turn {tid} does not exist")
            lost += 1
            continue
        if per_text[(p.session_id, p.text)] != 1:
            v.append(f"input {p.text!r} has {per_text[(p.session_id, p.text)]} turns")
            dups += per_text[(p.session_id, p.text)] - 1
        if t.status in TERMINAL:
            terminal += 1
            if t.finished_at is not None:
                longest = max(longest, t.finished_at.timestamp() - p.posted_at)
            if t.finished_at is None or t.finished_at.timestamp() - p.posted_at > bound:
                v.append(f"turn {tid} took longer than {bound:.0f} s to reach {t.status}")
            if t.status == "failed":
                failed[(t.error or "?")[:160]] += 1
        else:
            stuck += 1
    if stuck:
        v.append(f"{stuck} accepted turn(s) not terminal after {bound:.0f} s")
    posted_texts = {(p.session_id, p.text) for p in rec.posted}
    unanswered = set(rec.unanswered)
    for tid, t in turns.items():
        if tid in posted:
            continue
        if (t.session_id, t.input) in unanswered:
            # The client got an error (5xx / no answer), yet the input was taken: a turn it does not know of.
            v.append(f"a POST answered with an error still created turn {tid} ({t.status})")
            if t.status not in TERMINAL:
                stuck += 1
        elif (t.session_id, t.input) not in posted_texts:
            v.append(f"turn {tid} exists that no POST accepted")
            dups += 1

    # Transcript: user row and reply of every succeeded turn; nothing doubled; seq dense.
    msgs = list(Message.objects.filter(session_id__in=rec.sessions).order_by("session_id", "seq"))
    by_turn: dict[str, list] = defaultdict(list)
    by_session: dict[str, list] = defaultdict(list)
    for m in msgs:
        by_turn[str(m.turn_id)].append(m)
        by_session[m.session_id].append(m)
    for tid, t in turns.items():
        rows = by_turn.get(tid, [])
        users = [m for m in rows if m.role == "user"]
        replies = [m for m in rows if m.role == "assistant"]
        if len(users) > 1:
            dups += len(users) - 1
            v.append(f"turn {tid}: {len(users)} user rows")
        items = Counter((m.codex_item_id, m.role) for m in rows if m.codex_item_id)
        for (item, role), n in items.items():
            if n > 1:
                dups += n - 1
                v.append(f"turn {tid}: codex item {item} ({role}) stored {n} times")
        if t.status == "succeeded":
            if not users or users[0].content != t.input:
                lost += 1
                v.append(f"succeeded turn {tid} lacks its user row")
            if not replies:
                lost += 1
                v.append(f"succeeded turn {tid} lacks its assistant reply")
            elif len(replies) > 1:
                dups += len(replies) - 1
                v.append(f"succeeded turn {tid}: {len(replies)} assistant replies for one echo")
            elif t.input not in replies[0].content or t.final_text != replies[0].content:
                v.append(f"succeeded turn {tid}: the reply does not answer its input")
        if users and users[0].seq > min((m.seq for m in rows), default=users[0].seq):
            v.append(f"turn {tid}: a row precedes its user row")
    for sid in rec.sessions:
        seqs = [m.seq for m in by_session.get(sid, [])]
        if seqs != list(range(1, len(seqs) + 1)):
            dups += len(seqs) - len(set(seqs))
            v.append(f"session {sid}: message seq not 1..{len(seqs)} (gaps or repeats)")
        tseqs = sorted(t.seq for t in turns.values() if t.session_id == sid)
        if tseqs != list(range(1, len(tseqs) + 1)):
            v.append(f"session {sid}: turn seq not 1..{len(tseqs)}")

    # Bindings (I1–I3) and notices.
    rotations = 0
    for sid in rec.sessions:
        st = sorted((t for t in turns.values() if t.session_id == sid), key=lambda t: t.seq)
        bindings = list(CodexBinding.objects.filter(session_id=sid))
        active = [b for b in bindings if b.status == "active"]
        if len(active) > 1:
            v.append(f"session {sid}: {len(active)} active bindings")
        ok = [t for t in st if t.status == "succeeded" and t.thread_action]
        rotated = [t for t in st if t.thread_action == "rotated"]
        rotations += len(rotated)
        if ok:
            latest = ok[-1]
            ended_later = any(b.ended_by_turn_id and b.ended_by_turn_id != latest.pk and b.ended_at
                              and latest.finished_at and b.ended_at > latest.finished_at for b in bindings)
            if not active and not ended_later:
                v.append(f"session {sid}: succeeded turns but no active binding")
            elif active and active[0].thread_id != latest.codex_thread_id:
                v.append(f"session {sid}: active binding {active[0].thread_id} is not the thread of its latest "
                         f"succeeded turn ({latest.codex_thread_id}, turn #{latest.seq})")
            threads = {t.codex_thread_id for t in ok}
            if len(threads) > 1 + len(rotated):
                v.append(f"session {sid}: {len(threads)} codex threads with {len(rotated)} rotation(s) — "
                         "a turn did not resume the session's thread")
            started_ok = [t for t in ok if t.thread_action == "started"]
            if len(started_ok) > 1:
                v.append(f"session {sid}: {len(started_ok)} succeeded turns started a new thread")
        for b in bindings:  # I1: a binding is created only by a turn whose rows committed with it
            creator = turns.get(str(b.created_by_turn_id))
            if creator is None or creator.status != "succeeded" or creator.codex_thread_id != b.thread_id:
                v.append(f"session {sid}: binding {b.thread_id} not created by a succeeded turn on that thread")
        # I3: no two turns of the session ran at once; they ran in accepted order.
        ran = [t for t in st if t.started_at is not None]
        for prev, nxt in zip(ran, ran[1:], strict=False):
            if prev.finished_at is None or prev.finished_at > nxt.started_at:
                v.append(f"session {sid}: turns #{prev.seq} and #{nxt.seq} overlapped or ran out of order")
        notices = Notice.objects.filter(session_id=sid).count()
        if notices != len(rotated):
            v.append(f"session {sid}: {notices} notices for {len(rotated)} rotations")
    per_turn_notice = (Notice.objects.filter(session_id__in=rec.sessions, turn__isnull=False)
                       .values("turn").annotate(n=Count("id")).filter(n__gt=1).count())
    if per_turn_notice:
        v.append(f"{per_turn_notice} turn(s) with more than one notice")

    for dead in sc.stack.reap_dead():
        v.append(dead)
    if rec.http_5xx:
        v.append(f"{len(rec.http_5xx)} answer(s) 5xx, e.g. {rec.http_5xx[0]}")

    # No codex app-server left over: every turn is over, so none should be running.
    deadline = time.monotonic() + 10
    left = codex_processes(sc.stack.codex_home)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = codex_processes(sc.stack.codex_home)
    if left:
        v.append(f"{len(left)} codex process(es) left over: " + "; ".join(f"pid {p['pid']} {p['cmd'][:60]}" for p in left[:3]))

    statuses = Counter(t.status for t in turns.values() if str(t.pk) in posted)
    rec.row = {
        "scenario": rec.name,
        "runs": rec.runs,
        "accepted": len(posted),
        "terminal": terminal,
        "lost": lost,
        "duplicates": dups,
        "longest_s": round(longest, 1),
        "failed": statuses.get("failed", 0),
        "worker_restarts": rec.worker_restarts,
        "stuck": stuck,
        "violations": v,
        "failed_reasons": dict(failed),
        "notes": rec.notes,
        "rotations": rotations,
    }
    return rec.row


# --------------------------------------------------------------------------------------- main


def print_table(rows: list[dict]) -> None:
    cols = [("scenario", "scenario"), ("runs", "runs"), ("accepted", "inputs accepted"), ("terminal", "turns terminal"),
            ("lost", "messages lost"), ("duplicates", "duplicates"), ("longest_s", "longest to terminal (s)"),
            ("failed", "failed turns"), ("worker_restarts", "worker restarts"), ("nviol", "violations")]
    data = [{**r, "nviol": len(r["violations"]), "worker_restarts": r.get("worker_restarts", 0)} for r in rows]
    widths = {k: max(len(h), *(len(str(d[k])) for d in data)) for k, h in cols}
    print()
    print("  ".join(h.ljust(widths[k]) for k, h in cols))
    print("  ".join("-" * widths[k] for k, _ in cols))
    for d in data:
        print("  ".join(str(d[k]).ljust(widths[k]) for k, _ in cols))
    print()
    for r in rows:
        for note in r["notes"]:
            print(f"{r['scenario']}: {note}")
        for reason, n in r["failed_reasons"].items():
            print(f"{r['scenario']}: failed ×{n}: {reason}")
        for viol in r["violations"][:15]:
            print(f"{r['scenario']}: VIOLATION {viol}")
        if len(r["violations"]) > 15:
            print(f"{r['scenario']}: … {len(r['violations']) - 15} more violations")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--workers", type=int, default=2, help="turn workers (each -c CONCURRENCY)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--slow-seconds", type=float, default=5.0, help="how long a SLOW reply streams")
    p.add_argument("--bound", type=float, default=90.0, help="seconds from the last POST by which every turn is terminal")
    p.add_argument("--kill-rounds", type=int, default=5)
    p.add_argument("--kill-sessions", type=int, default=3)
    p.add_argument("--dup-sessions", type=int, default=2)
    p.add_argument("--dup-turns", type=int, default=4, help="turns per session in duplicate-delivery")
    p.add_argument("--concurrent-posts", type=int, default=50)
    p.add_argument("--idem-keys", type=int, default=5, help="keys sent twice among the concurrent posts")
    p.add_argument("--broker-sessions", type=int, default=3)
    p.add_argument("--broker-restarts", type=int, default=2)
    p.add_argument("--broker-before", type=float, default=4.0, help="seconds of posting before each kill")
    p.add_argument("--broker-down", type=float, default=3.0, help="seconds the broker stays down")
    p.add_argument("--broker-after", type=float, default=4.0, help="seconds of posting after the last restart")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs) and the *_faults database afterwards")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(unknown)}")
    random.seed(args.seed)

    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        sys.exit("make faults needs DATABASE_URL=postgres://… (the Makefile sets it); a *_faults database is made beside it")
    base, name = db_url.rsplit("/", 1)
    name, _, query = name.partition("?")
    faults_db = f"{base}/{name or 'hermes'}_faults" + (f"?{query}" if query else "")

    def on_term(signum, frame):
        # Once: a second Ctrl-C must not cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (a background job)
    t_start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hermes-faults-"))
    stack = Stack(args, scratch)
    rows: list[dict] = []
    leftover: list[dict] = []
    ok = interrupted = False
    try:
        log(f"starting the stack (scratch {scratch}, database {faults_db.rsplit('/', 1)[1]}, "
            f"private redis on :{stack.redis_port}, queue {stack.queue})")
        stack.start(faults_db)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BASE, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=BASE, capture_output=True, text=True).stdout.splitlines()
        log(f"stack up (code: git {head} + {len(dirty)} changed/untracked path(s), snapshot in {stack.code})")
        runners = {
            "kill-worker": scenario_kill_worker,
            "duplicate-delivery": scenario_duplicate_delivery,
            "concurrent-posts": scenario_concurrent_posts,
            "broker-restart": scenario_broker_restart,
        }
        for name in chosen:
            t0 = time.monotonic()
            log(f"scenario {name}")
            sc = Scenario(stack, args, name)
            try:
                runners[name](sc)
            except Exception as exc:  # noqa: BLE001 — a scenario that breaks is a failed row, not a crash
                sc.rec.violations.append(f"the scenario itself failed: {type(exc).__name__}: {exc}")
            sc.wait_terminal()
            from django.db import close_old_connections

            close_old_connections()
            row = check(sc, args.bound)
            rows.append(row)
            log(f"scenario {name} done in {time.monotonic() - t0:.0f} s: {row['accepted']} accepted, "
                f"{row['terminal']} terminal, {len(row['violations'])} violation(s)")
        # Every worker stopped: no codex app-server may outlive them.
        stack.stop_workers()
        time.sleep(1)
        leftover = codex_processes(stack.codex_home)
        ok = bool(rows) and all(not r["violations"] and r["lost"] == 0 and r["duplicates"] == 0
                                and r["terminal"] == r["accepted"] for r in rows) and not leftover
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted; cleaning up")
    finally:
        stack.stop()
        for cp in codex_processes(stack.codex_home):  # ours, by CODEX_HOME: never leave them running
            try:
                os.kill(cp["pid"], signal.SIGKILL)
            except OSError:
                pass
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001
            pass
    if rows:
        print_table(rows)
    if interrupted:
        pass
    elif leftover:
        print(f"VIOLATION: {len(leftover)} codex process(es) left after the workers stopped: "
              + "; ".join(f"pid {p['pid']} cwd {p['cwd']}" for p in leftover[:5]))
    else:
        print("codex processes left after the workers stopped: 0")
    print(f"runtime: {time.monotonic() - t_start:.0f} s; logs: {scratch / 'logs' if args.keep or not ok else '(removed)'}")
    if ok and not args.keep:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(faults_db)
    print("faults: OK" if ok else "faults: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
