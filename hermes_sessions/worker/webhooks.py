"""Sending the webhook outbox: the claim in the sweep's round, the HTTP attempts in a Celery task.

* ``webhooks_dispatch_due`` — a job of the sweep's round (every worker process, ≤ 1 s; and beat's sweep):
  claims up to ``HERMES_WEBHOOK_BATCH`` due deliveries (``services.webhooks.webhook_deliveries_claim``,
  one statement; an indexed read and nothing else when none is due) and sends
  ``tasks.deliver_webhooks(ids, token)`` to ``HERMES_WEBHOOK_QUEUE``. A send that fails, or a worker
  that dies with the task, leaves the rows claimed until the lease ends; then a later round claims them.
* ``webhooks_deliver`` — the task's work: for each delivery still held by the claim, one HTTP attempt
  outside any transaction (``attempt_send``), then ``services.webhooks.webhook_attempt_record``.

An attempt (Standard Webhooks): ``POST`` of the stored payload as compact JSON with ``webhook-id``
(the delivery's, the same on every attempt), ``webhook-timestamp`` (this attempt's, Unix seconds) and
``webhook-signature`` (``v1,<base64 HMAC-SHA256>``, signed by the ``standardwebhooks`` package). The
target is checked again (``webhook_targets.target_check``) and the connection goes to the checked
address: the URL's host is replaced by the IP, with the name in ``Host`` and in TLS SNI (httpx's
``sni_hostname``; the certificate is verified against the name). No redirect is followed (a 3xx is a
failed attempt), no proxy from the environment is used, every phase has ``HERMES_WEBHOOK_TIMEOUT_SECONDS``.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
from celery import current_app
from django.conf import settings
from django.utils import timezone
from standardwebhooks import Webhook

from .. import selectors
from ..services import webhooks
from ..services.webhooks import AttemptOutcome
from ..webhook_targets import CheckedTarget, TargetRefused, target_check

logger = logging.getLogger(__name__)

DELIVER_TASK = "hermes_sessions.tasks.deliver_webhooks"
USER_AGENT = "hermes-sessions-webhooks"
BODY_SNIPPET_CHARS = 200  # of a refusing receiver's answer, kept in the attempt's error


def webhooks_dispatch_due(*, limit: int | None = None) -> int:
    """Claim due deliveries and send their task (module docstring); how many were claimed."""
    token, ids = webhooks.webhook_deliveries_claim(limit=limit or int(settings.HERMES_WEBHOOK_BATCH))
    if not ids:
        return 0
    try:
        current_app.tasks[DELIVER_TASK].apply_async(args=(ids, str(token)))
    except Exception:  # noqa: BLE001 — kombu raises many transport-specific errors; the lease brings them back
        logger.exception("webhook deliveries %s: the task could not be sent; claimed again after the lease", ids)
    return len(ids)


def webhooks_deliver(*, delivery_ids: list[int], token: uuid.UUID) -> dict[str, int]:
    """One attempt of each delivery still held by claim ``token``, in order, each recorded on its own.
    Returns ``{"succeeded": n, "failed": n, "skipped": n}`` (skipped: claimed by another sender since)."""
    counts = {"succeeded": 0, "failed": 0, "skipped": 0}
    for delivery_id in delivery_ids:
        delivery = selectors.webhook_delivery_claimed(delivery_id=delivery_id, token=token)
        if delivery is None:
            counts["skipped"] += 1
            continue
        outcome = attempt_send(url=delivery.endpoint.url, secret=delivery.endpoint.secret,
                               webhook_id=delivery.webhook_id, payload=delivery.payload)
        recorded = webhooks.webhook_attempt_record(delivery_id=delivery_id, token=token, outcome=outcome)
        if recorded is None:
            counts["skipped"] += 1
            continue
        counts["succeeded" if outcome.succeeded else "failed"] += 1
        log = logger.info if outcome.succeeded else logger.warning
        log("webhook %s %s to endpoint %s: attempt %s, %s (%.0f ms)", delivery.webhook_id, delivery.event_type,
            delivery.endpoint_id, recorded.attempts, outcome.status_code or outcome.error, outcome.duration_ms)
    return counts


def signed_headers(*, secret: str, webhook_id: str, body: str, at: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of ``body`` sent at ``at`` (an aware datetime)."""
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(at.timestamp())),
            "webhook-signature": Webhook(secret).sign(webhook_id, at, body)}


