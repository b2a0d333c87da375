"""``worker_queues.queue_delete``: the sweep removes a dead worker's own queue from the broker — its
messages and, on Redis, every binding of it (``make faults``' kill-warm-holder found the worker's own
binding left behind). On a private redis-server, with the app's Redis transport."""
from __future__ import annotations

import uuid

from kombu import Exchange, Queue

from hermes_sessions.worker import own_queues as worker_queues
from project.celery import app
from tests.support.broker_keys import keys_naming


def test_a_dead_workers_queue_and_both_its_bindings_are_removed(redis_broker, monkeypatch):
    queue = f"turns-test.w-{uuid.uuid4().hex[:6]}@host"
    with app.connection_for_write(redis_broker.url) as conn:
        # The worker's binding (project/celery.py: select_add → the default exchange) …
        Queue(queue, app.amqp.default_exchange, routing_key=queue)(conn.default_channel).declare()
        # … and a publisher's (a queue Celery does not know gets an exchange of its own name), with a turn.
        Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel).declare()
        conn.Producer().publish({"turn": "t"}, exchange=queue, routing_key=queue, serializer="json")
    client = redis_broker._client()
    try:
        assert set(keys_naming(client, queue)) >= {queue, "_kombu.binding.celery", f"_kombu.binding.{queue}"}
        monkeypatch.setattr(app.conf, "broker_write_url", redis_broker.url)  # queue_delete's connection
        assert worker_queues.queue_delete(queue) == 1
        assert keys_naming(client, queue) == {}  # a purge alone left the bindings (and later turns routed there)
        assert worker_queues.queue_delete(queue) == 0  # gone: nothing to do, no error
        assert keys_naming(client, queue) == {}
    finally:
        client.close()


def test_a_deleted_queue_declared_again_has_both_its_bindings(redis_broker, monkeypatch):
    """``worker_queues.queue_declare`` (a swept worker that came back, ``affinity.AffinityLoop._consume_again``):
    after ``queue_delete``, a turn published as the API publishes (the queue's own exchange) is delivered
    to the queue again, and the worker's default-exchange binding is back too."""
    queue = f"turns-test.w-{uuid.uuid4().hex[:6]}@host"
    monkeypatch.setattr(app.conf, "broker_write_url", redis_broker.url)
    client = redis_broker._client()
    try:
        worker_queues.queue_declare(queue)
        worker_queues.queue_delete(queue)
        assert keys_naming(client, queue) == {}
        worker_queues.queue_declare(queue)
        with app.connection_for_write(redis_broker.url) as conn:
            conn.Producer().publish({"turn": "t"}, exchange=queue, routing_key=queue, serializer="json")
        assert client.llen(queue) == 1
        assert queue.encode() in b"".join(client.smembers("_kombu.binding.celery"))
        assert worker_queues.queue_delete(queue) == 1
    finally:
        client.close()
