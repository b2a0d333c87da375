"""Health and readiness: ``GET /healthz``, ``GET /readyz`` and ``manage.py health`` (docs/operating.md §10).

``/healthz`` says the process answers (no database, no broker: a load balancer or systemd restarts a
process that does not). ``/readyz`` and ``manage.py health`` run the readiness checks, each named in the
answer with ``ok`` or ``failed`` and a reason:

* ``database``: a new connection to PostgreSQL (``connect_timeout`` 2 s, ``statement_timeout`` 2 s)
  answers ``SELECT 1`` — its own connection, not the process's pool or persistent one, so a wedged pool
  cannot make the probe wait and a dead server is seen at once; through ``DATABASE_URL``, so behind
  PgBouncer it is PgBouncer's path that is checked (each statement in a transaction of its own that sets
  its ``statement_timeout`` first: nothing is left on the server connection PgBouncer hands on);
* ``migrations``: every migration on disk is applied (``django_migrations``; a squashed one counts when
  all it replaces are);
* ``broker``: a connection to ``CELERY_BROKER_URL`` opens (Redis: ``PING``; 1 s timeouts);
* ``workers``: at least one worker's ``WorkerHealth`` heartbeat is younger than
  ``HERMES_WORKER_STALE_SECONDS`` (the same "fresh" routing uses for ``TurnWorker``);
* ``sandbox``: at least one of those fresh workers passed codex's sandbox check on its host
  (``codex/sandbox_check.py``); a fresh worker whose check failed is named in the reason either way.

The checks run on two threads (database ones in order on one connection; the broker's) and the answer
comes by ``DEADLINE_SECONDS`` whatever hangs: a check with no answer by then fails with "no answer within
…". Reasons never carry a password: credentials in URLs and the configured passwords are replaced by
``***`` (``redact``). Without a broker (the embedded demo) turns run in the API process: ``broker``,
``workers`` and ``sandbox`` then pass with that reason.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import sql

CHECKS = ("database", "migrations", "broker", "workers", "sandbox")
DEADLINE_SECONDS = 2.5
DATABASE_CONNECT_TIMEOUT = 2  # libpq's minimum: a smaller connect_timeout counts as 2 s
DATABASE_STATEMENT_TIMEOUT_MS = 2000
BROKER_TIMEOUT_SECONDS = 1.0
WORKERS_LISTED = 50  # the newest heartbeats read (and named in a reason)


@dataclass(frozen=True)
class Check:
    """One check's result: ``name`` (one of ``CHECKS``), ``ok``, ``reason`` (one line, nothing secret)."""

    name: str
    ok: bool
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"status": "ok" if self.ok else "failed", "reason": self.reason}


