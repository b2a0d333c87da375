"""Every route under /api/ answers with and without its trailing slash (``ApiOptionalSlashMiddleware``).

The failing input: ``POST /api/sessions`` and ``POST /api/sessions/<id>/turns`` got Django's
``APPEND_SLASH`` answer — an HTML 301 to the slashed path — and a client following it lost the body.
The routes are read from the URLconf, so a route added later is covered without editing this file.
Every method, HEAD and OPTIONS included: the walk found ``OPTIONS /api/docs/`` answering 500
(``api.schema.ApiDocsView``).
"""
from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from hermes_sessions.models import Session, Turn
from tests.factories import ApprovalFactory, SessionFactory, TurnFactory, WebhookEndpointFactory

pytestmark = pytest.mark.django_db

METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")
PARAM = re.compile(r"<(?:\w+:)?(\w+)>")


@pytest.fixture(autouse=True)
def _no_codex(dispatched):
    """Turns stay queued (``dispatched`` in tests/api/conftest.py)."""


def _routes(patterns: list[Any] | None = None, prefix: str = "") -> list[tuple[str, URLPattern]]:
    """``(route, pattern)`` for every URL pattern of the project whose route starts with ``api/``."""
    found: list[tuple[str, URLPattern]] = []
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            found += _routes(entry.url_patterns, route)
        elif route.startswith("api/"):
            found.append((route, entry))
    return found


API_ROUTES = _routes()


def _fresh_path(route: str, user: Any) -> str:
    """The route with its parameters filled by objects made for this one request (a session of the
    user with a queued turn that asked an approval, a webhook endpoint of the user), so the slashed and the slashless request each act on their own."""
    session = SessionFactory(owner=user, last_turn_seq=1)
    turn = TurnFactory(session=session, seq=1)
    values = {"session_id": session.id, "turn_id": str(turn.id), "approval_id": str(ApprovalFactory(turn=turn).pk),
              "webhook_id": str(WebhookEndpointFactory(owner=user).pk)}
    unknown = set(PARAM.findall(route)) - values.keys()
    assert not unknown, f"{route}: teach this test a value for {unknown}"
    return "/" + PARAM.sub(lambda m: values[m.group(1)], route)


def _body(method: str, route: str, n: int) -> dict[str, Any] | None:
    if method in ("GET", "DELETE"):
        return None
    if route.endswith("/turns/"):
        return {"input": f"hello {n}"}
    if route == "api/sessions/":
        return {"id": f"sess-slash-{n}", "title": f"title {n}"}
    return {}


def _call(client: APIClient, method: str, path: str, body: dict[str, Any] | None) -> Any:
    return getattr(client, method.lower())(path, body, format="json") if body is not None else \
        getattr(client, method.lower())(path)


def _shape(response: Any) -> tuple[int, str, Any]:
    ctype = response.get("Content-Type", "").split(";")[0]
    keys = sorted(json.loads(response.content)) if ctype == "application/json" and response.content.startswith(b"{") \
        else None
    return response.status_code, ctype, keys


def test_the_api_has_the_routes_this_test_walks():
    names = {pattern.name for _, pattern in API_ROUTES}
    assert {"session-list", "session-turns", "session-events", "turn-cancel", "schema"} <= names


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("route", "pattern"), API_ROUTES, ids=[route for route, _ in API_ROUTES])
def test_every_api_route_answers_the_same_without_its_trailing_slash(client, user, route, pattern, method):
    assert route.endswith("/")
    slashed = _call(client, method, _fresh_path(route, user), _body(method, route, 1))
    bare_path = _fresh_path(route, user).rstrip("/")
    bare = _call(client, method, bare_path, _body(method, route, 2))
    assert not 300 <= bare.status_code < 400, f"{method} {bare_path}: {bare.status_code} to {bare.get('Location')}"
    assert _shape(bare) == _shape(slashed), f"{method} {bare_path}"
    if route != "api/docs/":  # Swagger UI's page is HTML on purpose
        assert bare.get("Content-Type", "").split(";")[0] != "text/html", f"{method} {bare_path}"


def test_post_api_sessions_without_slash_creates_the_session_it_was_sent(client, user):
    response = client.post("/api/sessions", {"id": "sess-no-slash", "title": "kept"}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["id"] == "sess-no-slash"
    assert Session.objects.get(pk="sess-no-slash").title == "kept"


def test_post_turns_without_slash_queues_the_input_it_was_sent(client, user):
    session = SessionFactory(owner=user)
    response = client.post(f"/api/sessions/{session.id}/turns", {"input": "the body arrived"}, format="json")
    assert response.status_code == 202, response.content
    turn = Turn.objects.get(pk=response.json()["id"])
    assert turn.input == "the body arrived"


def test_links_the_api_writes_keep_the_slash(client, user):
    SessionFactory.create_batch(2, owner=user)
    body = client.get("/api/sessions?page_size=1").json()
    assert body["next"].startswith("http://testserver/api/sessions/?")
    assert client.get("/api").json()["sessions"] == "http://testserver/api/sessions/"


@pytest.mark.parametrize("url", ["/api/nope", "/api/sessions/x/nope", "/api/turns/a/b/c"])
def test_an_unknown_api_path_without_slash_is_the_json_404(client, url):
    response = client.post(url, {"input": "x"}, format="json")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")
    assert response.json()["code"] == "not_found"


def test_paths_outside_the_api_keep_djangos_redirect(admin_client):
    response = admin_client.get("/admin")
    assert response.status_code == 301 and response["Location"] == "/admin/"


def test_the_schema_lists_each_path_once_with_its_slash():
    paths = list(json.loads(APIClient().get("/api/schema/?format=json").content)["paths"])
    assert paths and all(path.endswith("/") for path in paths)
    assert len({path.rstrip("/") for path in paths}) == len(paths)
