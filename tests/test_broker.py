"""project/broker.py: a Celery worker outlives its broker (docs/faults.md, broker-restart).

The whole fault — a real worker, a Redis killed and restarted mid-turn — is ``make faults``'s
broker-restart scenario; these tests pin the two pieces on a private redis-server of their own.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from kombu import Connection

from devtools.faults.brokers import RedisBroker
from project.broker import Consumer, RedisTransport, _close_containing_errors
from project.celery import app


def _held_message(conn: Connection, queue: str) -> Any:
    """A message taken from ``queue`` and not acknowledged (as a running acks-late turn holds it)."""
    channel = conn.default_channel
    channel.queue_declare(queue)
    conn.Producer().publish({"turn": "t"}, routing_key=queue, serializer="json")
    message = channel.basic_get(queue, no_ack=False)
    assert message is not None
    return message


def _as_after_a_reconnect(conn: Connection, message: Any) -> None:
    """The state Celery's reconnect leaves the old channel in when the broker went away during a
    ``BRPOP``: the channel's first ``close()`` stopped before marking it closed, ``Connection.collect()``
    then cleared the transport's ``client`` (``_do_close_transport``), and the channel's second
    ``close()`` starts by dropping its connection pools (``_disconnect_pools``), so its next Redis
    command builds a pool from the transport's settings. (Killing Redis in the middle of a real
    ``BRPOP`` under a running worker is ``make faults``'s broker-restart.)"""
    conn._do_close_transport()
    message.channel._disconnect_pools()


def _unacked(broker: RedisBroker) -> int:
    client = broker._client()
    try:
        return int(client.hlen("unacked"))
    finally:
        client.close()


def test_kombus_own_redis_channel_fails_after_collect_with_an_attribute_error(redis_broker):
    """The fault itself (kombu 5.7.0): once Celery's reconnect has ``collect()``-ed the connection, the
    acknowledgement of a turn that was running meanwhile raises AttributeError, which ends a worker.
    When this starts to pass a Celery/kombu bump fixed it, and project/broker.py can go."""
    conn = Connection(redis_broker.url, transport="redis")
    message = _held_message(conn, f"q-{uuid.uuid4().hex}")
    _as_after_a_reconnect(conn, message)
    with pytest.raises(AttributeError, match="hostname"):
        message.ack()
    message.channel.qos._delivered.clear()  # or kombu's exit hook would try to restore it, failing the same way


def test_our_redis_channel_still_acknowledges_after_collect(redis_broker):
    conn = Connection(redis_broker.url, transport=RedisTransport)
    message = _held_message(conn, f"q-{uuid.uuid4().hex}")
    assert _unacked(redis_broker) == 1
    _as_after_a_reconnect(conn, message)
    message.ack()
    assert _unacked(redis_broker) == 0  # acknowledged in Redis, not just forgotten


def test_our_redis_channel_on_a_dead_broker_raises_a_connection_error_kombu_ignores(redis_broker):
    """Restoring unacknowledged messages while Redis is down fails as a connection error (which kombu's
    ``maybe_close_channel`` ignores), not as AttributeError; Redis keeps them in its unacked set."""
    conn = Connection(redis_broker.url, transport=RedisTransport)
    message = _held_message(conn, f"q-{uuid.uuid4().hex}")
    redis_broker.kill9()
    _as_after_a_reconnect(conn, message)
    with pytest.raises(conn.connection_errors):
        message.channel.qos.restore_unacked()
    redis_broker.start({"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"})
    message.ack()  # the restarted Redis (empty: nothing kept on disk) takes the late acknowledgement


def test_closing_a_lost_connection_cannot_end_the_worker(caplog):
    def close() -> None:
        raise AttributeError("'NoneType' object has no attribute 'hostname'")

    with caplog.at_level(logging.WARNING, logger="project.broker"):
        _close_containing_errors(close)()
    assert "closing the lost broker connection failed" in caplog.text
    assert "hostname" in caplog.text


def test_workers_use_them_and_retry_the_broker_forever():
    assert app.conf.worker_consumer == "project.broker:Consumer"
    assert issubclass(Consumer, __import__("celery.worker.consumer", fromlist=["Consumer"]).Consumer)
    assert app.conf.broker_connection_retry is True
    assert app.conf.broker_connection_max_retries is None
    assert app.conf.worker_cancel_long_running_tasks_on_connection_loss is False


@pytest.mark.parametrize(("url", "transport"), [
    ("redis://127.0.0.1:6379/0", "project.broker:RedisTransport"),
    ("rediss://127.0.0.1:6380/0", "project.broker:RedisTransport"),
    ("amqp://guest:guest@127.0.0.1:5672//", "None"),
])
def test_the_redis_transport_is_chosen_by_the_broker_url(url, transport):
    from tests.test_settings import _settings_json

    values = _settings_json({"CELERY_BROKER_URL": url, "DJANGO_SECRET_KEY": "k" * 50}, "CELERY_BROKER_TRANSPORT")
    assert values == {"CELERY_BROKER_TRANSPORT": transport}
