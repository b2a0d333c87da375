"""``project/celery.py``'s ``_consume_own_queue``: a worker gets its own queue (session affinity,
``hermes_sessions/worker/affinity.py``) only when it runs one turn at a time — prefork ``-c 1`` or
``-P solo`` — and keeping threads loaded is on. The worker is a stand-in with what the handler reads at
``celeryd_after_setup``: ``concurrency``, ``pool_cls`` (a class by then) and ``app.amqp.queues``."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from celery.concurrency import get_implementation

from hermes_sessions.models import TurnWorker
from hermes_sessions.services import routing
from hermes_sessions.services.routing import OWN_QUEUE_ENV, own_queue_name
from project.celery import _consume_own_queue

NODE = "w1@host"


class Queues:
    def __init__(self) -> None:
        self.added: list[str] = []

    def select_add(self, queue: str) -> None:
        self.added.append(queue)


def worker(pool: str, concurrency: int) -> SimpleNamespace:
    return SimpleNamespace(concurrency=concurrency, pool_cls=get_implementation(pool),
                           app=SimpleNamespace(amqp=SimpleNamespace(queues=Queues())))


@pytest.fixture(autouse=True)
def keeping_on(settings, monkeypatch, request):
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 120.0, 8
    monkeypatch.setenv(OWN_QUEUE_ENV, "left over from an earlier start")
    if "django_db" not in request.keywords:
        monkeypatch.setattr(routing, "own_queue_taken", lambda queue: "")  # no live worker holds it


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_one_turn_at_a_time_worker_consumes_its_own_queue(pool):
    w = worker(pool, 1)
    _consume_own_queue(sender=NODE, instance=w)
    assert w.app.amqp.queues.added == [own_queue_name(NODE)]
    assert own_queue_name(NODE).endswith(f".{NODE}")
    assert os.environ[OWN_QUEUE_ENV] == own_queue_name(NODE)


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 4), ("threads", 1), ("threads", 4)])
def test_a_worker_running_turns_side_by_side_has_no_own_queue(pool, concurrency):
    w = worker(pool, concurrency)
    _consume_own_queue(sender=NODE, instance=w)
    assert w.app.amqp.queues.added == [] and OWN_QUEUE_ENV not in os.environ


@pytest.mark.parametrize("setting", ["HERMES_WARM_IDLE_SECONDS", "HERMES_WARM_MAX_THREADS"])
def test_no_own_queue_when_keeping_is_off(settings, setting):
    setattr(settings, setting, 0)
    w = worker("prefork", 1)
    _consume_own_queue(sender=NODE, instance=w)
    assert w.app.amqp.queues.added == [] and OWN_QUEUE_ENV not in os.environ


@pytest.mark.django_db
def test_a_second_worker_with_the_same_name_gets_no_own_queue(caplog):
    """Found by a newcomer: ``make worker`` twice (both ``hermes@<host>``) shared one own queue, and a
    session's turns alternated between the two, mostly cold. The second now runs without one, and says why."""
    import datetime
    import socket

    from django.utils import timezone

    queue = own_queue_name(NODE)
    TurnWorker.objects.create(queue=queue, node=NODE, host=socket.gethostname(), pid=os.getpid(),
                              heartbeat_at=timezone.now())
    w = worker("prefork", 1)
    _consume_own_queue(sender=NODE, instance=w)
    assert w.app.amqp.queues.added == [] and OWN_QUEUE_ENV not in os.environ
    assert "already consumed by live process" in caplog.text and "WORKER_NAME" in caplog.text
    # Its heartbeat gone stale (that worker died): the name is free again.
    TurnWorker.objects.filter(queue=queue).update(heartbeat_at=timezone.now() - datetime.timedelta(minutes=5))
    w = worker("prefork", 1)
    _consume_own_queue(sender=NODE, instance=w)
    assert w.app.amqp.queues.added == [queue]
