"""The API's error shape and the mapping from domain errors to HTTP statuses.

Every error response is a JSON object with a human-readable ``detail`` string and a machine
``code``; validation errors add ``errors`` (DRF's per-field lists). Mapping:

==============================================  ======  ========================
exception                                       status  code
==============================================  ======  ========================
``services.SessionIdTaken``                     409     ``session_id_taken``
``services.SessionBusy``                        409     ``session_busy`` (+ ``turn``)
``services.SessionLocked``                      503     ``session_locked``
``services.IdempotencyKeyInUse``                409     ``idempotency_key_in_use`` (+ ``Retry-After``)
``services.IdempotencyMismatch``                422     ``idempotency_key_reused``
``services.webhooks.WebhookRefused``           400     ``invalid_webhook`` (+ ``field``)
``services.InvalidInput``                       400     ``invalid_input``
``services.ApprovalClosed``                     409     ``approval_closed`` (+ ``approval``)
``services.InvalidDecision``                    400     ``invalid_decision`` (+ ``available_decisions``)
other ``services.ServiceError``                 400     ``refused``
``policy.PolicyError`` (``forbidden``)          403     ``forbidden_setting``
``policy.PolicyError``                          400     ``invalid_setting``
Django ``ValidationError`` (``full_clean``)     400     ``invalid``
Django ``RequestDataTooBig``                    413     ``request_too_large``
other Django ``SuspiciousOperation``            400     ``bad_request``
Django / psycopg ``OperationalError``            503     ``database_unavailable``
DRF ``APIException`` (parse errors, 401, 404…)  as DRF  DRF's code
==============================================  ======  ========================

The 503 (with ``Retry-After: 1``) is the database being unreachable or overloaded — no pooled
connection within the pool's 10 s (all of them waiting on a lock another request holds), a
restart, a lock or statement timeout, a deadlock: a retry may succeed, so it is not a 500 — not for POSTs queued behind a held session lock, nor for other
sessions' GETs meanwhile (``tests/api/test_session_lock_wait.py``).

Anything else is a bug: it is not caught here, so Django logs it and answers 500 (invariant I6
says known bad input must never get that far; the tests pin each row above).
"""
from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import OperationalError
from django.http import JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from .. import policy, services
from .serializers import ApprovalSerializer

logger = logging.getLogger(__name__)
security_logger = logging.getLogger("django.security")


