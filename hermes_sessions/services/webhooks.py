"""Webhooks: endpoints, the outbox's claims and attempts — the only writer of ``WebhookEndpoint``,
``WebhookDelivery`` (besides the trigger that inserts it) and ``WebhookAttempt``.

The outbox rows are inserted by PostgreSQL (the trigger ``hermes_webhook_outbox`` of migration 0013) in
the transaction that inserts the ``TurnEvent``, so nothing here runs on the turn's path. The sender
(``worker/webhooks.py``) claims due rows (``webhook_deliveries_claim``), sends each outside any
transaction and records the attempt (``webhook_attempt_record``): a 2xx ends the delivery; anything
else schedules the next attempt after an exponential backoff (``HERMES_WEBHOOK_BACKOFF_SECONDS``,
doubling, capped at ``HERMES_WEBHOOK_BACKOFF_MAX_SECONDS``) until ``HERMES_WEBHOOK_RETRY_SECONDS``
after the event, then ``gave_up``. ``HERMES_WEBHOOK_DISABLE_AFTER`` consecutive failed attempts of an
endpoint disable it with the reason and record a ``webhook`` notice on the session of the delivery that
crossed the threshold (a notice belongs to a session; the endpoint keeps the reason too).
"""
from __future__ import annotations

import base64
import binascii
import logging
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from ..models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from ..sql import query
from ..webhook_targets import TargetRefused, target_check
from . import bindings
from .errors import InvalidInput

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
SECRET_BYTES = (24, 64)  # the Standard Webhooks specification's range for a secret's key


