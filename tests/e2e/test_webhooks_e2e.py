"""A webhook survives the worker that ran its turn: kill -9 of a real Celery worker right after the
turn's commit, then another worker delivers the event to a real HTTP receiver exactly once, signed."""
from __future__ import annotations

import os
import signal
import time

import pytest
from standardwebhooks import Webhook

from hermes_sessions import services
from hermes_sessions.models import Turn, WebhookDelivery
from tests.support.webhook_receiver import WebhookReceiver

from .test_affinity import stand_in, workers  # noqa: F401
from .test_seed_e2e import TURN_QUEUE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_a_worker_killed_right_after_the_commit_loses_no_webhook(user, workers, settings):  # noqa: F811
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    # The workers consume the turn queue only here: the webhook task goes there too; short attempts, so a
    # claim the killed worker may have taken runs out soon.
    workers.env.update(HERMES_WEBHOOK_QUEUE=TURN_QUEUE, HERMES_WEBHOOK_ALLOW_PRIVATE="1",
                       HERMES_WEBHOOK_TIMEOUT_SECONDS="2", HERMES_WEBHOOK_BATCH="1")
    with WebhookReceiver() as receiver:
        endpoint = services.webhook_endpoint_create(owner=user, url=receiver.url, event_types=["turn.succeeded"])
        first = workers.start("a")
        session = services.session_create(owner=user, session_id="webhook-kill")
        turn = services.turn_enqueue(session=session, input_text="hello hooks", user=user)
        deadline = time.monotonic() + 60
        while not Turn.objects.filter(pk=turn.pk, status=Turn.Status.SUCCEEDED).exists():
            assert time.monotonic() < deadline, "the turn did not succeed"
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGKILL)  # right after the commit: the worker and its pool process
        first.wait(timeout=30)
        assert WebhookDelivery.objects.filter(endpoint=endpoint).count() == 1  # committed with the turn
        workers.start("b")
        got = receiver.wait_for(1, timeout=45)
        time.sleep(2)  # a second sending would come within a sweep round or two
        got = list(receiver.received)
    assert len(got) == 1, [r.headers.get("webhook-id") for r in got]
    payload = Webhook(endpoint.secret).verify(got[0].body, got[0].headers)
    assert payload["type"] == "turn.succeeded" and payload["data"]["turn"] == str(turn.pk)
    assert payload["data"]["final_text"] == Turn.objects.get(pk=turn.pk).final_text
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    assert delivery.status == "succeeded" and got[0].headers["webhook-id"] == delivery.webhook_id
