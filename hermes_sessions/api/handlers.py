"""Django's error views (``handler400/403/404/500`` in ``project/urls.py``), answering JSON under
``/api/`` and Django's own pages elsewhere (the admin, the landing page).

They run when no view got to answer: a path no route matches (``/api/nope/``,
``/api/sessions/x/nope/``, ``//api/sessions/``, ``/api//sessions/``), a refused Host header, an
uncaught exception. "Under ``/api/``" is ``api.paths.is_api_path`` (doubled slashes count). Their
bodies have the API's error shape, ``{"detail": str, "code": str}`` (``api/openapi.py``), rendered
compact as DRF's. With ``DJANGO_DEBUG`` on, Django shows its debug pages for 404 and 500 instead (Django calls these handlers only with ``DEBUG`` off).
"""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views import defaults

from .errors import error_json_response
from .paths import is_api_request


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """400 (a ``SuspiciousOperation`` such as a Host header not in ``ALLOWED_HOSTS``)."""
    if is_api_request(request):
        return error_json_response(400, "Bad request.", "bad_request")
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    """403 raised outside DRF's views (DRF answers its own 403s)."""
    if is_api_request(request):
        return error_json_response(403, "You do not have permission to perform this action.", "permission_denied")
    return defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404 for a path no route matches: ``{"detail": "No API endpoint at /api/nope/; GET /api/ lists them.",
    "code": "not_found"}`` under ``/api/``."""
    if is_api_request(request):
        # The path is the client's own; cut it so a huge URL does not make a huge answer.
        path = request.path[:200]
        return error_json_response(404, f"No API endpoint at {path}; GET /api/ lists them.", "not_found")
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """500: a bug (invariant I6 says known bad input never gets here); logged by Django as usual."""
    if is_api_request(request):
        return error_json_response(500, "Internal server error.", "server_error")
    return defaults.server_error(request)