_URL_CREDENTIALS = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the credentials of any ``scheme://user:password@`` URL and the configured database
    and broker passwords replaced by ``***``, on one line."""
    text = _URL_CREDENTIALS.sub(r"\1***@", " ".join(str(text).split()))
    secrets = [settings.DATABASES["default"].get("PASSWORD") or ""]
    broker_password = re.match(r"[a-z][a-z0-9+.-]*://[^:/@]*:([^/@]+)@", settings.CELERY_BROKER_URL or "", re.I)
    if broker_password:
        secrets.append(broker_password.group(1))
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def _eager() -> str:
    """Why no worker is needed (``""``: workers run the turns)."""
    if not settings.CELERY_BROKER_URL:
        return "no broker configured: turns run in the API process (the embedded demo)"
    if settings.CELERY_TASK_ALWAYS_EAGER:
        return "CELERY_TASK_ALWAYS_EAGER: turns run in the API process"
    return ""


def _database_checks(node: str) -> list[Check]:
    """``database``, ``migrations``, ``workers`` and ``sandbox``, in that order, on one new connection.
    ``node``: only that worker counts (``""``: any)."""
    import psycopg

    params = connections["default"].get_connection_params()
    params["connect_timeout"] = DATABASE_CONNECT_TIMEOUT
    params["application_name"] = "hermes health"
    params["prepare_threshold"] = None  # nothing prepared (PgBouncer's transaction mode)
    try:
        conn = psycopg.connect(autocommit=True, **params)
    except Exception as exc:  # noqa: BLE001 — every way of not connecting is the answer
        why = f"PostgreSQL unreachable: {redact(str(exc))}"
        return [Check("database", False, why)] + [Check(name, False, "database unreachable")
                                                   for name in ("migrations", "workers", "sandbox")]
    checks: list[Check] = []
    try:
        with conn:
            _bounded(conn, sql.query("health_ping"))
            checks.append(Check("database", True, "PostgreSQL answered"))
            checks.append(_migrations_check(conn))
            checks += _worker_checks(conn, node)
    except Exception as exc:  # noqa: BLE001 — a failure midway (the server went away) fails what is left
        why = redact(f"{type(exc).__name__}: {exc}")
        done = {c.name for c in checks}
        checks += [Check(name, False, why) for name in ("database", "migrations", "workers", "sandbox")
                   if name not in done]
    return checks


@cache
def _disk_migrations() -> tuple[tuple[tuple[str, str], tuple[tuple[str, str], ...]], ...]:
    """Every migration the code has, with what it replaces (squashed ones): ``((node, replaced), …)``.
    Read once per process: the files do not change under a running process."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    return tuple(sorted((node, tuple(loader.replacements[node].replaces) if node in loader.replacements else ())
                        for node in loader.graph.nodes))


def _bounded(conn: Any, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """``statement``'s rows, run in a transaction of its own on ``conn`` (autocommit) that first bounds it
    to ``DATABASE_STATEMENT_TIMEOUT_MS`` (``set_config(…, true)``: gone with the transaction). Raises
    psycopg's errors (``QueryCanceled`` past the bound)."""
    with conn.transaction():
        conn.execute(sql.query("statement_timeout_bound"), [f"{DATABASE_STATEMENT_TIMEOUT_MS}ms"])
        return list(conn.execute(statement, params).fetchall())


def _migrations_check(conn: Any) -> Check:
    import psycopg

    try:
        applied = {(app, name) for app, name in _bounded(conn, sql.query("health_applied_migrations"))}
    except psycopg.errors.UndefinedTable:
        return Check("migrations", False, "no migration applied (no django_migrations table): run manage.py migrate")
    missing = [f"{app}.{name}" for (app, name), replaces in _disk_migrations()
               if (app, name) not in applied and not (replaces and all(r in applied for r in replaces))]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        return Check("migrations", False, f"{len(missing)} migration(s) not applied: {', '.join(missing[:5])}{more}; "
                                          "run manage.py migrate")
    return Check("migrations", True, f"all {len(_disk_migrations())} migrations applied")


def _worker_checks(conn: Any, node: str) -> list[Check]:
    eager = _eager()
    if eager and not node:
        return [Check("workers", True, eager), Check("sandbox", True, eager)]
    stale = float(settings.HERMES_WORKER_STALE_SECONDS)
    fresh_after = timezone.now() - timedelta(seconds=stale)
    rows = _bounded(conn, sql.query("health_workers"), {"node": node, "limit": WORKERS_LISTED})
    fresh = [r for r in rows if r[1] > fresh_after]
    whom = f"worker {node}" if node else "worker"
    if not fresh:
        last = f"; last heard of: {rows[0][0]} at {rows[0][1].isoformat(timespec='seconds')}" if rows else ""
        why = f"no {whom} heartbeat in the last {stale:g} s{last}"
        return [Check("workers", False, why), Check("sandbox", False, f"no fresh {whom} to report it")]
    workers = Check("workers", True, f"{len(fresh)} worker(s) with a fresh heartbeat: "
                                     + ", ".join(r[0] for r in fresh[:10]) + (" …" if len(fresh) > 10 else ""))
    passed = [r for r in fresh if r[2] is True]
    failed = [f"{r[0]}: {redact(r[3])}" for r in fresh if r[2] is False]
    unknown = [r[0] for r in fresh if r[2] is None]
    parts = []
    if passed:
        parts.append(f"{len(passed)} passed")
    if failed:
        parts.append("failed on " + "; ".join(failed[:5]))
    if unknown:
        parts.append("not reported yet by " + ", ".join(unknown[:5]))
    return [workers, Check("sandbox", bool(passed), "codex sandbox check: " + ", ".join(parts))]


def _broker_check() -> Check:
    eager = _eager()
    if not settings.CELERY_BROKER_URL:
        return Check("broker", True, eager)
    from kombu import Connection

    options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "socket_connect_timeout": BROKER_TIMEOUT_SECONDS,
               "socket_timeout": BROKER_TIMEOUT_SECONDS, "max_retries": 0}
    conn = Connection(settings.CELERY_BROKER_URL, transport=settings.CELERY_BROKER_TRANSPORT,
                      connect_timeout=BROKER_TIMEOUT_SECONDS, transport_options=options)
    try:
        conn.connect()  # Redis: its first channel sends PING; AMQP: the handshake
    except Exception as exc:  # noqa: BLE001 — every way of not connecting is the answer
        return Check("broker", False, f"broker unreachable: {redact(f'{type(exc).__name__}: {exc}')}")
    finally:
        try:
            conn.release()
        except Exception:  # noqa: BLE001, S110 — closing a connection that never opened
            pass
    return Check("broker", True, f"{settings.CELERY_BROKER_URL.split(':', 1)[0]} broker answered")


