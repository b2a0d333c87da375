"""A worker's own queue in the broker (session affinity, ``affinity.py``): deleted when the worker is gone,
declared again when a swept worker comes back. Kept apart from ``dispatch.py`` (which routes turns with
``routing.turn_route``) so that ``affinity`` can use it without an import circle."""
from __future__ import annotations

import logging

from celery import current_app

logger = logging.getLogger(__name__)


def queue_delete(queue: str) -> int:
    """Delete ``queue`` from the broker (a dead worker's own queue, ``recovery.workers_sweep``);
    returns how many messages it held (0 when it did not exist). Every message in it was a
    duplicate (the shared queue got each turn too) or is re-sent by the sweep.

    It is bound twice: by its worker (``project/celery.py``: ``select_add`` binds it to the app's
    default exchange) and by the processes that routed turns to it (Celery creates a queue it does not
    know with an exchange of the queue's own name). On Redis both bindings are removed too: kombu's
    Redis transport deletes only the bindings the deleting channel has declared, so both are declared
    first (found by ``make faults``' kill-warm-holder: a purge alone left the worker's binding in
    ``_kombu.binding.<default exchange>``, and a turn routed there later made the list anew, where
    nobody would ever take it)."""
    from kombu import Exchange, Queue

    try:
        with current_app.connection_for_write() as conn:
            channel = conn.default_channel
            forms = [Queue(queue, Exchange(queue), routing_key=queue),
                     Queue(queue, current_app.amqp.default_exchange, routing_key=queue)]
            try:
                count = forms[0](channel).purge() or 0
            except conn.channel_errors:
                return 0  # RabbitMQ: no such queue
            if getattr(conn.transport, "driver_type", "") == "redis":
                for form in forms:
                    form(channel).declare()  # SADD of bindings that exist (or a moment's ones that do not)
            forms[0](channel).delete()  # RabbitMQ: the queue and every binding; Redis: each declared one
            return int(count)
    except Exception:  # noqa: BLE001 — the broker is down: the next sweep tries again
        logger.warning("could not delete worker queue %s from the broker", queue, exc_info=True)
        return 0


def queue_declare(queue: str) -> None:
    """Declare ``queue`` in the broker in both forms ``queue_delete`` removes — bound to its own exchange
    (as routing processes made it) and to the app's default exchange (as its worker did) — so that turns
    routed to it are delivered again (``affinity.AffinityLoop``: a swept worker that came back). Raises
    the broker's errors."""
    from kombu import Exchange, Queue

    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        for form in (Queue(queue, Exchange(queue), routing_key=queue),
                     Queue(queue, current_app.amqp.default_exchange, routing_key=queue)):
            form(channel).declare()


def queue_is_redis() -> bool:
    """Whether the broker is Redis (kombu's ``driver_type``): a deleted queue there leaves its consumer
    polling, where RabbitMQ cancels it."""
    with current_app.connection_for_write() as conn:
        return getattr(conn.transport, "driver_type", "") == "redis"
