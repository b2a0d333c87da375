"""The API root's listing (``GET /api/``), read from the URLconf so a route added to
``api/urls.py`` is listed without editing anything here."""
from __future__ import annotations

import re
from typing import Any

from django.urls import URLPattern, reverse
from rest_framework import serializers
from rest_framework.request import Request

_CONVERTER = re.compile(r"<(?:\w+:)?(\w+)>")  # "<str:session_id>" → "{session_id}"


class RouteSerializer(serializers.Serializer):
    """One API route: its path template, the methods it answers, and what it is."""

    path = serializers.CharField(help_text="Path template, e.g. `/api/sessions/{session_id}/turns/`.")
    methods = serializers.ListField(child=serializers.CharField(), help_text="HTTP methods, e.g. `[\"GET\", \"POST\"]`.")
    summary = serializers.CharField(help_text="The first line of the view's description.")


class ApiRootSerializer(serializers.Serializer):
    """``GET /api/``: where to start, and every route."""

    sessions = serializers.URLField(help_text="The sessions list (`GET`, `POST`).")
    schema = serializers.URLField(help_text="The OpenAPI 3 schema of this API.")
    docs = serializers.URLField(help_text="The schema rendered by Swagger UI.")
    routes = RouteSerializer(many=True)


def _routes() -> list[dict[str, Any]]:
    # Imported here: api.urls imports the views, which import this module.
    from . import urls

    out = []
    for pattern in urls.urlpatterns:
        if not isinstance(pattern, URLPattern) or pattern.name == "root":
            continue
        view_class = getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None)
        # HEAD and OPTIONS are left out: every route answers them (DRF's views, and api/streams.py's).
        if view_class is None:  # a function view: the event streams (api/streams.py), GET (+ HEAD, OPTIONS)
            methods, doc = ["GET"], (pattern.callback.__doc__ or "").strip()
        else:
            methods = [m for m in view_class().allowed_methods if m not in ("HEAD", "OPTIONS")]
            doc = (view_class.__doc__ or "").strip()
        # A view's first docstring line is written for this: one plain sentence (tests/api/test_contract.py).
        summary = doc.splitlines()[0] if doc else ""
        path = "/api/" + _CONVERTER.sub(r"{\1}", str(pattern.pattern))
        out.append({"path": path, "methods": methods, "summary": summary})
    return out


def api_root(request: Request) -> dict[str, Any]:
    """The body of ``GET /api/`` (absolute URLs built from the request's host)."""
    return {
        "sessions": request.build_absolute_uri(reverse("api:session-list")),
        "schema": request.build_absolute_uri(reverse("schema")),
        "docs": request.build_absolute_uri(reverse("api-docs")),
        "routes": _routes(),
    }
