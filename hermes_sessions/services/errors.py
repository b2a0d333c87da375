"""Errors the domain services raise; the API maps each to a 4xx (``api/errors.py``)."""
from __future__ import annotations


class ServiceError(Exception):
    """A domain rule refused the operation; ``str(exc)`` is the reason to show the client."""


class SessionIdTaken(ServiceError):
    """``session_create`` was given an id that already exists (HTTP 409)."""


class InvalidInput(ServiceError):
    """The turn input is empty or too long, or an option is unknown (HTTP 400 with ``code`` and ``field``)."""

    code = "invalid_input"
    field = "input"


class InvalidIdempotencyKey(InvalidInput):
    """The ``Idempotency-Key`` header is empty, too long or not printable ASCII (HTTP 400)."""


class SessionBusy(ServiceError):
    """``on_busy="reject"`` and the session has a turn running or queued (HTTP 409).
    ``turn_id`` names that turn."""

    def __init__(self, message: str, *, turn_id: str):
        super().__init__(message)
        self.turn_id = turn_id


class SessionLocked(ServiceError):
    """Another writer held the session's row lock longer than ``HERMES_POST_LOCK_TIMEOUT_MS``: nothing was
    written; the client may retry shortly (HTTP 503)."""


class IdempotencyKeyInUse(ServiceError):
    """Another request with the same Idempotency-Key held it longer than ``HERMES_POST_LOCK_TIMEOUT_MS``;
    nothing was done: retry shortly for its result (HTTP 409 with ``Retry-After``, as Stripe answers it)."""


class IdempotencyMismatch(ServiceError):
    """The Idempotency-Key was used before with a different request body (HTTP 422)."""
