"""Webhooks in the admin: register (URL checked, secret shown once), the deliveries with their attempts,
re-enable and send again."""
from __future__ import annotations

import pytest
from django.utils import timezone

from hermes_sessions import services
from hermes_sessions.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db

ADD = "/admin/hermes_sessions/webhookendpoint/add/"


def test_register_refuses_a_private_url_and_shows_the_secret_once(admin_client, admin_user, settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    form = {"owner": admin_user.pk, "url": "http://169.254.169.254/", "event_types": ["turn.failed"]}
    refused = admin_client.post(ADD, form)
    assert refused.status_code == 200 and "cannot be a webhook target" in refused.content.decode()
    assert not WebhookEndpoint.objects.exists()
    made = admin_client.post(ADD, {**form, "url": "https://93.184.215.14/h"}, follow=True)
    endpoint = WebhookEndpoint.objects.get()
    assert endpoint.secret.startswith("whsec_") and endpoint.secret in made.content.decode()
    page = admin_client.get(f"/admin/hermes_sessions/webhookendpoint/{endpoint.pk}/change/").content.decode()
    assert endpoint.secret not in page


def test_deliveries_show_their_attempts_and_actions_work(admin_client, admin_user, monkeypatch):
    endpoint = services.webhook_endpoint_create(owner=admin_user, url="https://93.184.215.14/h",
                                                event_types=["turn.cancelled"])
    hold_dispatches(monkeypatch)
    services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=admin_user),
                                                    input_text="x", user=admin_user))
    delivery = WebhookDelivery.objects.get()
    WebhookAttempt.objects.create(delivery=delivery, number=1, started_at=timezone.now(), status_code=502,
                                  error="HTTP 502: bad gateway")
    WebhookDelivery.objects.filter(pk=delivery.pk).update(status="gave_up", attempts=1)
    assert "turn.cancelled" in admin_client.get("/admin/hermes_sessions/webhookdelivery/").content.decode()
    page = admin_client.get(f"/admin/hermes_sessions/webhookdelivery/{delivery.pk}/change/").content.decode()
    assert "HTTP 502: bad gateway" in page and delivery.webhook_id in page
    admin_client.post("/admin/hermes_sessions/webhookdelivery/",
                      {"action": "send_again", "_selected_action": [delivery.pk]})
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.webhook_id == f"msg_{delivery.event_id}_{endpoint.pk}"
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(active=False, disabled_reason="x", consecutive_failures=20)
    admin_client.post("/admin/hermes_sessions/webhookendpoint/",
                      {"action": "enable_endpoints", "_selected_action": [endpoint.pk]})
    endpoint.refresh_from_db()
    assert endpoint.active and endpoint.consecutive_failures == 0 and endpoint.disabled_reason == ""
