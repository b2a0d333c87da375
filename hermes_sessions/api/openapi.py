"""What the OpenAPI schema says about errors: the one JSON error shape and which statuses each
operation really answers.

Every error under ``/api/`` is a JSON object ``{"detail": str, "code": str, …}`` made by
``api.errors.exception_handler`` (DRF's exceptions, the services' and the policy's), by
``api.views.api_not_found`` and the other ``handler4xx`` views (paths no route matches), or by
``middleware.RejectNulMiddleware`` (NUL bytes). ``error_responses`` builds the ``responses`` entries
of ``extend_schema`` from status codes, so each view lists the statuses it can answer and no others
(``tests/api/test_schemathesis.py`` checks the answers against the schema).
"""
from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from .serializers import ApprovalSerializer, TurnSerializer


class ErrorSerializer(serializers.Serializer):
    """The API's error body. ``code`` is a machine word (``not_found``, ``invalid``, ``parse_error``,
    ``not_authenticated``, ``session_id_taken``, … — the table in ``api/errors.py``)."""

    detail = serializers.CharField(help_text="What went wrong, for a human.")
    code = serializers.CharField(help_text="What went wrong, for a program.")
    field = serializers.CharField(
        required=False, help_text="The request field the error is about (`id`, `input`, `model_config.sandbox`, `Idempotency-Key`)."
    )


# ``errors`` cannot be a class attribute: it would hide ``Serializer.errors``. Declared fields are
# what drf-spectacular reads, so it is added there.
ErrorSerializer._declared_fields["errors"] = serializers.DictField(
    required=False, help_text="Validation errors (code `invalid`): a list of messages per field."
)


class SessionBusyErrorSerializer(ErrorSerializer):
    """409 ``session_busy``: ``on_busy=reject`` and the session has a turn running or queued."""

    turn = serializers.UUIDField(help_text="The id of the turn the session is busy with.")


class TurnFinishedErrorSerializer(ErrorSerializer):
    """409 ``turn_finished``: the turn to cancel already ended; ``turn`` is it, as ``GET /api/turns/{id}/`` shows it."""

    turn = TurnSerializer()


class ApprovalClosedErrorSerializer(ErrorSerializer):
    """409 ``approval_closed``: the approval was already decided, expired or cancelled, or its turn no longer
    runs; ``approval`` is it as it is now."""

    approval = ApprovalSerializer()


class InvalidDecisionErrorSerializer(ErrorSerializer):
    """400 ``invalid_decision``: a decision the approval does not offer, or answers that do not fit it."""

    available_decisions = serializers.ListField(child=serializers.CharField(),
                                                help_text="The decisions this approval offers.")


# What each status means wherever it occurs; a view passes its own text where it says more.
DEFAULT_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request: a query parameter out of its range, a JSON body that does not parse or breaks the "
    "body schema (`errors` holds the per-field reasons), or NUL bytes in the URL or headers.",
    401: "No credentials, or an unknown token (`Authorization: Token <key>`, or the admin's session cookie).",
    403: "With session (cookie) authentication, a POST without a valid CSRF token.",
    404: "No such object among yours (another user's objects are 404 too).",
    409: "The request conflicts with the current state.",
    413: "The body is larger than `DJANGO_DATA_UPLOAD_MAX_MEMORY_SIZE` (1 MiB by default).",
    415: "The body is not `application/json`.",
    422: "The `Idempotency-Key` was used before with a different body.",
    503: "The database is unavailable or overloaded (`database_unavailable`, `Retry-After: 1`): retry shortly.",
}


def error_responses(*statuses: int, **described: str | tuple[str, type[ErrorSerializer]]) -> dict[int, OpenApiResponse]:
    """``extend_schema(responses=…)`` entries for error statuses: ``statuses`` with their default
    description, plus ``described`` as ``s404="No such session."`` or ``s409=(text, Serializer)``.
    400, 401 and 503 are always included: every endpoint refuses NUL bytes in its URL or headers
    (``middleware.RejectNulMiddleware``), but for the API root requires authentication, and answers 503
    when the database cannot serve it (``errors.DatabaseUnavailable``)."""
    out: dict[int, OpenApiResponse] = {}
    for status in sorted({400, 401, 503, *statuses}):
        out[status] = OpenApiResponse(ErrorSerializer, description=DEFAULT_DESCRIPTIONS[status])
    for key, value in described.items():
        text, serializer = value if isinstance(value, tuple) else (value, ErrorSerializer)
        out[int(key.removeprefix("s"))] = OpenApiResponse(serializer, description=text)
    return dict(sorted(out.items()))