def _pinned_url(target: CheckedTarget, address: str) -> str:
    """``target.url`` with its host replaced by ``address`` (IPv6 in brackets), port and path kept."""
    parts = httpx.URL(target.url)
    return str(parts.copy_with(host=address, port=target.port))


def _host_header(target: CheckedTarget) -> str:
    default = 443 if target.scheme == "https" else 80
    host = f"[{target.host}]" if ":" in target.host else target.host
    return host if target.port == default else f"{host}:{target.port}"


class _Deadline:
    """Cuts one attempt's connection once ``seconds`` have passed since it started: httpx's timeouts bound
    each connect, read and write, not the whole exchange, so a receiver sending a byte every few seconds
    would otherwise hold the sender — and the worker slot it runs in — for as long as it likes
    (tests/services/test_webhooks.py::test_a_receiver_that_trickles_its_answer_is_cut_at_the_timeout).
    The socket comes from httpcore's ``trace`` events; ``shutdown`` wakes a read blocked on it."""

    def __init__(self, seconds: float) -> None:
        self.cut = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            with self._lock:
                self._sock = sock if isinstance(sock, socket.socket) else self._sock
                if self.cut:
                    self._shutdown()

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            self.cut = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile: the attempt ended


def attempt_send(*, url: str, secret: str, webhook_id: str, payload: dict[str, Any]) -> AttemptOutcome:
    """One HTTP attempt (module docstring); never raises: what went wrong is the outcome's ``error``."""
    started, t0 = timezone.now(), time.monotonic()

    def outcome(**kwargs: Any) -> AttemptOutcome:
        return AttemptOutcome(started_at=started, duration_ms=(time.monotonic() - t0) * 1000, **kwargs)

    try:
        target = target_check(url)
    except TargetRefused as exc:
        return outcome(error=f"target refused: {exc}")
    address = target.addresses[0]
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    headers = {"Host": _host_header(target), "Content-Type": "application/json", "User-Agent": USER_AGENT,
               **signed_headers(secret=secret, webhook_id=webhook_id, body=body, at=datetime.now(UTC))}
    timeout = float(settings.HERMES_WEBHOOK_TIMEOUT_SECONDS)
    deadline = _Deadline(timeout)
    extensions: dict[str, Any] = {"trace": deadline.trace}
    if target.scheme == "https":
        extensions["sni_hostname"] = target.host
    try:
        with deadline, httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False, trust_env=False) as client, \
                client.stream("POST", _pinned_url(target, address), content=body.encode(), headers=headers,
                              extensions=extensions) as response:
            code = response.status_code
            if 200 <= code < 300:
                return outcome(address=address, status_code=code)
            if 300 <= code < 400:
                location = response.headers.get("location", "")
                return outcome(address=address, status_code=code,
                               error=f"HTTP {code}: redirect to {location[:300]!r} not followed")
            snippet = next(response.iter_text(), "")[:BODY_SNIPPET_CHARS]
            return outcome(address=address, status_code=code, error=f"HTTP {code}: {snippet}".rstrip(": "))
    except httpx.HTTPError as exc:
        if deadline.cut:
            return outcome(address=address, error=f"no whole answer within {timeout:g} s "
                                                  "(HERMES_WEBHOOK_TIMEOUT_SECONDS, the whole exchange); cut")
        return outcome(address=address, error=f"{type(exc).__name__}: {exc}"[:2000] or type(exc).__name__)