def readiness(*, node: str = "", deadline: float = DEADLINE_SECONDS) -> list[Check]:
    """Run the readiness checks (module docstring), answering within ``deadline`` seconds; one
    ``Check`` per name in ``CHECKS``, in that order. ``node``: the ``workers`` and ``sandbox`` checks
    look at that worker only (``manage.py health --node``)."""
    results: dict[str, list[Check]] = {}

    def run(key: str, fn: Callable[[], list[Check]]) -> None:
        try:
            results[key] = fn()
        except Exception as exc:  # noqa: BLE001 — a check that breaks is a failed check, not a 500
            results[key] = [Check(name, False, redact(f"{type(exc).__name__}: {exc}")) for name in CHECKS]

    threads = [threading.Thread(target=run, args=("database", lambda: _database_checks(node)),
                                name="hermes-health-database", daemon=True),
               threading.Thread(target=run, args=("broker", lambda: [_broker_check()]),
                                name="hermes-health-broker", daemon=True)]
    ends = time.monotonic() + deadline
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, ends - time.monotonic()))
    by_name: dict[str, Check] = {}
    for key in ("database", "broker"):
        for c in results.get(key, []):
            by_name.setdefault(c.name, c)
    late = f"no answer within {deadline:g} s"
    return [by_name.get(name) or Check(name, False, late) for name in CHECKS]


def readiness_json(checks: list[Check]) -> dict[str, Any]:
    """``{"status": "ready" | "unready", "checks": {name: {"status": "ok" | "failed", "reason"}}}``."""
    return {"status": "ready" if all(c.ok for c in checks) else "unready",
            "checks": {c.name: c.as_json() for c in checks}}


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """``GET /healthz``: 200 ``{"status": "ok"}`` while the process answers; touches nothing else."""
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """``GET /readyz``: 200 with every check ``ok``, else 503; the body is ``readiness_json``."""
    checks = readiness()
    return JsonResponse(readiness_json(checks), status=200 if all(c.ok for c in checks) else 503,
                        json_dumps_params={"ensure_ascii": False})


def readiness_lines(checks: list[Check]) -> list[str]:
    """One line per check, ``<name> ok|failed: <reason>`` (``manage.py health``)."""
    return [f"{c.name} {'ok' if c.ok else 'failed'}: {c.reason}" for c in checks]

