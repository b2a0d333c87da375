"""The service behind PgBouncer in transaction mode (docs/operating.md "Behind PgBouncer"): a private
PgBouncer (Debian's, ``make pgbouncer``) in front of the test database; a real ASGI API process and a real
``celery worker -c 1`` whose Django connections go through it (``DATABASE_PGBOUNCER=1``) while their LISTEN
connections go to PostgreSQL itself (``DATABASE_LISTEN_URL``); the real codex binary and the model stand-in.

What would break behind transaction pooling fails here:

* a prepared statement (``DATABASE_PREPARE_THRESHOLD`` > 0, a WITH HOLD cursor, anything kept on the server
  connection between transactions): this PgBouncer runs ``DEALLOCATE ALL`` / ``CLOSE ALL`` after every
  transaction (``server_reset_query_always``), so a statement prepared in one transaction is gone in the
  next and its reuse fails the request or the turn — 5 turns reach psycopg's reuse of a statement prepared
  at its 3rd run, at the threshold of 2;
* a LISTEN through PgBouncer: the turns' wake-ups (``timings.woken``) and the event streams' NOTIFY never
  arrive — a stream then waits for its heartbeat, far longer than the bound below; and no backend whose last
  statement was a LISTEN is one of PgBouncer's server connections;
* startup ``options`` (the keepalives, the worker's idle-transaction bound): PgBouncer 1.18 refuses the
  connection ("unsupported startup parameter: options"), and nothing starts.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token

from devtools.processes import codex_processes, free_port
from hermes_sessions.models import Turn, TurnWorker
from project.celery import app as celery_app
from tests.support.sse import ApiServer, close_open_streams, open_stream

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

PGBOUNCER = os.environ.get("PGBOUNCER_PATH", "/usr/sbin/pgbouncer")
#: The event streams' heartbeat here: a stream that is not woken by NOTIFY waits this long for its next read.
HEARTBEAT = 20.0
#: A warm turn's stream ends within this (posted to completed, on a loaded 2-core machine): well under HEARTBEAT.
STREAM_BOUND = 10.0


class PgBouncer:
    """A private PgBouncer in transaction mode on a port of its own, in front of the test database's server,
    resetting every server connection after each transaction (``DEALLOCATE ALL``, ``CLOSE ALL``)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "pgbouncer.log"

    def start(self) -> PgBouncer:
        db = settings.DATABASES["default"]
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "users.txt").write_text(f'"{db["USER"]}" ""\n')
        (self.root / "pgbouncer.ini").write_text(f"""\
[databases]
{db["NAME"]} = host={db["HOST"] or "127.0.0.1"} port={db["PORT"] or 5432} dbname={db["NAME"]}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.root / "users.txt"}
admin_users = {db["USER"]}
pool_mode = transaction
; few server connections: the API's and the worker's transactions take turns on the same ones
default_pool_size = 3
max_client_conn = 200
server_reset_query = DEALLOCATE ALL; CLOSE ALL
server_reset_query_always = 1
""")
        # PgBouncer refuses to run as root; -u gives it a user to switch to (its files must be readable).
        argv = [PGBOUNCER] + (["-u", "nobody"] if os.geteuid() == 0 else []) + [str(self.root / "pgbouncer.ini")]
        if os.geteuid() == 0:
            for path in (self.root, *self.root.iterdir()):
                path.chmod(0o755 if path.is_dir() else 0o644)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            assert self.proc.poll() is None, f"pgbouncer exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"pgbouncer not up: {self.log.read_text()[-2000:]}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # PgBouncer's "safe shutdown"; SIGTERM is its immediate one
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def url(self) -> str:
        db = settings.DATABASES["default"]
        return f"postgres://{db['USER']}@127.0.0.1:{self.port}/{db['NAME']}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on PgBouncer's admin console (simple query protocol only: libpq's ``exec_``)."""
        db = settings.DATABASES["default"]
        with psycopg.connect(host="127.0.0.1", port=self.port, user=db["USER"], dbname="pgbouncer",
                             autocommit=True) as conn:
            res = conn.pgconn.exec_(f"SHOW {what}".encode())
            assert res.status == psycopg.pq.ExecStatus.TUPLES_OK, res.error_message
            names = [res.fname(i).decode() for i in range(res.nfields)]
            return [{n: (res.get_value(r, i) or b"").decode() for i, n in enumerate(names)}
                    for r in range(res.ntuples)]


@pytest.fixture
def pgbouncer(tmp_path):
    assert shutil.which(PGBOUNCER) or Path(PGBOUNCER).exists(), \
        f"PgBouncer missing at {PGBOUNCER}: run `make pgbouncer` (Debian's package)"
    bouncer = PgBouncer(tmp_path / "pgbouncer").start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture
