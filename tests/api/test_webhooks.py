"""The webhook endpoints of the API: register (the secret shown once), read, change, delete, deliveries;
private targets refused with a reason; another user's endpoint is 404 (I7)."""
from __future__ import annotations

import base64

import pytest
from rest_framework.test import APIClient
from standardwebhooks import Webhook

from hermes_sessions import services
from hermes_sessions.models import WebhookDelivery, WebhookEndpoint
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PUBLIC = "https://93.184.215.14/hooks"


def test_register_shows_the_secret_once_and_reads_never_show_it(client):
    made = client.post("/api/webhooks/", {"url": PUBLIC, "event_types": ["turn.failed", "turn.succeeded"]},
                       format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["secret"].startswith("whsec_") and Webhook(body["secret"])  # the Standard Webhooks form
    assert body["event_types"] == ["turn.succeeded", "turn.failed"] and body["active"] is True
    got = client.get(f"/api/webhooks/{body['id']}/").json()
    assert "secret" not in got and got["url"] == PUBLIC
    assert [e["id"] for e in client.get("/api/webhooks/").json()["results"]] == [body["id"]]


def test_a_given_secret_is_kept_and_a_malformed_one_refused(client):
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    made = client.post("/api/webhooks/", {"url": PUBLIC, "event_types": ["turn.failed"], "secret": secret},
                       format="json")
    assert made.status_code == 201 and made.json()["secret"] == secret
    bad = client.post("/api/webhooks/", {"url": PUBLIC, "event_types": ["turn.failed"], "secret": "hunter2"},
                      format="json")
    assert bad.status_code == 400 and "secret" in bad.json()["errors"]
    long_key = "whsec_" + base64.b64encode(b"k" * 65).decode()  # the form, but 65 bytes: the service's rule
    too_long = client.post("/api/webhooks/", {"url": PUBLIC, "event_types": ["turn.failed"], "secret": long_key},
                           format="json")
    assert too_long.status_code == 400 and too_long.json()["field"] == "secret"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/", "http://10.0.0.1/", "http://169.254.169.254/",
                                 "http://[::1]/", "http://localhost/", "file:///etc/passwd"])
def test_a_private_target_is_400_with_the_reason(client, url, settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    refused = client.post("/api/webhooks/", {"url": url, "event_types": ["turn.failed"]}, format="json")
    assert refused.status_code == 400
    assert refused.json()["code"] == "invalid_webhook" and refused.json()["field"] == "url"
    assert "cannot be a webhook target" in refused.json()["detail"]
    assert WebhookEndpoint.objects.count() == 0


def test_the_operator_setting_allows_a_private_target(client, settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    assert client.post("/api/webhooks/", {"url": "http://127.0.0.1:9/", "event_types": ["turn.failed"]},
                       format="json").status_code == 201


def test_all_sessions_is_for_staff(client, user):
    body = {"url": PUBLIC, "event_types": ["turn.failed"], "all_sessions": True}
    refused = client.post("/api/webhooks/", body, format="json")
    assert refused.status_code == 400 and refused.json()["field"] == "all_sessions"
    user.is_staff = True
    user.save()
    assert client.post("/api/webhooks/", body, format="json").json()["all_sessions"] is True


def test_another_users_endpoint_is_404(client):
    theirs = services.webhook_endpoint_create(owner=UserFactory(), url=PUBLIC, event_types=["turn.failed"])
    for method in ("get", "patch", "delete"):
        assert getattr(client, method)(f"/api/webhooks/{theirs.pk}/", {}, format="json").status_code == 404
    assert client.get(f"/api/webhooks/{theirs.pk}/deliveries/").status_code == 404
    assert client.get("/api/webhooks/abc/").status_code == 404
    assert WebhookEndpoint.objects.filter(pk=theirs.pk).exists()


def test_patch_changes_disables_and_re_enables(client, user):
    endpoint = services.webhook_endpoint_create(owner=user, url=PUBLIC, event_types=["turn.failed"])
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(active=False, disabled_reason="20 consecutive failed",
                                                          consecutive_failures=20)
    changed = client.patch(f"/api/webhooks/{endpoint.pk}/", {"active": True, "event_types": ["thread.rotated"]},
                           format="json").json()
    assert (changed["active"], changed["disabled_reason"], changed["consecutive_failures"]) == (True, "", 0)
    assert changed["event_types"] == ["thread.rotated"]
    assert client.patch(f"/api/webhooks/{endpoint.pk}/", {"url": "http://10.0.0.1/"},
                        format="json").status_code == 400
    assert client.patch(f"/api/webhooks/{endpoint.pk}/", {"secret": "whsec_x"}, format="json").status_code == 400
    off = client.patch(f"/api/webhooks/{endpoint.pk}/", {"active": False}, format="json").json()
    assert off["active"] is False and off["disabled_reason"].startswith("disabled by")
    assert client.delete(f"/api/webhooks/{endpoint.pk}/").status_code == 204
    assert not WebhookEndpoint.objects.exists()


def test_deliveries_list_their_attempts(client, user, dispatched):
    endpoint = services.webhook_endpoint_create(owner=user, url=PUBLIC, event_types=["turn.cancelled"])
    session = services.session_create(owner=user)
    services.turn_cancel(turn=services.turn_enqueue(session=session, input_text="x", user=user))
    (row,) = client.get(f"/api/webhooks/{endpoint.pk}/deliveries/").json()["results"]
    delivery = WebhookDelivery.objects.get()
    assert row["webhook_id"] == delivery.webhook_id and row["event_type"] == "turn.cancelled"
    assert row["status"] == "pending" and row["attempt_log"] == [] and row["session"] == session.pk
    assert row["payload"]["data"]["status"] == "cancelled"


def test_unauthenticated_is_401():
    assert APIClient().get("/api/webhooks/").status_code == 401
