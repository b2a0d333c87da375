"""devtools/faults/brokers.py: the private brokers ``make faults`` kills and restarts — on ports of their
own, leaving the machine's brokers alone."""
from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from kombu import Connection, Exchange, Queue

from devtools.faults.brokers import RabbitBroker, RedisBroker

ENV = {"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"}


def _publish(url: str, queue: str) -> None:
    """Publish one persistent message. On RabbitMQ with publisher confirms: the node confirms a persistent
    message on a durable queue only once it is on disk, so a ``kill -9`` right after cannot lose it (CI
    lost an unconfirmed one that way). Redis ignores the option."""
    with Connection(url, connect_timeout=5, transport_options={"confirm_publish": True}) as conn:
        conn.default_channel.queue_declare(queue, durable=True, auto_delete=False)
        conn.Producer().publish({"turn": "t"}, routing_key=queue, serializer="json", delivery_mode=2)


def _shared_rabbitmq_answers() -> bool:
    with socket.create_connection(("127.0.0.1", 5672), timeout=2) as s:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        return s.recv(8)[:1] == b"\x01"  # connection.start frame


def test_redis_restarted_on_its_port_holds_nothing(tmp_path: Path):
    broker = RedisBroker(tmp_path, tmp_path)
    broker.start(ENV)
    try:
        queue = f"q-{uuid.uuid4().hex}"
        _publish(broker.url, queue)
        assert broker.backlog(queue) == (1, 0) and broker.queue_length(queue) == 1
        assert broker.queue_exists(queue) and not broker.queue_exists(queue + "-other")
        broker.kill9()
        assert not broker.answers()
        broker.start(ENV)
        assert broker.queue_length(queue) == 0  # nothing kept on disk: a restart loses every message
        assert not broker.queue_exists(queue)
    finally:
        broker.stop()


def test_a_redis_queue_known_only_by_a_binding_exists(tmp_path: Path):
    """A worker's own queue it has not been sent anything on yet: no list, a binding in the default
    exchange's table (what ``kill-warm-holder`` checks the sweep removed)."""
    broker = RedisBroker(tmp_path, tmp_path)
    broker.start(ENV)
    try:
        queue = f"turns.w-{uuid.uuid4().hex[:6]}@host"
        with Connection(broker.url, connect_timeout=5) as conn:
            Queue(queue, Exchange("celery"), routing_key=queue)(conn.default_channel).declare()
        assert broker.queue_length(queue) == 0 and broker.queue_exists(queue)
    finally:
        broker.stop()


def test_a_private_rabbitmq_node_restarts_with_its_messages_and_leaves_the_shared_one_alone(tmp_path: Path):
    assert _shared_rabbitmq_answers()
    broker = RabbitBroker(tmp_path, tmp_path)
    assert broker.port != 5672
    broker.start(ENV)
    try:
        queue = f"q-{uuid.uuid4().hex}"
        # A turn queue exists long before a crash; one declared just before the kill -9 may not be on disk yet:
        # the node confirms the message but recovered "0 queues" (the queue's definition
        # is lost, not the message). So the queue is declared, and the node restarted cleanly, first.
        _publish(broker.url, queue)
        broker.stop()
        broker.start(ENV)
        deadline = time.monotonic() + 15
        while broker.queue_length(queue) != 1 and time.monotonic() < deadline:
            time.sleep(0.25)
        _publish(broker.url, queue)
        assert broker.backlog(queue) == (2, 0) and broker.queue_length(queue) == 2
        broker.kill9()
        assert not broker.answers()
        assert _shared_rabbitmq_answers()
        broker.start(ENV)
        # Durable queue, persistent message, confirmed: kept across kill -9. A node restarted after a kill -9
        # may answer before the queue's messages are recovered (on CI: 0 right after the start).
        deadline = time.monotonic() + 15
        while broker.queue_length(queue) != 2 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert broker.queue_length(queue) == 2  # the message confirmed before the kill -9 too
    finally:
        broker.stop()
    assert _shared_rabbitmq_answers()
