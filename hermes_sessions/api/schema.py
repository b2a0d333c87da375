"""OpenAPI for what drf-spectacular cannot see: the server-sent-event endpoints (``api/streams.py``)
are async Django views, so a postprocessing hook (``SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]``)
adds them — a ``text/event-stream`` 200 and the API's JSON error body for 400/401/404/503. And the
Swagger UI page's view (``ApiDocsView``)."""
from __future__ import annotations

from typing import Any

from drf_spectacular.views import SpectacularSwaggerView
from rest_framework.renderers import BaseRenderer, JSONRenderer

# The API's one error body (``api/openapi.py`` ErrorSerializer, component "Error"), as every other
# operation documents its 4xx (docs/contract.md §9).
ERROR_BODY = {"$ref": "#/components/schemas/Error"}
STREAM_DESCRIPTION = (
    "Server-sent events (docs/contract.md §8). Each event: `id: <bigint>`, `event: <kind>` "
    "(queued, running, retrying, thread, delta, item, usage, approval.requested, approval.resolved, completed, "
    "failed, cancelled), one `data:` "
    "line of JSON with `turn` and `attempt`. Heartbeats are `:` comment lines without an id. A stream whose "
    "turn or session is deleted ends with `event: gone` (no id; data: `detail`, `code` `not_found`, and "
    "`turn` or `session`), found within a heartbeat interval."
)
LAST_EVENT_ID = [
    {"in": "header", "name": "Last-Event-ID", "required": False, "schema": {"type": "integer", "minimum": 0},
     "description": "Resume after this event id: the rest, exactly once, in order."},
    {"in": "query", "name": "last_event_id", "required": False, "schema": {"type": "integer", "minimum": 0},
     "description": "As Last-Event-ID, for clients that cannot set headers (the header wins)."},
]


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_BODY}}}


def _operation(*, operation_id: str, summary: str, description: str, tag: str, param: dict[str, Any]) -> dict[str, Any]:
    return {
        "operationId": operation_id,
        "summary": summary,
        "description": description + " " + STREAM_DESCRIPTION,
        "tags": [tag],
        "parameters": [param, *LAST_EVENT_ID],
        "security": [{"tokenAuth": []}, {"cookieAuth": []}],
        "responses": {
            "200": {"description": "The event stream.",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "400": _error("Last-Event-ID is not a non-negative integer, or a NUL byte in the URL or headers."),
            "401": _error("No or invalid credentials."),
            "404": _error("No such turn or session (or not yours)."),
            "503": _error("The database is unavailable or overloaded (`database_unavailable`, `Retry-After: 1`)."),
        },
    }


def add_event_streams(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add ``/api/turns/{turn_id}/events/`` and
    ``/api/sessions/{session_id}/events/`` to ``result["paths"]``."""
    paths = result.setdefault("paths", {})
    paths["/api/turns/{turn_id}/events/"] = {"get": _operation(
        operation_id="turns_events", summary="Stream a turn's events (server-sent events)", tag="turns",
        description="From the turn's first event; ends after its terminal event (completed, failed, cancelled).",
        param={"in": "path", "name": "turn_id", "required": True, "schema": {"type": "string", "format": "uuid"}},
    )}
    paths["/api/sessions/{session_id}/events/"] = {"get": _operation(
        operation_id="sessions_events", summary="Stream a session's events (server-sent events)", tag="sessions",
        description="Every turn's events from now on (Last-Event-ID: after it; 0 replays all); heartbeats "
                    "while idle; ends only when the session is deleted (`event: gone`).",
        param={"in": "path", "name": "session_id", "required": True, "schema": {"type": "string"},
               "description": "The session id (see POST /api/sessions/)."},
    )}
    return result


# drf-spectacular's page view renders only HTML templates, so its OPTIONS (a body without a template) was a
# 500 TemplateDoesNotExist (found by tests/api/test_optional_slash.py's walk of every method). Its docstring
# is what OPTIONS shows a client.
class ApiDocsView(SpectacularSwaggerView):
    """The schema of this API rendered by Swagger UI (an HTML page).

    ``GET /api/docs/``; ``OPTIONS`` answers JSON, as on every route."""

    def get_renderers(self) -> list[BaseRenderer]:
        """JSON for ``OPTIONS``, the page's HTML renderer for everything else."""
        if self.request is not None and self.request.method == "OPTIONS":
            return [JSONRenderer()]
        return super().get_renderers()
