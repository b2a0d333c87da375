"""The Celery application. Workers start with ``celery -A project worker -Q <HERMES_TURN_QUEUE>,celery`` (``make worker``)."""
import logging
import os

from celery import Celery
from celery.signals import (
    after_setup_logger,
    celeryd_after_setup,
    celeryd_init,
    setup_logging,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("hermes_sessions")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _check_codex_sandbox(**_: object) -> None:
    """Log at start whether codex's sandbox works here; turns check it again (cached) and are refused
    with the reason when it does not (hermes_sessions/codex/sandbox_check.py). The result is recorded
    with the worker's heartbeat (``WorkerHealth``) for the readiness checks (hermes_sessions/health.py)."""
    from django import db

    from hermes_sessions.codex.sandbox_check import check_at_worker_start
    from hermes_sessions.services.worker_health import worker_sandbox_record
    from hermes_sessions.worker.health_beat import worker_node

    result = check_at_worker_start()
    node = worker_node()
    if not node:
        return
    try:
        worker_sandbox_record(node=node, ok=result.ok, reason=result.reason)
    except Exception:  # noqa: BLE001 — the database is down at start: a pool process's beat records it later
        logging.getLogger("hermes_sessions.health").exception("could not record worker %s's sandbox check", node)
    finally:
        if not db.connection.in_atomic_block:  # (a test's transaction)
            db.connection.close()


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(task: object = None, **_: object) -> None:
    """Around each task, what Django does around each request (``request_started`` /
    ``request_finished``): close a connection that is unusable (an error occurred and it fails its
    health check, e.g. PostgreSQL restarted) or older than ``DATABASE_CONN_MAX_AGE``; keep the rest.
    Replaces Celery's close-everything (``CELERY_DB_REUSE_MAX`` in settings). Not for an eager task: it
    runs inside the caller's request, maybe inside its transaction."""
    if getattr(getattr(task, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()


@worker_init.connect
def _bound_idle_transactions(**_: object) -> None:
    """A worker's PostgreSQL connections end a transaction left idle for
    ``HERMES_WORKER_IDLE_IN_TRANSACTION_SECONDS`` (``idle_in_transaction_session_timeout``, set in the
    connection's startup options: no round trip). Without it a worker frozen (SIGSTOP, a paused
    VM) between a claim's two round trips would hold the session and turn row locks — TCP keepalives cannot
    see a stopped process — and every writer of that session and the sweep would wait
    behind it for as long as it stayed frozen. PostgreSQL ends that transaction and the locks go; the
    frozen worker finds its connection gone when it wakes. Worker processes only: their transactions are
    short, the API's and the tests' are not theirs to bound. Sent before the pool forks: its processes
    inherit the options. Behind PgBouncer (``DATABASE_PGBOUNCER``) there are no startup options (PgBouncer 1.18
    refuses them) and the server connection is shared: PgBouncer's ``idle_transaction_timeout`` is that bound
    there (docs/operating.md "Behind PgBouncer")."""
    from django.conf import settings
    from django.db import connections

    seconds = settings.HERMES_WORKER_IDLE_IN_TRANSACTION_SECONDS
    conn = connections["default"]
    if seconds <= 0 or settings.DATABASE_PGBOUNCER:
        return
    options = conn.settings_dict.setdefault("OPTIONS", {})
    setting = f"-c idle_in_transaction_session_timeout={int(seconds * 1000)}"
    if setting not in options.get("options", ""):
        options["options"] = f"{options.get('options', '')} {setting}".strip()


@worker_process_init.connect
def _start_worker_process(**_: object) -> None:
    """A pool process starts its runtime as soon as it is forked (``hermes_sessions/worker/process.py``:
    spares, the affinity heartbeat or the sweep's round, the wake listener)."""
    from hermes_sessions import worker

    worker.process_start()


@celeryd_after_setup.connect
def _name_keeping_worker(sender: str, instance: object, **_: object) -> None:
    """Session affinity (``hermes_sessions/worker/affinity.py``): a worker with one pool process (prefork
    ``-c 1``, or ``-P solo``; it runs ``HERMES_WORKER_TURNS`` turns at once on runner threads) keeps threads loaded under its route ``<HERMES_TURN_QUEUE>.<node
    name>``, named in ``HERMES_OWN_ROUTE`` for its pool process (set before the pool forks). A worker with
    more pool processes gets no route and keeps no thread loaded: a turn could not be brought to the one
    process holding its thread. Keeping off (``HERMES_WARM_IDLE_SECONDS=0``): no route either."""
    from django import db
    from django.conf import settings

    from hermes_sessions.services.routing import OWN_ROUTE_ENV, route_name, route_taken
    from hermes_sessions.worker.health_beat import NODE_ENV

    os.environ[NODE_ENV] = sender  # every worker's health heartbeat (hermes_sessions/worker/health_beat.py)
    os.environ.pop(OWN_ROUTE_ENV, None)
    pool = str(getattr(instance, "pool_cls", "") or "")
    # -P solo runs tasks one at a time in the main process whatever --concurrency says.
    one_at_a_time = "solo" in pool or (getattr(instance, "concurrency", 0) == 1 and ("prefork" in pool or not pool))
    if settings.HERMES_WARM_IDLE_SECONDS <= 0 or settings.HERMES_WARM_MAX_THREADS <= 0:
        return
    if not one_at_a_time:
        logging.getLogger("hermes_sessions.affinity").info(
            "worker %s runs %s turns at once (%s): no thread kept loaded between turns "
            "(session affinity needs -c 1 or -P solo; docs/architecture.md §3)", sender,
            getattr(instance, "concurrency", "?"), pool or "prefork")
        return
    queue = route_name(sender)
    try:
        taken = route_taken(queue)
    except Exception:  # noqa: BLE001 — the database is down at start: take the route (the sweep sorts out the rest)
        taken = ""
    finally:
        if not db.connection.in_atomic_block:  # (a test's transaction)
            db.connection.close()  # opened in the main process before the pool forks: children must not share it
    if taken:
        logging.getLogger("hermes_sessions.affinity").error(
            "%s: this worker keeps no thread loaded; give each worker its own node name "
            "(-n, make worker WORKER_NAME=…)", taken)
        return
    os.environ[OWN_ROUTE_ENV] = queue


@worker_process_shutdown.connect
def _stop_worker_process(**_: object) -> None:
    """A pool process that exits (warm shutdown, max-tasks-per-child) stops its runtime
    (``hermes_sessions/worker/process.py``: woken turn, spares, kept app-servers, routing rows, scheduler)."""
    from django.conf import settings

    from hermes_sessions import worker

    worker.process_stop(turn_timeout=settings.CODEX_TURN_TIMEOUT + 30)


@worker_shutdown.connect
def _close_in_main_process(**kwargs: object) -> None:
    """The worker's end (main process): ``-P solo`` runs turns here and gets no ``worker_process_shutdown``.
    Its pool has stopped: its ``WorkerHealth`` row goes, so the readiness checks stop counting it now."""
    _stop_worker_process(**kwargs)
    from hermes_sessions.services.worker_health import worker_health_forget
    from hermes_sessions.worker.health_beat import worker_node

    if worker_node():
        try:
            worker_health_forget(node=worker_node())
        except Exception:  # noqa: BLE001 — its row goes stale instead
            logging.getLogger("hermes_sessions.health").exception("could not remove worker %s's health row", worker_node())


if os.environ.get("HERMES_LOG_FORMAT", "text") == "json":  # the settings are not read at import (they import this)

    @setup_logging.connect
    def _log_as_django_says(loglevel: int | str | None = None, **_: object) -> None:
        """``HERMES_LOG_FORMAT=json``: a receiver here makes Celery leave logging alone (no handler of its
        own on the root logger, ``worker_hijack_root_logger`` moot); Django's ``LOGGING`` puts the JSON
        handler there (``project/log_format.py``), at the worker's ``--loglevel``."""
        import logging.config

        from django.conf import settings

        logging.config.dictConfig(settings.LOGGING)
        if loglevel:
            logging.getLogger().setLevel(loglevel)

    @celeryd_init.connect
    def _no_banner(instance: object, **_: object) -> None:
        """``HERMES_LOG_FORMAT=json``: no start-up banner (as ``--quiet``): every line on the worker's
        output is a JSON object."""
        instance.quiet = True  # type: ignore[attr-defined]


@after_setup_logger.connect
def _print_each_line_once(**_: object) -> None:
    """In a worker (and beat) Celery's handler on the root logger prints every record with its format;
    the console handler ``LOGGING`` gives ``hermes_sessions`` (for gunicorn and runserver, where the root
    has none) would print each of its lines a second time, so it is removed here."""
    logging.getLogger("hermes_sessions").handlers.clear()
