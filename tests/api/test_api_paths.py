"""Every answer under ``/api`` is the API's JSON — also for paths no route matches, however they are
spelled (``api.paths.is_api_path``); paths outside the API keep Django's pages.

E.g. ``GET //api/sessions/`` is the API's JSON 404, not Django's HTML 404 page.
The test client cannot send it (it parses ``//api/sessions/`` as a URL with host ``api``), so these
requests set ``PATH_INFO`` themselves (WSGI, as runserver and the test client serve) and go through
the ASGI application with a raw scope (as uvicorn calls it, ``make run``).
"""
from __future__ import annotations

import json

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from hermes_sessions.api.paths import is_api_path
from hermes_sessions.models import Session
from project.asgi_handler import HermesASGIHandler
from tests.factories import SessionFactory, UserFactory
from tests.test_asgi_handler import _run, _scope

UNROUTED_API_PATHS = [
    "//api/sessions/",  # a double leading slash
    "//api/sessions",
    "//api/",
    "//api",
    "///api/sessions/",
    "/./api/sessions/",
    "/api//sessions/",
    "/api/sessions//",
    "/api/sessions///",
    "//api/sessions/sess-x/turns/",
    "/api/sessions/sess-x//turns/",
    "/api/sessions/sess-x/turns//",
    "/api//",
    "/api/nope",
    "/api/nope/",
    "/api/sessions/sess-x/nope/",
    "/api/turns/",
    "/api/schema//",
]
NOT_API_PATHS = ["/nope/", "//nope/", "//admin/nope/", "/apiary/", "/API/sessions/", "/x/../api/sessions/"]


def _wsgi(path: str, method: str = "GET", **extra: str):
    """A request with exactly this ``PATH_INFO`` through Django's WSGI handler (the test client's)."""
    api = APIClient()
    api.force_authenticate(UserFactory())
    return api.request(PATH_INFO=path, REQUEST_METHOD=method, **extra)


def _assert_json_404(status: int, content_type: str, body: bytes, path: str) -> None:
    assert status == 404, (path, status, body[:200])
    assert content_type == "application/json", (path, content_type, body[:200])
    data = json.loads(body)
    assert set(data) == {"detail", "code"} and data["code"] == "not_found", (path, data)
    assert data["detail"] == f"No API endpoint at {path}; GET /api/ lists them."


@pytest.mark.django_db
@pytest.mark.parametrize("method", ["GET", "POST", "HEAD", "DELETE"])
@pytest.mark.parametrize("path", UNROUTED_API_PATHS)
def test_an_unrouted_api_path_is_a_json_404_under_wsgi(path, method):
    response = _wsgi(path, method)
    if method == "HEAD":  # the test client drops HEAD bodies, as servers do
        assert (response.status_code, response["Content-Type"]) == (404, "application/json"), path
        return
    _assert_json_404(response.status_code, response["Content-Type"], response.content, path)


@pytest.mark.django_db(transaction=True)  # the ASGI request runs in another thread, on its own connection
@pytest.mark.parametrize("path", UNROUTED_API_PATHS)
def test_an_unrouted_api_path_is_a_json_404_under_asgi(path):
    token = Token.objects.create(user=UserFactory()).key
    status, body = _run(HermesASGIHandler(), _scope(path, token))
    _assert_json_404(status, "application/json", body, path)


@pytest.mark.django_db
@pytest.mark.parametrize("path", NOT_API_PATHS)
def test_paths_outside_the_api_keep_djangos_404_page(path):
    response = _wsgi(path)
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html"), path


@pytest.mark.django_db
def test_a_doubled_slash_never_reaches_a_view():
    """``//api/sessions/`` is not an alias of ``/api/sessions/``: it creates and lists nothing."""
    SessionFactory()
    _assert_json_404(*(lambda r: (r.status_code, r["Content-Type"], r.content))(
        _wsgi("//api/sessions/", "POST", CONTENT_TYPE="application/json")), "//api/sessions/")
    assert Session.objects.count() == 1


@pytest.mark.django_db
def test_request_hygiene_refusals_are_json_under_a_doubled_slash_too():
    """The other answers made before any view (``middleware.py``) use the same test of "under /api"."""
    response = _wsgi("//api/sessions/", "GET", QUERY_STRING="q=%00")
    assert (response.status_code, response["Content-Type"]) == (400, "application/json")
    assert response.json()["code"] == "bad_request"
    response = _wsgi("//api/sessions/", "POST", HTTP_TRANSFER_ENCODING="chunked")
    assert (response.status_code, response["Content-Type"]) == (411, "application/json")
    assert response.json()["code"] == "length_required"
    assert _wsgi("//nope/", "GET", QUERY_STRING="q=%00")["Content-Type"].startswith("text/plain")


@pytest.mark.parametrize(("path", "expected"), [
    ("/api", True), ("/api/", True), ("//api", True), ("/./api/x", True), ("/api/../admin/", True),
    ("/", False), ("", False), ("/apiary", False), ("/API/", False), ("/admin/api/", False), ("/x/../api/", False),
])
def test_is_api_path(path, expected):
    assert is_api_path(path) is expected
