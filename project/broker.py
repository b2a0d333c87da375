"""How a Celery worker outlives its broker: the Redis transport and the worker's consumer for this
project (``CELERY_BROKER_TRANSPORT`` for ``redis://`` / ``rediss://`` URLs, ``CELERY_WORKER_CONSUMER``).

The fault (Celery 5.7.0, kombu 5.7.0, redis-py 8.1.0 — the pins in requirements.txt; reproduced by
``make faults FAULTS_ARGS='--scenarios broker-restart'``, README "Fault injection"): when the Redis broker
goes away while a worker holds an unacknowledged task (every running turn: ``task_acks_late``), Celery's
``Consumer.on_connection_error_after_connected`` calls ``connection.collect()``, which drops the
transport's link to its connection settings (``transport.client = None``) although the Redis channel's
``close()`` had stopped early (draining its pending ``BRPOP`` raised ``ConnectionError`` on the dead
socket). Everything that channel does afterwards builds a Redis client from ``transport.client`` and
raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``:

1. ``connection.close()`` right after, putting the unacknowledged messages back;
2. the acknowledgement of a turn that was running during the outage and ends after the reconnect
   (its message belongs to the old channel).

Neither is a connection error, so nothing ignores it: ``Unrecoverable error`` and the worker exits with
status 1. No setting avoids the path (a running acks-late task when the broker goes is enough), and no
later Celery or kombu release is published. Here:

* ``RedisTransport``'s channel keeps the connection settings it was made with, so an old channel still
  reaches Redis: the restore in (1) fails with a plain ``ConnectionError`` while Redis is down (ignored
  by kombu; the messages stay in Redis's unacknowledged set, which Redis puts back after
  ``visibility_timeout``), and the late acknowledgement in (2) reaches the restarted Redis;
* ``Consumer`` contains any other error from closing the lost connection: it is discarded anyway.

A turn whose message the broker lost is re-sent by the sweep (README "Durability"); a message
delivered twice finds its turn running or finished and does nothing.
"""
from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis

logger = logging.getLogger(__name__)


class RedisChannel(kombu_redis.Channel):
    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        # Kept before the base class connects: the settings ``_connparams`` reads from
        # ``connection.client``, which Connection.collect() sets to None.
        self._conninfo = connection.client
        super().__init__(connection, *args, **kwargs)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport.client is None:
            transport.client = self._conninfo  # a collected connection: its settings, as they were
            try:
                return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]  # not in the stubs
            finally:
                transport.client = None
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]  # not in the stubs


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport whose channels survive ``Connection.collect()`` (module docstring)."""

    Channel = RedisChannel


class Consumer(CeleryConsumer):
    def on_connection_error_after_connected(self, exc: Exception) -> None:
        """Celery's handling of a lost broker connection, with the lost connection's ``close()`` unable
        to end the worker (module docstring)."""
        connection = self.connection
        if connection is not None:
            connection.close = _close_containing_errors(connection.close)  # type: ignore[method-assign]
        super().on_connection_error_after_connected(exc)


def _close_containing_errors(close: Any) -> Any:
    """``close`` that logs and swallows any exception: it runs only on a connection already lost."""

    def close_lost_connection() -> None:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 — discarding a dead connection must not end the worker
            logger.warning("closing the lost broker connection failed (%r); reconnecting anyway", exc)

    return close_lost_connection