class WebhookRefused(InvalidInput):
    """An endpoint's URL, secret or event types cannot be accepted (HTTP 400); ``field`` names which."""

    code = "invalid_webhook"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def webhook_secret_new() -> str:
    """A fresh secret in the Standard Webhooks form: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def webhook_secret_check(secret: str) -> str:
    key = secret.removeprefix(SECRET_PREFIX)
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WebhookRefused("the secret must be whsec_ followed by base64 (the Standard Webhooks form)",
                             field="secret") from exc
    if not secret.startswith(SECRET_PREFIX) or not SECRET_BYTES[0] <= len(raw) <= SECRET_BYTES[1]:
        raise WebhookRefused(f"the secret must be whsec_ followed by the base64 of {SECRET_BYTES[0]}-{SECRET_BYTES[1]} "
                             "bytes", field="secret")
    return secret


def webhook_url_check(url: str) -> str:
    try:
        target_check(url)
    except TargetRefused as exc:
        raise WebhookRefused(f"the URL cannot be a webhook target: {exc}", field="url") from exc
    return url


def _event_types_checked(event_types: Sequence[str]) -> list[str]:
    unknown = sorted(set(event_types) - set(WebhookEndpoint.EVENT_TYPES))
    if unknown or not event_types:
        raise WebhookRefused(f"event_types must be a non-empty subset of {', '.join(WebhookEndpoint.EVENT_TYPES)}",
                             field="event_types")
    return [t for t in WebhookEndpoint.EVENT_TYPES if t in event_types]


def _all_sessions_checked(owner: Any, all_sessions: bool) -> bool:
    if all_sessions and not owner.is_staff:
        raise WebhookRefused("all_sessions is for staff users only", field="all_sessions")
    return all_sessions


def webhook_endpoint_create(*, owner: Any, url: str, event_types: Sequence[str], secret: str = "",
                            all_sessions: bool = False) -> WebhookEndpoint:
    """Register an endpoint of ``owner`` (a user): ``url`` checked (``webhook_targets``), ``event_types``
    a non-empty subset of ``WebhookEndpoint.EVENT_TYPES``, ``secret`` given (``whsec_…``) or made here,
    ``all_sessions`` only for staff. Raises ``WebhookRefused`` (400) with the reason."""
    endpoint = WebhookEndpoint(owner=owner, url=webhook_url_check(url), event_types=_event_types_checked(event_types),
                               secret=webhook_secret_check(secret) if secret else webhook_secret_new(),
                               all_sessions=_all_sessions_checked(owner, all_sessions))
    endpoint.save(force_insert=True)
    return endpoint


def webhook_endpoint_update(*, endpoint: WebhookEndpoint, user: Any, changes: dict[str, Any]) -> WebhookEndpoint:
    """Change ``endpoint`` as ``user`` asks: ``changes`` may hold ``url``, ``event_types``, ``all_sessions``
    (checked as at creation, against ``user``) and ``active`` (``True`` re-enables it and clears its
    failures and reason; ``False`` disables it, reason ``disabled by <user>``). Raises ``WebhookRefused``."""
    with transaction.atomic():
        endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
        if "url" in changes:
            endpoint.url = webhook_url_check(changes["url"])
        if "event_types" in changes:
            endpoint.event_types = _event_types_checked(changes["event_types"])
        if "all_sessions" in changes:
            endpoint.all_sessions = _all_sessions_checked(user, bool(changes["all_sessions"]))
        if "active" in changes and bool(changes["active"]) != endpoint.active:
            if changes["active"]:
                _enable(endpoint)
            else:
                endpoint.active, endpoint.disabled_at = False, timezone.now()
                endpoint.disabled_reason = f"disabled by {getattr(user, 'username', 'its owner')}"
        endpoint.save()
        return endpoint


def _enable(endpoint: WebhookEndpoint) -> None:
    endpoint.active, endpoint.disabled_reason, endpoint.disabled_at, endpoint.consecutive_failures = True, "", None, 0


def webhook_endpoint_enable(*, endpoint_id: int) -> int:
    """Re-enable an endpoint (the admin's action): active, failures and reason cleared; its deliveries
    still due are sent at the next round. Returns the number of rows changed (0 or 1)."""
    return WebhookEndpoint.objects.filter(pk=endpoint_id, active=False).update(
        active=True, disabled_reason="", disabled_at=None, consecutive_failures=0, updated_at=timezone.now())


def webhook_endpoint_delete(*, endpoint: WebhookEndpoint) -> None:
    """Delete ``endpoint`` with its deliveries and their attempts."""
    endpoint.delete()


def webhook_delivery_send_again(*, delivery_ids: Sequence[int]) -> int:
    """Make deliveries due now (the admin's "send again"), whatever their status: a receiver that lost one
    gets it again with the same ``webhook-id``. The retry window still counts from the event. Returns how
    many."""
    return WebhookDelivery.objects.filter(pk__in=list(delivery_ids)).update(
        status=WebhookDelivery.Status.PENDING, next_attempt_at=timezone.now(), claim_token=None, finished_at=None)


def claim_lease_seconds(limit: int) -> float:
    """How long a claim of ``limit`` deliveries keeps them from other senders: all of them sent one after
    the other at the timeout, and one timeout (at least 5 s) for the task to reach a worker. A sender that
    died leaves them due again after it."""
    timeout = float(settings.HERMES_WEBHOOK_TIMEOUT_SECONDS)
    return timeout * limit + max(timeout, 5.0)


def webhook_deliveries_claim(*, limit: int) -> tuple[uuid.UUID, list[int]]:
    """Claim up to ``limit`` due deliveries of active endpoints (``queries.sql``:
    ``webhook_deliveries_claim``, ``FOR UPDATE SKIP LOCKED``: any number of senders at once), oldest due
    first; one statement, autocommit or the caller's transaction. Returns the claim's token and the ids
    (none: an indexed read of the due rows and nothing else)."""
    token = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(query("webhook_deliveries_claim"),
                       {"token": token, "lease": claim_lease_seconds(limit), "limit": limit})
        ids = sorted(row[0] for row in cursor.fetchall())  # in the order the events were written
    return token, ids


def backoff_seconds(failures: int) -> float:
    """The wait after the ``failures``-th failed attempt (1, 2, …): ``HERMES_WEBHOOK_BACKOFF_SECONDS``
    doubled per failure, at most ``HERMES_WEBHOOK_BACKOFF_MAX_SECONDS``."""
    base, cap = float(settings.HERMES_WEBHOOK_BACKOFF_SECONDS), float(settings.HERMES_WEBHOOK_BACKOFF_MAX_SECONDS)
    return min(cap, base * 2 ** min(max(failures - 1, 0), 40))


@dataclass(frozen=True)
class AttemptOutcome:
    """What one HTTP attempt gave: ``status_code`` (``None``: no answer), ``error`` (``""`` on a 2xx),
    ``address`` connected to, ``started_at`` and ``duration_ms``."""

    started_at: datetime
    duration_ms: float
    address: str = ""
    status_code: int | None = None
    error: str = ""

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def webhook_attempt_record(*, delivery_id: int, token: uuid.UUID, outcome: AttemptOutcome) -> WebhookDelivery | None:
    """Record one attempt of a delivery claimed under ``token`` and move it on (module docstring): a
    ``WebhookAttempt`` row; the delivery ``succeeded``, or ``failed`` with its next attempt, or
    ``gave_up``; the endpoint's failure count, and its disabling past the threshold. One transaction
    (delivery row, then endpoint row). ``None``: the claim is no longer held (nothing written)."""
    now = timezone.now()
    with transaction.atomic():
        delivery = WebhookDelivery.objects.select_for_update().filter(pk=delivery_id, claim_token=token).first()
        if delivery is None:
            return None
        endpoint = WebhookEndpoint.objects.select_for_update().get(pk=delivery.endpoint_id)
        delivery.attempts += 1
        WebhookAttempt.objects.create(delivery=delivery, number=delivery.attempts, started_at=outcome.started_at,
                                      address=outcome.address, status_code=outcome.status_code,
                                      error=outcome.error[:2000], duration_ms=round(outcome.duration_ms, 1))
        delivery.claim_token, delivery.last_status_code, delivery.last_error = None, outcome.status_code, outcome.error[:2000]
        if outcome.succeeded:
            delivery.status, delivery.finished_at = WebhookDelivery.Status.SUCCEEDED, now
            if endpoint.consecutive_failures:
                WebhookEndpoint.objects.filter(pk=endpoint.pk).update(consecutive_failures=0)
        else:
            _failed(delivery, endpoint, now=now)
        delivery.save(update_fields=["attempts", "claim_token", "last_status_code", "last_error", "status",
                                     "finished_at", "next_attempt_at"])
        return delivery


def _failed(delivery: WebhookDelivery, endpoint: WebhookEndpoint, *, now: datetime) -> None:
    nxt = now + timedelta(seconds=backoff_seconds(delivery.attempts))
    if nxt > delivery.created_at + timedelta(seconds=float(settings.HERMES_WEBHOOK_RETRY_SECONDS)):
        delivery.status, delivery.finished_at = WebhookDelivery.Status.GAVE_UP, now
        logger.warning("webhook delivery %s (%s, %s) gave up after %s attempts: %s", delivery.pk, delivery.event_type,
                       delivery.webhook_id, delivery.attempts, delivery.last_error or delivery.last_status_code)
    else:
        delivery.status, delivery.next_attempt_at = WebhookDelivery.Status.FAILED, nxt
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(consecutive_failures=F("consecutive_failures") + 1)
    failures = endpoint.consecutive_failures + 1
    threshold = int(settings.HERMES_WEBHOOK_DISABLE_AFTER)
    if endpoint.active and threshold > 0 and failures >= threshold:
        _disable_failing(endpoint, delivery, failures=failures, now=now)


def _disable_failing(endpoint: WebhookEndpoint, delivery: WebhookDelivery, *, failures: int, now: datetime) -> None:
    last = delivery.last_error or f"HTTP {delivery.last_status_code}"
    reason = f"{failures} consecutive failed attempts; the last: {last}"
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(active=False, disabled_reason=reason, disabled_at=now,
                                                          updated_at=now)
    text = (f"Webhook endpoint {endpoint.pk} ({endpoint.url}) was disabled after {reason}. Its deliveries wait; "
            f"re-enable it in the admin or with PATCH /api/webhooks/{endpoint.pk}/ {{\"active\": true}}.")
    bindings.notice_webhook_disabled(session_id=delivery.session_id, text=text)
    logger.warning("webhook endpoint %s (%s) disabled: %s", endpoint.pk, endpoint.url, reason)
