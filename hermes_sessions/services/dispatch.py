"""Dispatching a turn — telling a worker that it is its session's next — the one place that does.

The ``Turn`` row is the queue; a dispatch is only a notification, and every delivery ends in
``turns.turn_claim``. Two notifications exist (docs/architecture.md §4 has the table, with the sweep as
the third path): the NOTIFY wake of the worker that holds the session's thread loaded, when its listener
listens (``routing.wake_channel``), and otherwise the Celery task ``hermes_sessions.tasks.run_turn`` on
the shared turn queue (``HERMES_TURN_QUEUE``, any worker). ``dispatched_at`` records when the last
notification went out: the sweep (``worker/recovery.py``) counts from it, and ``NULL`` asks it to
dispatch the turn at its next round.

The task is looked up by name in the Celery app's registry, so the services import nothing from
``tasks`` (which imports the services). ``Task.apply_async`` applies the routes (``CELERY_TASK_ROUTES``:
the ``turns`` queue) and honours ``CELERY_TASK_ALWAYS_EAGER`` (tests, the demo), which
``Celery.send_task`` would not. Tests that must not run turns patch ``turn_dispatch_on_commit`` here.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import current_app
from celery.app.task import Task
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from ..models import Session, Turn
from ..sql import query
from . import routing

logger = logging.getLogger(__name__)

RUN_TURN_TASK = "hermes_sessions.tasks.run_turn"


def turn_dispatch_on_commit(turn_id: uuid.UUID | str, *, stamped: bool = False, wake: bool = True) -> None:
    """Dispatch turn ``turn_id`` once the current transaction commits, and stamp ``dispatched_at``: wake
    the worker holding its session's thread (``routing.turn_route``: window open, heartbeat fresh, its
    listener listening) by NOTIFY, or else send ``run_turn(turn_id)`` to the shared queue. Call it where a
    turn becomes its session's next (a retry's requeue, a lease taken back, the turn before it ending;
    ``turn_enqueue`` wakes in its own transaction and calls this only for the shared queue).

    ``stamped``: the caller wrote ``dispatched_at`` already. ``wake=False``: the caller read the route
    under the session lock and there is no holder to wake: the shared queue, without reading it again.

    The turn row is durable before the send, so a broker that is down loses nothing: the failure is
    logged, ``dispatched_at`` cleared, and the sweep dispatches the turn at its next round. The client
    still gets its 202 — the input was accepted."""
    if not stamped:
        Turn.objects.filter(pk=turn_id).update(dispatched_at=timezone.now())  # the sweep waits from here

    def send() -> None:
        try:
            found = _route(turn_id) if wake else None
            if found is not None and found[0].wakeable:
                _wake(found[0].queue, turn_id=uuid.UUID(str(turn_id)), session_id=found[1])
                return
            _run_turn_task().apply_async(args=(str(turn_id),))
        except Exception:  # noqa: BLE001 — kombu raises many transport-specific errors; the sweep dispatches
            logger.exception("turn %s: could not be dispatched; the sweep will dispatch it", turn_id)
            turn_undispatched(turn_id)

    transaction.on_commit(send)


def turn_undispatched(turn_id: uuid.UUID | str) -> None:
    """Record that no notification of queued turn ``turn_id`` is on its way (``dispatched_at = NULL``): its
    dispatch failed, or it reached a worker process busy with a woken turn (``tasks.run_turn``); the sweep
    dispatches it at its next round (``recovery.turns_dispatch_unclaimed``). Outside any transaction; never
    raises (a database that is down leaves the stamp, and the sweep's ``HERMES_REDISPATCH_SECONDS`` rule)."""
    try:
        Turn.objects.filter(pk=turn_id, status=Turn.Status.QUEUED).update(dispatched_at=None)
    except DatabaseError:
        logger.warning("turn %s: could not clear dispatched_at; the sweep dispatches it after "
                       "HERMES_REDISPATCH_SECONDS", turn_id, exc_info=True)
        connection.close()


def _wake(queue: str, *, turn_id: uuid.UUID, session_id: str) -> None:
    """``pg_notify`` the worker of route ``queue`` now, outside any transaction (the turn is committed)."""
    with connection.cursor() as cursor:
        cursor.execute(query("notify"), [routing.wake_channel(queue),
                                         routing.wake_payload(turn_id=turn_id, session_id=session_id)])


def routes_to_workers() -> bool:
    """Whether turns are routed to the workers holding their threads at all: not when tasks run in-process
    (Celery's ``task_always_eager``, as ``apply_async`` obeys it: there is no other worker to route to)."""
    return not current_app.conf.task_always_eager


def _route(turn_id: uuid.UUID | str) -> tuple[routing.Route, str] | None:
    """``routing.turn_route``, or ``None`` when tasks run in-process or it cannot be read (the shared
    queue always works)."""
    # The Celery app's flag, which ``apply_async`` obeys: a process whose app sends to the broker (the e2e
    # tests flip it, leaving Django's CELERY_TASK_ALWAYS_EAGER as it was read) routes like any API process.
    if current_app.conf.task_always_eager:
        return None
    try:
        return routing.turn_route(turn_id)
    except Exception:  # noqa: BLE001 — a database blip: no affinity for this turn
        logger.warning("turn %s: affinity route not readable; sending to the shared queue", turn_id, exc_info=True)
        connection.close()
        return None


def session_dispatch_next_on_commit(session: Session) -> None:
    """Dispatch the session's oldest queued turn, if any, once the current transaction commits
    (call it where a turn of ``session`` ends, under the session lock). One statement
    (``session_next_turn_sql``: the read and the ``dispatched_at`` stamp)."""
    with connection.cursor() as cursor:
        cursor.execute(*session_next_turn_sql(session.pk))
        row = cursor.fetchone()
    if row is not None:
        turn_dispatch_on_commit(row[0], stamped=True)


def session_next_turn_sql(session_id: str) -> tuple[str, list[Any]]:
    """``UPDATE … SET dispatched_at = now … RETURNING id`` of the session's oldest queued turn (``queries.sql``:
    ``session_next_turn_dispatch``; no row: none queued) and its parameters — ``session_dispatch_next_on_commit``'s
    read and ``turn_dispatch_on_commit``'s stamp in one statement, for the caller to hand the id to
    ``turn_dispatch_on_commit(id, stamped=True)``. The finalize runs the same as a CTE of its last statement
    (``turns._end_turn``: ``session_next_turn_params``)."""
    return query("session_next_turn_dispatch"), session_next_turn_params(session_id)


def session_next_turn_params(session_id: str) -> list[Any]:
    """``session_next_turn_dispatch``'s parameters: the stamp (now), the session, the queued status."""
    return [timezone.now(), session_id, Turn.Status.QUEUED]


def _run_turn_task() -> Task:
    app = current_app
    try:
        return app.tasks[RUN_TURN_TASK]
    except KeyError:
        # A process that never imported hermes_sessions.tasks (e.g. the API server): let Celery's
        # autodiscovery import each app's tasks module, which registers the task.
        app.loader.import_default_modules()
        return app.tasks[RUN_TURN_TASK]