class Conflict(exceptions.APIException):
    """409: the request collides with existing state (e.g. a taken session id)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with existing data."
    default_code = "conflict"


class Unprocessable(exceptions.APIException):
    """422: well-formed, but refused as it stands (an Idempotency-Key reused with another body)."""

    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "The request cannot be processed."
    default_code = "unprocessable"


class BadRequest(exceptions.APIException):
    """400 with a single reason (as opposed to DRF's per-field ``ValidationError``)."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "Bad request."
    default_code = "bad_request"


class RequestTooLarge(exceptions.APIException):
    """413: the body is larger than ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` (env ``DJANGO_DATA_UPLOAD_MAX_MEMORY_SIZE``)."""

    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "request_too_large"


class DatabaseUnavailable(exceptions.APIException):
    """503: the database could not serve the request now (``OperationalError``); retry shortly."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    # A POST's COMMIT can succeed with its answer lost: the retry advice covers it.
    default_detail = ("The database is unavailable or overloaded right now; retry shortly. A POST may have been "
                      "applied before the failure: repeat it with the same Idempotency-Key to have it applied once.")
    default_code = "database_unavailable"


class SessionLockedError(DatabaseUnavailable):
    """503: another writer held the session's lock longer than ``HERMES_POST_LOCK_TIMEOUT_MS`` (an operator's
    ``prune_sessions`` or delete of a long session); nothing was queued, retry shortly."""

    default_detail = "The session is locked by another operation; nothing was queued, retry shortly."
    default_code = "session_locked"


class KeyInUse(Conflict):
    """409 with ``Retry-After``: a request with the same Idempotency-Key is still in progress."""

    default_code = "idempotency_key_in_use"


#: Seconds a client should wait before retrying a 503 (``Retry-After``).
RETRY_AFTER_SECONDS = 1


def _translate(exc: Exception) -> tuple[Exception, dict[str, Any]]:
    """Map a domain or Django exception to a DRF ``APIException`` plus extra body fields; anything
    else is returned as it is (DRF handles its own exceptions, the rest becomes a 500)."""
    if isinstance(exc, services.ServiceError):
        return _translate_service_error(exc)
    if isinstance(exc, policy.PolicyError):
        return _translate_policy_error(exc)
    return _translate_django_error(exc)


def _translate_service_error(exc: services.ServiceError) -> tuple[Exception, dict[str, Any]]:
    # Subclasses before their bases: InvalidIdempotencyKey is an InvalidInput.
    if isinstance(exc, services.SessionIdTaken):
        return Conflict(str(exc), code="session_id_taken"), {"field": "id"}
    if isinstance(exc, services.SessionBusy):
        return Conflict(str(exc), code="session_busy"), {"turn": exc.turn_id}
    if isinstance(exc, services.SessionLocked):
        logger.warning("answering 503: %s", exc)
        return SessionLockedError(), {}
    if isinstance(exc, services.IdempotencyKeyInUse):
        return KeyInUse(str(exc)), {"field": "Idempotency-Key"}
    if isinstance(exc, services.IdempotencyMismatch):
        return Unprocessable(str(exc), code="idempotency_key_reused"), {"field": "Idempotency-Key"}
    if isinstance(exc, services.InvalidIdempotencyKey):
        return BadRequest(str(exc), code="invalid_idempotency_key"), {"field": "Idempotency-Key"}
    if isinstance(exc, services.InvalidInput):  # its code and field: invalid_input / input, or a subclass's
        return BadRequest(str(exc), code=exc.code), {"field": exc.field}
    if isinstance(exc, services.ApprovalClosed):
        return Conflict(str(exc), code="approval_closed"), {"approval": ApprovalSerializer(exc.approval).data}
    if isinstance(exc, services.InvalidDecision):
        return BadRequest(str(exc), code="invalid_decision"), {"field": "decision",
                                                               "available_decisions": exc.available}
    return BadRequest(str(exc), code="refused"), {}


def _translate_policy_error(exc: policy.PolicyError) -> tuple[Exception, dict[str, Any]]:
    field = f"model_config.{exc.field}" if exc.field != "model_config" else exc.field
    if exc.forbidden:
        return exceptions.PermissionDenied(str(exc), code="forbidden_setting"), {"field": field}
    return BadRequest(str(exc), code="invalid_setting"), {"field": field}


def _translate_django_error(exc: Exception) -> tuple[Exception, dict[str, Any]]:
    if isinstance(exc, DjangoValidationError):
        errors = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return exceptions.ValidationError(errors, code="invalid"), {}
    if isinstance(exc, RequestDataTooBig):
        return RequestTooLarge(), {}
    if isinstance(exc, SuspiciousOperation):
        security_logger.warning("refused request: %s", exc)
        return BadRequest(str(exc) or BadRequest.default_detail), {}
    if isinstance(exc, (OperationalError, psycopg.OperationalError)):
        logger.warning("answering 503: the database could not serve the request: %s", exc)
        return DatabaseUnavailable(), {}
    return exc, {}


def _summary(errors: Any) -> str:
    """One line out of DRF's nested validation errors: ``"input: This field is required."``."""
    if isinstance(errors, dict):
        parts = []
        for key, value in errors.items():
            text = _summary(value)
            parts.append(text if key in ("non_field_errors", "detail") else f"{key}: {text}")
        return "; ".join(parts)
    if isinstance(errors, (list, tuple)):
        return " ".join(_summary(item) for item in errors)
    return str(errors)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF ``EXCEPTION_HANDLER``: domain errors become 4xx JSON ``{"detail", "code", …}``.

    Returns ``None`` (→ Django's 500 and its logging) for anything it does not know, on purpose:
    an unexpected exception is a bug to see, not a client error to paper over.
    """
    exc, extra = _translate(exc)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"detail": _summary(response.data) or "Invalid input.", "code": "invalid", "errors": response.data}
    elif isinstance(exc, exceptions.APIException) and isinstance(response.data, dict):
        codes = exc.get_codes()
        if isinstance(codes, str):
            response.data.setdefault("code", codes)
    if isinstance(response.data, dict):
        response.data.update(extra)
    if isinstance(exc, (DatabaseUnavailable, KeyInUse)):
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


def error_json_response(http_status: int, detail: str, code: str) -> JsonResponse:
    """``{"detail", "code"}`` rendered as DRF renders (compact separators, UTF-8 kept), for the
    responses made outside DRF's views: the event streams' errors (``api/streams.py``) and Django's
    error views (``api/handlers.py``), so every error body of the API has the same bytes shape."""
    return JsonResponse({"detail": detail, "code": code}, status=http_status,
                        json_dumps_params={"separators": (",", ":"), "ensure_ascii": False})
