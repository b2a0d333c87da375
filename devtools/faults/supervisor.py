"""The private stack of a ``make faults`` run and its supervisor: child processes in process groups of
their own (started, stopped, ``kill -9``-ed, replaced when they die), the private broker that
``broker-restart`` kills and restarts (brokers.py: redis-server or a RabbitMQ node), the REST client,
and the scan for codex processes left over."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from devtools.faults.pgproxy import PgProxy
from devtools.processes import (
    CodexProcess,
    ancestors,
    codex_processes,
    free_port,
    stand_in_argv,
    wait_for_port_file,
)

if TYPE_CHECKING:
    from devtools.faults.brokers import Broker

BASE = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    """One progress line on stdout, ``[faults HH:MM:SS] msg``."""
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class HttpError(Exception):
    """The API answered 5xx; ``code`` and the decoded body ``data`` are kept."""

    def __init__(self, code: int, data: Any):
        super().__init__(f"HTTP {code}: {str(data)[:300]}")
        self.code, self.data = code, data


# --------------------------------------------------------------------------------------- processes


class Proc:
    """A child process in its own session/process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # closed by stop()
        self.popen = subprocess.Popen(argv, cwd=env.get("PYTHONPATH") or BASE, env=env, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _wait(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill9(self) -> None:
        """``kill -9`` the whole process group (a Celery MainProcess and its prefork children)."""
        self.signal_group(signal.SIGKILL)
        self._wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the group, up to ``timeout`` seconds to exit, then SIGKILL to what is left."""
        if self.alive():
            self.signal_group(signal.SIGTERM)
            self._wait(timeout)
        self.signal_group(signal.SIGKILL)  # stragglers of the group (e.g. prefork children)
        self._wait(5)
        self._log.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def last_error(self) -> str:
        """The last CRITICAL/Unrecoverable line of the log (else its last line), at most 200 characters."""
        lines = [ln for ln in self.log_tail(400).splitlines() if "CRITICAL" in ln or "Unrecoverable" in ln]
        return (lines[-1] if lines else self.log_tail(1))[:200]


def pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not: it runs nothing, its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def snapshot_tree(dest: Path) -> Path:
    """Copy the project's files (tracked and untracked, not ignored — the working tree as it is now)
    to ``dest``; every process of the run imports the code from there, so edits made to the working
    tree while the suite runs cannot mix two versions of the code in one run."""
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


# --------------------------------------------------------------------------------------- the stack


class Stack:
    """PostgreSQL (a scratch database), a private broker (``--broker``), the model stand-in, gunicorn, a sweep
    worker with embedded beat and the turn workers, all on code snapshotted at start-up."""

    def __init__(self, args: Namespace, scratch: Path):
        self.args = args
        self.scratch = scratch
        self.logdir = scratch / "logs"
        self.logdir.mkdir(parents=True)
        # codex's homes: the shared one (tools) and the per-session ones, both found by this prefix.
        self.codex_home = str((scratch / "codex").resolve())
        self.work_root = str((scratch / "work").resolve())
        self.queue = f"faults-turns-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.procs: list[Proc] = []  # stand-in, gunicorn, sweeper — in that order
        self.workers: list[Proc] = []
        self.worker_seq = 0
        from devtools.faults.brokers import make_broker  # brokers.py imports Proc from here

        self.broker: Broker = make_broker(getattr(args, "broker", "redis"), scratch, self.logdir)
        self.env: dict[str, str] = {}
        self.api = ""
        self.headers: dict[str, str] = {}
        self.celery_app: Any = None
        self.code = scratch / "code"
        self.pgproxy: PgProxy | None = None  # the turn workers' only way to PostgreSQL (pgproxy.py)
        # App-servers of turn workers killed with ``kill9_worker`` that outlived them (PR_SET_PDEATHSIG
        # should take them along); reported, once, by ``codex_outliving`` (invariants.check_stack).
        self.outlived: list[str] = []

    # -- start-up

    def _environment(self, db_url: str) -> dict[str, str]:
        env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "CELERY_BROKER_URL": self.broker.url,
            "CELERY_TASK_ALWAYS_EAGER": "0",
            "CODEX_HOME": f"{self.codex_home}/home",
            "CODEX_HOMES_ROOT": f"{self.codex_home}/homes",
            "CODEX_USER_HOME": str(self.scratch / "user_home"),
            "CODEX_WORK_ROOT": self.work_root,
            "CODEX_MODEL_PROVIDER": "stand-in",
            "HERMES_TURN_QUEUE": self.queue,
            "HERMES_LEASE_SECONDS": "4",
            "HERMES_HEARTBEAT_SECONDS": "0.5",
            "HERMES_SWEEP_SECONDS": "1",
            "HERMES_REDISPATCH_SECONDS": "5",
            "HERMES_MAX_ATTEMPTS": "5",
            # Session affinity (-c 1 workers keep threads loaded): heartbeats as often as the lease's,
            # and a worker whose heartbeat is older than the lease is not routed to and is swept.
            "HERMES_WORKER_HEARTBEAT_SECONDS": "0.5",
            "HERMES_WORKER_STALE_SECONDS": "4",
            "CODEX_TURN_TIMEOUT": "60",
            "HERMES_VISIBILITY_TIMEOUT": "120",
            "HERMES_LOG_LEVEL": "INFO",
            "HERMES_VAR_DIR": str(self.scratch / "var"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(self.code),
            "CODEX_NODE_MODULES": str(BASE / "node_modules"),
        }
        for name in ("CODEX_APP_SERVER_COMMAND", "CODEX_BIN", "CODEX_MODEL", "CODEX_CONFIG_TOML", "HERMES_OWN_ROUTE",
                     "HERMES_WARM_IDLE_SECONDS", "HERMES_WARM_MAX_THREADS", "HERMES_AFFINITY_DEADLINE"):
            env.pop(name, None)
        return env

    def start(self, db_url: str) -> None:
        """Snapshot the code, start every process on the database ``db_url`` (recreated and migrated),
        and return once the API answers and every worker is ready. Raises ``RuntimeError``."""
        snapshot_tree(self.code)
        sys.path.insert(0, str(self.code))
        self.env = self._environment(db_url)
        parts = urlsplit(db_url)
        self.pgproxy = PgProxy((parts.hostname or "127.0.0.1", parts.port or 5432), free_port())
        self.pgproxy.up()
        self.broker.start(self.env)
        self._start_stand_in()
        self._setup_database(db_url)
        self._start_api_and_workers()

    def _start_stand_in(self) -> None:
        port_file = self.scratch / "stand_in.port"
        stand_in = Proc("stand_in", stand_in_argv(port_file, slow_seconds=self.args.slow_seconds), self.env,
                        self.logdir)
        self.procs.append(stand_in)
        try:
            port = wait_for_port_file(port_file, timeout=30)
        except RuntimeError as exc:
            raise RuntimeError("the model stand-in did not start:\n" + stand_in.log_tail()) from exc
        self.env["CODEX_STAND_IN_URL"] = f"http://127.0.0.1:{port}/v1"

    def _setup_database(self, db_url: str) -> None:
        """This process reads and checks the faults database and sends duplicate tasks to the
        private broker: it takes the stack's environment and sets Django up on it."""
        from devtools.databases import recreate_database

        os.environ.update({k: v for k, v in self.env.items() if k not in ("PYTHONUNBUFFERED", "PYTHONPATH")})
        os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
        recreate_database(db_url)
        import django

        django.setup()
        from django.contrib.auth import get_user_model
        from django.core.management import call_command
        from rest_framework.authtoken.models import Token

        from hermes_sessions.codex.launch import ensure_codex_home
        from project.celery import app

        call_command("migrate", verbosity=0)
        ensure_codex_home()
        user, _ = get_user_model().objects.get_or_create(username="faults")
        token, _ = Token.objects.get_or_create(user=user)
        self.headers = {"Authorization": f"Token {token.key}", "Content-Type": "application/json"}
        self.celery_app = app

    def _start_api_and_workers(self) -> None:
        http_port = free_port()
        self.procs.append(Proc("gunicorn", [str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind",
                                            f"127.0.0.1:{http_port}", "--workers", "2", "--worker-class", "gthread",
                                            "--threads", "8", "--timeout", "120", "--log-level", "warning"],
                               self.env, self.logdir))
        self.api = f"http://127.0.0.1:{http_port}/api"
        # The sweep: beat embedded in a worker of its own on the default queue; killed only by kill-beat-with-worker.
        self.procs.append(Proc("sweeper", [sys.executable, "-m", "celery", "-A", "project", "worker", "-B",
                                           "-s", str(self.scratch / "celerybeat-schedule"), "-Q", "celery", "-c", "1",
                                           "-n", f"faults-sweeper-{os.getpid()}@%h", "--without-gossip",
                                           "--without-mingle", "--without-heartbeat", "-l", "info"],
                               self.env, self.logdir))
        for _ in range(self.args.workers):
            self.start_worker()
        self._wait_api()
        self.wait_ready(self.procs[2])
        for w in self.workers:
            self.wait_ready(w)

    def _wait_api(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.call("GET", "/sessions/")
                return
            except (OSError, HttpError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError("gunicorn did not answer:\n" + self.procs[1].log_tail()) from exc
                time.sleep(0.2)

    def worker_database_url(self, name: str) -> str:
        """The database URL of turn worker ``name``: through the proxy, unencrypted (so a trap can read
        the SQL), named ``name`` (so a trap knows whose connection it caught)."""
        assert self.pgproxy is not None
        parts = urlsplit(self.env["DATABASE_URL"])
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{self.pgproxy.port}"
        query = "&".join(filter(None, [parts.query, "sslmode=disable", f"application_name={name}"]))
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host, query=query))

    def start_worker(self) -> Proc:
        """One more turn worker (``-Q <queue> -c CONCURRENCY``) in a process group of its own, reaching
        PostgreSQL through the proxy. With ``-c 1`` (the default) it also has a route (woken by NOTIFY) and keeps
        threads loaded between turns (session affinity, ``hermes_sessions/worker/affinity.py``)."""
        self.worker_seq += 1
        name = f"worker{self.worker_seq}"
        env = {**self.env, "DATABASE_URL": self.worker_database_url(name)}
        w = Proc(name, [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", self.queue, "-c",
                        str(self.args.concurrency), "-n", f"faults-{name}-{os.getpid()}@%h", "--without-gossip",
                        "--without-mingle", "--without-heartbeat", "-l", "info"], env, self.logdir)
        self.workers.append(w)
        return w

    def wait_ready(self, proc: Proc, timeout: float = 60) -> None:
        """Until a Celery worker logs `` ready.``; raises ``RuntimeError`` if it exits or times out."""
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
                dead.append(f"{w.name} exited on its own (rc {w.popen.returncode}): {w.last_error()}")
                self.workers.remove(w)
                self.wait_ready(self.start_worker())
        sweeper = self.procs[2]
        if not sweeper.alive():
            dead.append(f"the sweeper (beat) exited on its own (rc {sweeper.popen.returncode}): {sweeper.last_error()}")
            self.procs[2] = Proc(f"sweeper{self.worker_seq}", list(sweeper.popen.args), self.env, self.logdir)
            self.wait_ready(self.procs[2])
        return dead

    def codex_of(self, worker: Proc) -> list[CodexProcess]:
        """The codex app-servers running under turn worker ``worker`` (its pool process's children)."""
        return [cp for cp in codex_processes(self.codex_home) if worker.pid in ancestors(cp.pid)]

    def kill9_worker(self, worker: Proc, grace: float = 5.0) -> list[int]:
        """``kill -9`` the worker's whole process group and take it out of ``workers`` (no replacement).
        The codex app-servers it had (running a turn or kept loaded) must go with it (``PR_SET_PDEATHSIG``):
        waits up to ``grace`` seconds for them; each still running then is noted in ``outlived`` (a
        violation of the scenario, ``invariants.check_stack``). Returns their pids."""
        pids = [cp.pid for cp in self.codex_of(worker)]
        worker.kill9()
        if worker in self.workers:
            self.workers.remove(worker)
        t0 = time.monotonic()
        while any(pid_alive(p) for p in pids) and time.monotonic() - t0 < grace:
            time.sleep(0.1)
        self.outlived += [f"codex pid {p} of {worker.name} still running {grace:g} s after {worker.name} was "
                          "killed with SIGKILL" for p in pids if pid_alive(p)]
        return pids

    def codex_outliving(self, grace: float = 5.0) -> list[str]:
        """Codex app-servers that outlived their worker, one line each: those ``kill9_worker`` noted since
        the last call, and any codex process of the run under no running turn worker (after up to
        ``grace`` seconds for it to go)."""
        deadline = time.monotonic() + grace
        while True:
            live = {w.pid for w in self.workers if w.alive()}
            orphans = [cp for cp in codex_processes(self.codex_home) if not live & set(ancestors(cp.pid))]
            if not orphans or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out, self.outlived = self.outlived, []
        return out + [f"codex pid {cp.pid} (cwd {cp.cwd}) runs under no turn worker" for cp in orphans
                      if not any(line.startswith(f"codex pid {cp.pid} ") for line in out)]

    def worker_queue(self, worker: Proc) -> str:
        """The route of ``worker`` (``-c 1``) from its ``TurnWorker`` row (its pool process's heartbeat),
        or ``""`` when it has none."""
        from hermes_sessions.models import TurnWorker

        for queue, pid in TurnWorker.objects.values_list("queue", "pid"):
            if queue.startswith(f"{self.queue}.faults-{worker.name}-") and (pid == worker.pid or worker.pid in ancestors(pid)):
                return queue
        return ""

    def codex_left(self, wait: float = 0.0) -> list[CodexProcess]:
        """Codex processes of this run still alive, after up to ``wait`` seconds for them to go."""
        deadline = time.monotonic() + wait
        left = codex_processes(self.codex_home)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = codex_processes(self.codex_home)
        return left

    def kill_codex(self) -> None:
        """SIGKILL every codex process of this run (found by ``CODEX_HOME``): never leave them running."""
        for cp in codex_processes(self.codex_home):
            try:
                os.kill(cp.pid, signal.SIGKILL)
            except OSError:
                pass

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def stop(self) -> None:
        """Stop every process of the stack, the turn workers first."""
        self.stop_workers()
        for p in reversed(self.procs):
            p.stop()
        self.broker.stop()
        if self.pgproxy is not None:
            self.pgproxy.close()

    def worker_named(self, name: str) -> Proc | None:
        """The running turn worker called ``name`` (its proxy connections carry that name)."""
        return next((w for w in self.workers if w.name == name), None)

    # -- the broker

    def broker_backlog(self) -> tuple[int, int]:
        """(messages waiting in the turn queue, messages delivered but unacknowledged); (-1, -1) if the
        broker could not say."""
        return self.broker.backlog(self.queue)

    def queue_length(self) -> int:
        """Messages waiting in the turn queue."""
        return self.broker.queue_length(self.queue)

    def send_duplicate(self, turn_id: str) -> None:
        """Send the turn's task to the broker once more, as a duplicate delivery would."""
        self.celery_app.send_task("hermes_sessions.tasks.run_turn", args=[turn_id], queue=self.queue)

    # -- the client

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             timeout: float = 60) -> tuple[int, Any]:
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
