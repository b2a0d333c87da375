"""Which request paths belong to the API: the one test behind every "JSON under ``/api/``" answer
(Django's error views in ``api/handlers.py``, the request-hygiene refusals in ``middleware.py``)."""
from __future__ import annotations

from django.http import HttpRequest

#: The first path segment of every API route (``project/urls.py`` mounts ``api.urls`` there).
API_SEGMENT = "api"


def is_api_path(path: str) -> bool:
    """Whether ``path`` (a request's ``path_info``) is under ``/api``: its first segment that is not
    empty and not ``.`` is ``api`` — ``/api``, ``/api/…``, and also ``//api/…``, ``///api``,
    ``/./api/…`` (with ``/api/`` as a literal prefix only, ``GET //api/sessions/`` would get Django's
    HTML 404 page; ``tests/api/test_api_paths.py``). Such a path routes nowhere (the URL resolver does
    not collapse slashes), but its client is an API client and gets the API's JSON error. ``/apiary``,
    ``/x/../api/`` and ``/API/`` are not API paths (Django's pages answer them)."""
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        return segment == API_SEGMENT
    return False


def is_api_request(request: HttpRequest) -> bool:
    """``is_api_path`` of the request's ``path_info`` (the path below any ``SCRIPT_NAME``)."""
    return is_api_path(request.path_info)