def behind_pgbouncer(tmp_path, pgbouncer, stand_in, real_codex_bin, settings):
    """``(api, worker log)``: an API process and a ``-c 1`` worker, both with Django behind ``pgbouncer`` and
    LISTEN direct, the stand-in as codex's model."""
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    behind = {"DATABASE_URL": pgbouncer.url, "DATABASE_PGBOUNCER": "1", "DATABASE_LISTEN_URL": _database_url()}
    env = worker_env(database_url=pgbouncer.url, broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "legacy_home"),
                     CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_WORK_ROOT=str(tmp_path / "work"),
                     HERMES_WARM_IDLE_SECONDS="120", HERMES_WORKER_HEARTBEAT_SECONDS="0.5", **behind)
    celery = [sys.executable, "-m", "celery", "-A", "project"]
    subprocess.run(celery + ["purge", "-f", "-Q", TURN_QUEUE], env=env, cwd=settings.BASE_DIR, check=True,
                   capture_output=True, timeout=60)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            celery + ["worker", "-Q", TURN_QUEUE, "-c", "1", "-n", "bounced@%h", "--without-gossip",
                      "--without-mingle", "--without-heartbeat", "-l", "info"],
            env=env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    api = ApiServer(tmp_path / "api.log", heartbeat=HEARTBEAT, env=behind)
    celery_app.conf.task_always_eager = False
    try:
        wait_ready([(worker, log)])
        api.start()
        yield api, log
    finally:
        close_open_streams()
        api.stop()
        celery_app.conf.task_always_eager = True
        stop_workers([worker])
        _forget_queue(settings.CELERY_BROKER_URL)
        deadline = time.monotonic() + 10
        while codex_processes(tmp_path / "homes") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert codex_processes(tmp_path / "homes") == [], "codex processes outlived their worker"


#: Our own connections that must reach PostgreSQL itself (listener.connection_params): the worker's wake
#: listener, the API's event hub and its reader (kept open, statements prepared by psycopg's default).
OWN = {"hermes-wake", "hermes-sse-listener", "hermes-sse-reader"}


def _own_backends() -> list[tuple[str, int]]:
    """``(application_name, client_port)`` of the test database's backends that are ours (``OWN``) or whose
    last statement was a LISTEN."""
    with psycopg.connect(**_direct()) as conn:
        return [(name, port) for name, port in conn.execute(
            "SELECT application_name, client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND (query ILIKE 'LISTEN %%' OR application_name = ANY(%s)) AND pid <> pg_backend_pid()",
            [sorted(OWN)]).fetchall()]


def _direct() -> dict[str, Any]:
    db = settings.DATABASES["default"]
    return {"host": db["HOST"] or "127.0.0.1", "port": db["PORT"] or 5432, "user": db["USER"], "dbname": db["NAME"]}


def test_turns_run_behind_pgbouncer_in_transaction_mode_and_wake_by_notify(user, behind_pgbouncer, pgbouncer):
    api, worker_log = behind_pgbouncer
    token = Token.objects.create(user=user).key
    assert api.post("/api/sessions/", token, {"id": "bounced"})[0] == 201

    turns: list[Turn] = []
    for n in range(1, 6):
        posted = time.monotonic()
        status, body = api.post("/api/sessions/bounced/turns/", token, {"input": f"through the bouncer {n}"})
        assert status == 202, body
        stream = open_stream(api.port, f"/api/turns/{body['id']}/events/", token)
        if n == 5:  # the hub listens, and keeps its reader, while a stream is open
            deadline = time.monotonic() + 5
            own = _own_backends()
            while {name for name, _ in own} != OWN and time.monotonic() < deadline:
                time.sleep(0.05)
                own = _own_backends()
        events = stream.read_to_end(timeout=60 if n == 1 else STREAM_BOUND)
        took = time.monotonic() - posted
        stream.close()
        assert events and events[-1].event == "completed", [e.event for e in events]
        assert events[-1].data["status"] == "succeeded", events[-1].data
        assert events[-1].data["final_text"] == f"echo: through the bouncer {n}"
        # Every event came by NOTIFY through the hub's direct LISTEN: no heartbeat-driven read was needed.
        assert stream.heartbeats == 0 and took < HEARTBEAT, (n, took, stream.heartbeats)
        turn = Turn.objects.get(pk=body["id"])
        assert turn.status == "succeeded", turn.error
        turns.append(turn)
        if n == 1:
            # The worker's wake listener is in place (its route is wakeable) before the warm turns are posted.
            deadline = time.monotonic() + 10
            while not TurnWorker.objects.filter(wakeable=True).exists():
                assert time.monotonic() < deadline, "the worker's wake listener is not listening"
                time.sleep(0.1)

    assert turns[0].thread_action == "started"
    for turn in turns[1:]:
        assert turn.thread_action == "resumed" and turn.codex_thread_id == turns[0].codex_thread_id
        assert turn.timings.get("warm") == 1, turn.timings  # the worker kept the thread loaded
        assert turn.timings.get("woken") == 1, turn.timings  # by NOTIFY on the worker's direct LISTEN

    # The Django traffic went through PgBouncer; the LISTENs did not.
    [stats] = [row for row in pgbouncer.show("STATS") if row["database"] == settings.DATABASES["default"]["NAME"]]
    assert int(stats["total_xact_count"]) > 50, stats
    through = {int(row["local_port"]) for row in pgbouncer.show("SERVERS")}
    assert through, "PgBouncer holds no server connection"
    assert {name for name, _ in own} == OWN, own
    assert not [b for b in own if b[1] in through], (own, through)
    assert "prepared statement" not in worker_log.read_text() and "prepared statement" not in api.log.read_text()
