"""Request hygiene that applies to every URL (API and admin)."""
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import is_valid_path

from .api.errors import error_json_response
from .api.paths import is_api_request


class RejectNulMiddleware:
    """Answer 400 to any request whose path, query string, header or cookie carries a NUL byte.

    No id, filter, cursor, token or session key of ours can contain NUL, and PostgreSQL refuses NUL in
    text (psycopg raises ``ValueError`` → a 500 deep inside whatever view got it: an admin list
    filter, the token lookup of ``Authorization``, the session lookup of the ``sessionid`` cookie).
    gunicorn refuses NUL in headers itself; runserver and other servers pass it through. Refusing
    the class here keeps every view from needing its own guard. Under ``/api/`` the answer has the
    API's JSON error shape (``{"detail", "code": "bad_request"}``, ``api/openapi.py``), elsewhere it is
    plain text.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        query = request.META.get("QUERY_STRING", "")
        if "\x00" in request.path or "%00" in query or "\x00" in query:
            return _refuse(request, "NUL bytes are not allowed in URLs.")
        headers = (value for key, value in request.META.items() if key.startswith("HTTP_") and isinstance(value, str))
        # Cookie values are checked after parsing too: a quoted cookie carries NUL as the escape "\000".
        if any("\x00" in value for value in headers) or any("\x00" in value for value in request.COOKIES.values()):
            return _refuse(request, "NUL bytes are not allowed in headers or cookies.")
        return self.get_response(request)


class RequireContentLengthMiddleware:
    """Answer 411 to a request that sends a body without ``Content-Length`` (``Transfer-Encoding:
    chunked``).

    DRF and Django's form parsing size a body by ``Content-Length``; without it they read none, so a
    chunked ``POST /api/sessions/`` was created with none of its fields (and a chunked body escaped
    the 413 size check). Refused here for every URL; under ``/api/`` as the API's JSON error
    (``code``: ``length_required``)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.META.get("HTTP_TRANSFER_ENCODING") and request.META.get("CONTENT_LENGTH") in (None, "", "0"):
            reason = "A request body needs a Content-Length header; chunked bodies are not accepted."
            if is_api_request(request):
                return error_json_response(411, reason, "length_required")
            return HttpResponse(reason, status=411, content_type="text/plain")
        return self.get_response(request)


class ApiOptionalSlashMiddleware:
    """Route an ``/api/`` request whose path lacks its trailing slash (``POST /api/sessions``,
    ``POST /api/sessions/<id>/turns``) to the route with the slash, in place: no redirect.

    Without it Django's ``APPEND_SLASH`` (``CommonMiddleware``, which runs after this) answered such a
    request with an HTML 301 to the slashed path, and a client following it lost the POST's body (and
    its method, for most clients). The rule is Django's own — only a path that resolves to nothing as
    it is and to a route once a ``/`` is appended — so every route under ``/api/``, present or added
    later, answers with and without its slash, and the schema, ``reverse()`` and the links the API
    writes keep the one spelling with the slash (the view sees the slashed path). Other paths (the
    admin, the landing page) keep Django's redirect."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        path = request.path_info
        if (path == "/api" or path.startswith("/api/")) and not path.endswith("/"):
            urlconf = getattr(request, "urlconf", None)
            if not is_valid_path(path, urlconf) and is_valid_path(f"{path}/", urlconf):
                request.path_info = f"{path}/"
                request.path = f"{request.path}/"
        return self.get_response(request)


def _refuse(request: HttpRequest, reason: str) -> HttpResponse:
    if is_api_request(request):  # also //api/…: api.paths
        return error_json_response(400, reason, "bad_request")
    return HttpResponseBadRequest(reason, content_type="text/plain")
