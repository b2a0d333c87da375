"""Sending the Celery task ``hermes_sessions.tasks.run_turn`` after a commit — the one place that does.

The task is looked up by name in the Celery app's registry, so the services import nothing from
``tasks`` (which imports the services). ``Task.apply_async`` applies the routes (``CELERY_TASK_ROUTES``:
the ``turns`` queue) and honours ``CELERY_TASK_ALWAYS_EAGER`` (tests, the demo), which
``Celery.send_task`` would not. Tests that must not run turns patch ``turn_dispatch_on_commit`` here.
"""
from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from celery import current_app
from celery.app.task import Task
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from .. import selectors
from ..models import Session, Turn
from . import routing
from .fallback_copies import fallback_copy_later

logger = logging.getLogger(__name__)

RUN_TURN_TASK = "hermes_sessions.tasks.run_turn"


def turn_dispatch_on_commit(turn_id: uuid.UUID | str, *, stamped: bool = False, route: str | None = None,
                            woken: bool = False) -> None:
    """Send ``run_turn(turn_id)`` once the current transaction commits, and stamp ``dispatched_at``.

    The turn row is durable before the send, so a broker that is down loses nothing: the failure
    is logged and the sweep re-sends the turn (``HERMES_REDISPATCH_SECONDS``). The client still
    gets its 202 — the input was accepted.

    ``turn_enqueue`` saves two queries: ``stamped`` (it inserted the row with ``dispatched_at``
    already) and ``route`` (``routing.turn_route``'s answer, read in its transaction under the
    session lock; ``None``: read it after the commit) and ``woken`` (the transaction also wakes the worker
    of ``route`` by NOTIFY, ``routing.wake_held``: no message to its queue — Celery's send, consume and pool
    hop were ~6 ms of a warm turn's ``queue`` phase on 2 cores, and the two deliveries competed for them,
    ``make bench-warm`` — and the shared queue's fallback copy is sent by this process when it is due
    (``fallback_copies``), not at the commit with a countdown)."""
    if not stamped:
        Turn.objects.filter(pk=turn_id).update(dispatched_at=timezone.now())  # the sweep waits from here

    def send() -> None:
        try:
            queue = _route(turn_id) if route is None else route_given(route)
            task = _run_turn_task()
            if queue:
                # Session affinity (worker/affinity.py): the worker holding the thread loaded first; the
                # shared queue after the deadline, for any worker, should that one not claim it by then.
                if woken:
                    fallback_copy_later(uuid.UUID(str(turn_id)), delay=settings.HERMES_AFFINITY_DEADLINE,
                                        send=send_fallback_copy)
                    return
                task.apply_async(args=(str(turn_id),), queue=queue)
                task.apply_async(args=(str(turn_id),), kwargs={"fallback": True},
                                 countdown=settings.HERMES_AFFINITY_DEADLINE)
            else:
                task.apply_async(args=(str(turn_id),))
        except Exception:  # noqa: BLE001 — kombu raises many transport-specific errors; the sweep re-sends
            logger.exception("turn %s: could not send run_turn to the broker; the sweep will re-send it", turn_id)

    transaction.on_commit(send)


def send_fallback_copy(turn_id: uuid.UUID | str) -> None:
    """Send ``run_turn(turn_id, fallback=True)`` to the shared queue now (``fallback_copies``: a woken
    turn's copy, due) — unless the turn is no longer queued: claimed (its lease recovery covers it from then
    on, ``recovery``), ended or deleted. Almost every copy finds its turn claimed milliseconds after the
    commit; the read (~0.5 ms, on a connection the sender keeps while copies are pending) replaces a Celery
    publish (~3 ms of this process's CPU) and a delivery to a worker (the Celery pool hop and the same read
    there), which landed in the middle of a later turn of the conversation (``py-spy`` on ``make
    bench-warm``: ~1 % of the API's and the worker's samples). A read that fails sends the copy (the
    worker reads again). Raises what kombu raises when the broker cannot take it."""
    try:
        if not selectors.turn_is_queued(turn_id=turn_id):
            return
    except DatabaseError:
        logger.warning("turn %s: could not read whether it is still queued; sending its fallback copy", turn_id,
                       exc_info=True)
        connection.close()
    _run_turn_task().apply_async(args=(str(turn_id),), kwargs={"fallback": True})


def turn_pass_on(turn_id: uuid.UUID | str) -> None:
    """Send ``run_turn(turn_id)`` to the shared queue now — outside any transaction: the turn row is
    committed — for a delivery that cannot run it in this process (busy with a woken turn,
    ``wake.delivery_slot``): any idle worker takes it. Never raises: a broker that is down leaves the turn
    to the sweep's re-send (``HERMES_REDISPATCH_SECONDS``), as for any send that failed."""
    try:
        _run_turn_task().apply_async(args=(str(turn_id),))
    except Exception:  # noqa: BLE001 — kombu raises many transport-specific errors; the sweep re-sends
        logger.exception("turn %s: could not pass run_turn on to the broker; the sweep will re-send it", turn_id)


def route_given(route: str) -> str:
    """A route read by the caller (``turn_enqueue``), or ``""`` when tasks run in-process (``_route``):
    the own queue a routed turn goes to (or whose worker is woken), ``""`` for the shared queue only."""
    return route if routes_to_workers() else ""


def routes_to_workers() -> bool:
    """Whether turns go to workers' own queues at all: not when tasks run in-process (Celery's
    ``task_always_eager``, as ``apply_async`` obeys it: there is no other worker to route to)."""
    return not current_app.conf.task_always_eager


def _route(turn_id: uuid.UUID | str) -> str:
    """``routing.turn_route``, or ``""`` when it cannot be read (the shared queue always works)."""
    # The Celery app's flag, which ``apply_async`` obeys: a process whose app sends to the broker (the e2e
    # tests flip it, leaving Django's CELERY_TASK_ALWAYS_EAGER as it was read) routes like any API process.
    if current_app.conf.task_always_eager:
        return ""  # in-process: there is no other worker to route to
    try:
        return routing.turn_route(turn_id)
    except Exception:  # noqa: BLE001 — a database blip: no affinity for this turn
        logger.warning("turn %s: affinity route not readable; sending to the shared queue", turn_id, exc_info=True)
        return ""


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
    """PostgreSQL: ``UPDATE … SET dispatched_at = now … RETURNING id`` of the session's oldest queued
    turn (no row: none queued) and its parameters — ``session_dispatch_next_on_commit``'s read and
    ``turn_dispatch_on_commit``'s stamp in one statement, for the caller to hand the id to
    ``turn_dispatch_on_commit(id, stamped=True)``. The finalize sends it as a CTE of its last statement
    (``turns._end_turn``). Text built once per process from the model's metadata."""
    dispatched = Turn._meta.get_field("dispatched_at")
    return _next_turn_sql(), [dispatched.get_db_prep_save(timezone.now(), connection), session_id,
                              Turn.Status.QUEUED]


@functools.cache
def _next_turn_sql() -> str:
    q = connection.ops.quote_name
    turns = q(Turn._meta.db_table)
    return (f"UPDATE {turns} SET {q('dispatched_at')} = %s WHERE {q('id')} = (SELECT {q('id')} FROM {turns} "
            f"WHERE {q('session_id')} = %s AND {q('status')} = %s ORDER BY {q('seq')} LIMIT 1) RETURNING {q('id')}")


def _run_turn_task() -> Task:
    app = current_app
    try:
        return app.tasks[RUN_TURN_TASK]
    except KeyError:
        # A process that never imported hermes_sessions.tasks (e.g. the API server): let Celery's
        # autodiscovery import each app's tasks module, which registers the task.
        app.loader.import_default_modules()
        return app.tasks[RUN_TURN_TASK]
