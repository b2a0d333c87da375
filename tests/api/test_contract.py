"""The schema at /api/schema/ is the API's contract: what it allows the API accepts, what it refuses
the API refuses, and every answer — errors included — has the shape it documents.

One test per mismatch schemathesis found (``tests/api/test_schemathesis.py`` runs it on every
``make test``), checked directly: the real answer, validated against the served schema.
"""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from rest_framework.renderers import JSONRenderer
from rest_framework.test import APIClient

from hermes_sessions.models import Turn
from tests.factories import NoticeFactory, SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_codex(dispatched):
    """Turns stay queued (``dispatched`` in tests/api/conftest.py)."""


@pytest.fixture
def schema() -> dict[str, Any]:
    response = APIClient().get("/api/schema/?format=json")
    assert response.status_code == 200
    return json.loads(response.content)


@pytest.fixture
def session(user):
    return SessionFactory(owner=user, id="sess-contract")


def _json_schema(node: Any) -> Any:
    """OpenAPI 3.0 → JSON Schema: ``nullable: true`` becomes ``null`` allowed; the rest is the same."""
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _json_schema(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def assert_documented(schema: dict, path: str, method: str, response: Any) -> None:
    """``response`` has a status the operation documents, and a JSON body its schema accepts."""
    operation = schema["paths"][path][method.lower()]
    status = str(response.status_code)
    assert status in operation["responses"], f"{method} {path} answered undocumented {status}: {response.content[:300]!r}"
    body_schema = operation["responses"][status]["content"]["application/json"]["schema"]
    assert response["Content-Type"].startswith("application/json")
    root = {**_json_schema(body_schema), "components": _json_schema(schema["components"])}
    jsonschema.validate(json.loads(response.content), root)


def _valid(schema: dict, component: str, instance: Any) -> bool:
    root = {"$ref": f"#/components/schemas/{component}", "components": _json_schema(schema["components"])}
    return jsonschema.Draft7Validator(root).is_valid(instance)


# --- thread_action: null until known ---------------------------------------------------------------


def test_a_queued_turn_has_thread_action_null_and_matches_the_schema(client, session, schema):
    posted = client.post(f"/api/sessions/{session.id}/turns/", {"input": "hi"}, format="json")
    assert posted.status_code == 202 and posted.json()["thread_action"] is None
    assert_documented(schema, "/api/sessions/{session_id}/turns/", "POST", posted)
    read = client.get(f"/api/turns/{posted.json()['id']}/")
    assert read.json()["thread_action"] is None
    assert_documented(schema, "/api/turns/{turn_id}/", "GET", read)


def test_a_turn_cancelled_before_it_ran_keeps_thread_action_null(client, session, schema):
    turn = TurnFactory(session=session, status=Turn.Status.QUEUED)
    cancelled = client.post(f"/api/turns/{turn.id}/cancel/")
    assert (cancelled.status_code, cancelled.json()["status"], cancelled.json()["thread_action"]) == (202, "cancelled", None)
    assert_documented(schema, "/api/turns/{turn_id}/cancel/", "POST", cancelled)
    again = client.post(f"/api/turns/{turn.id}/cancel/")
    assert again.status_code == 409 and again.json()["turn"]["thread_action"] is None
    assert_documented(schema, "/api/turns/{turn_id}/cancel/", "POST", again)


def test_a_finished_turn_shows_its_thread_action(client, session, schema):
    turn = TurnFactory(session=session, status=Turn.Status.SUCCEEDED, thread_action=Turn.ThreadAction.ROTATED)
    read = client.get(f"/api/turns/{turn.id}/")
    assert read.json()["thread_action"] == "rotated"
    assert_documented(schema, "/api/turns/{turn_id}/", "GET", read)


# --- request bodies: the schema refuses exactly what the server refuses --------------------------------


@pytest.mark.parametrize(("text", "accepted"), [
    ("", False), (" ", False), ("\n\t ", False), ("\u3000", False), ("\x1c", False),  # str.isspace() all
    ("x", True), (" x ", True), ("\x00", True),  # NUL is stored as U+FFFD, not refused
])
def test_turn_input_schema_and_server_agree(client, session, schema, text, accepted):
    body = {"input": text}
    # The schema's pattern is read as Python reads it (as schemathesis does): \S is "not str.isspace()".
    input_schema = schema["components"]["schemas"]["TurnCreate"]["properties"]["input"]
    assert input_schema["minLength"] == 1 and input_schema["pattern"] == r"\S"
    by_schema = _valid(schema, "TurnCreate", body) and re.search(input_schema["pattern"], text) is not None
    response = client.post(f"/api/sessions/{session.id}/turns/", body, format="json")
    assert (by_schema, response.status_code == 202) == (accepted, accepted), response.content
    if not accepted:
        assert response.json()["code"] == "invalid" and response.json()["errors"]["input"]
        assert_documented(schema, "/api/sessions/{session_id}/turns/", "POST", response)


@pytest.mark.parametrize(("body", "status", "schema_valid"), [
    ({"title": ""}, 201, True),
    ({"id": ""}, 201, True),
    ({"id": "a.b:c-1_2", "title": ""}, 201, True),
    ({"model_config": {"model": "m", "developer_instructions": "", "sandbox": "workspace-write", "approval_policy": "never"}},
     201, True),
    ({"model_config": {"sandbox": "danger-full-access"}}, 403, True),  # a value the schema lists; staff only
    ({"model_config": {"cwd": "/"}}, 403, False),  # the server assigns it: refused by both
    ({"id": "-leading-dash"}, 400, False),
    ({"id": "x" * 65}, 400, False),
    ({"model_config": {"model": ""}}, 400, False),
    ({"model_config": {"sandbox": "yolo"}}, 400, False),
    ({"model_config": None}, 400, False),
    ({"title": "x" * 201}, 400, False),
])
def test_session_body_schema_and_server_agree(client, schema, body, status, schema_valid):
    assert _valid(schema, "SessionCreate", body) == schema_valid
    response = client.post("/api/sessions/", body, format="json")
    assert response.status_code == status, response.content
    assert_documented(schema, "/api/sessions/", "POST", response)


@pytest.mark.parametrize(("key", "accepted"), [
    ("k", True), ("a b", True), ("x" * 255, True), ("~!@#", True), ("k \t", True),  # HTTP strips surrounding blanks
    ("x" * 256, False), ("é", False), ("\t", False), (" ", False), ("a\x01b", False),
])
def test_idempotency_key_schema_and_server_agree(client, schema, key, accepted):
    parameter = next(p for p in schema["paths"]["/api/sessions/"]["post"]["parameters"] if p["name"] == "Idempotency-Key")
    assert (re.search(parameter["schema"]["pattern"], key) is not None) == accepted
    response = client.post("/api/sessions/", {}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert (response.status_code == 201) == accepted, response.content
    assert_documented(schema, "/api/sessions/", "POST", response)


def test_a_reused_idempotency_key_with_another_body_is_the_documented_422(client, schema):
    assert client.post("/api/sessions/", {"title": "a"}, format="json", HTTP_IDEMPOTENCY_KEY="0").status_code == 201
    replay = client.post("/api/sessions/", {"title": "a"}, format="json", HTTP_IDEMPOTENCY_KEY="0")
    assert replay.status_code == 200
    assert_documented(schema, "/api/sessions/", "POST", replay)
    other = client.post("/api/sessions/", {"title": "b"}, format="json", HTTP_IDEMPOTENCY_KEY="0")
    assert (other.status_code, other.json()["code"]) == (422, "idempotency_key_reused")
    assert_documented(schema, "/api/sessions/", "POST", other)


def test_blanks_around_an_idempotency_key_are_not_part_of_it(client):
    # What schemathesis sent: a key with a trailing space, which HTTP servers strip before Django.
    first = client.post("/api/sessions/", {"title": "a"}, format="json", HTTP_IDEMPOTENCY_KEY="key-1")
    again = client.post("/api/sessions/", {"title": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=" key-1\t ")
    assert (first.status_code, again.status_code, again.json()["id"]) == (201, 200, first.json()["id"])


# --- query parameters --------------------------------------------------------------------------------


LISTS = ["/api/sessions/", "/api/sessions/{session_id}/turns/", "/api/sessions/{session_id}/notices/",
         "/api/sessions/{session_id}/messages/"]


@pytest.mark.parametrize("path", LISTS)
@pytest.mark.parametrize("query", ["page_size=null", "page_size=abc", "page_size=1.5", "page_size=0", "page_size=-2",
                                   "page_size=", "page=null", "page=0", "page=-1", "page=last"])
def test_page_parameters_that_are_not_integers_of_at_least_1_are_400(client, session, schema, path, query):
    if path.endswith("messages/") and query.startswith("page="):
        return  # the transcript pages by cursor; `page` is no parameter of it (and is ignored)
    response = client.get(path.replace("{session_id}", session.id) + "?" + query)
    assert response.status_code == 400, response.content
    name = query.split("=")[0]
    assert response.json()["errors"][name]
    assert_documented(schema, path, "GET", response)


def test_page_size_above_the_cap_is_served_at_the_cap_as_documented(client, user, schema):
    SessionFactory.create_batch(3, owner=user)
    response = client.get("/api/sessions/?page_size=" + "9" * 40)
    assert response.status_code == 200 and len(response.json()["results"]) == 3
    parameter = next(p for p in schema["paths"]["/api/sessions/"]["get"]["parameters"] if p["name"] == "page_size")
    assert parameter["schema"] == {"type": "integer", "minimum": 1} and "500" in parameter["description"]


@pytest.mark.parametrize("page", ["2", "9" * 30])
def test_a_page_past_the_last_is_the_documented_404(client, session, schema, page):
    response = client.get(f"/api/sessions/?page={page}")
    assert response.status_code == 404
    assert_documented(schema, "/api/sessions/", "GET", response)


# --- every error is documented, with the JSON error shape ---------------------------------------------


def test_every_operation_documents_its_errors_with_the_error_shape(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            statuses = set(operation["responses"])
            assert {"400", "401"} <= statuses, (method, path)
            if "{" in path:
                assert "404" in statuses, (method, path)
            if "requestBody" in operation:
                assert {"403", "413", "415"} <= statuses, (method, path)
            for status, response in operation["responses"].items():
                if status.startswith("4"):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.split("/")[-1].endswith("Error"), (method, path, status)


@pytest.mark.parametrize(("path", "url"), [
    ("/api/sessions/{session_id}/", "/api/sessions/nope/"),
    ("/api/sessions/{session_id}/", "/api/sessions/-bad-/"),
    ("/api/sessions/{session_id}/turns/", "/api/sessions/nope/turns/"),
    ("/api/sessions/{session_id}/messages/", "/api/sessions/nope/messages/"),
    ("/api/sessions/{session_id}/notices/", "/api/sessions/nope/notices/"),
    ("/api/turns/{turn_id}/", "/api/turns/null,null/"),
    ("/api/turns/{turn_id}/", "/api/turns/00000000-0000-0000-0000-000000000000/"),
])
def test_404s_have_the_documented_shape(client, schema, path, url):
    response = client.get(url)
    assert (response.status_code, response.json()["code"]) == (404, "not_found")
    assert_documented(schema, path, "GET", response)


def test_another_users_session_and_turn_are_404(client, schema):
    other = SessionFactory(owner=UserFactory())
    turn = TurnFactory(session=other)
    for path, url in [("/api/sessions/{session_id}/turns/", f"/api/sessions/{other.id}/turns/"),
                      ("/api/turns/{turn_id}/", f"/api/turns/{turn.id}/")]:
        response = client.get(url)
        assert response.status_code == 404
        assert_documented(schema, path, "GET", response)


def test_no_credentials_is_the_documented_401(schema):
    response = APIClient().get("/api/sessions/")
    assert (response.status_code, response.json()["code"]) == (401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Token")
    assert_documented(schema, "/api/sessions/", "GET", response)


def test_a_body_that_is_not_json_is_the_documented_415(client, session, schema):
    response = client.post(f"/api/sessions/{session.id}/turns/", data="input=hi", content_type="text/plain")
    assert response.status_code == 415
    assert_documented(schema, "/api/sessions/{session_id}/turns/", "POST", response)


def test_session_busy_409_names_the_turn_as_documented(client, session, schema):
    busy = TurnFactory(session=session, status=Turn.Status.QUEUED)
    response = client.post(f"/api/sessions/{session.id}/turns/", {"input": "x", "on_busy": "reject"}, format="json")
    assert (response.status_code, response.json()["turn"]) == (409, str(busy.id))
    assert_documented(schema, "/api/sessions/{session_id}/turns/", "POST", response)


# --- paths and methods no route has --------------------------------------------------------------------


@pytest.mark.parametrize("url", ["/api/nope/", "/api/sessions/x/nope/", "/api/turns/a/b/c/", "/api/schema/nope/"])
def test_unknown_paths_under_api_are_json_404(client, url):
    response = client.get(url)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "not_found" and "GET /api/" in response.json()["detail"]
    # The same bytes shape as DRF's own error bodies (compact, UTF-8 kept).
    assert response.content == JSONRenderer().render(response.json())
    drf_404 = client.get("/api/sessions/nope/")
    assert drf_404.content == JSONRenderer().render(drf_404.json())


def test_unknown_paths_elsewhere_stay_html(client):
    response = client.get("/nope/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(("method", "url", "allow"), [
    ("delete", "/api/sessions/", "GET, POST, HEAD, OPTIONS"),
    ("put", "/api/sessions/sess-contract/", "GET, HEAD, OPTIONS"),
    ("patch", "/api/turns/00000000-0000-0000-0000-000000000000/", "GET, HEAD, OPTIONS"),
    ("get", "/api/turns/00000000-0000-0000-0000-000000000000/cancel/", "POST, OPTIONS"),
    ("post", "/api/", "GET, HEAD, OPTIONS"),
])
def test_a_method_no_route_has_is_json_405_with_allow(client, session, method, url, allow):
    response = getattr(client, method)(url)
    assert response.status_code == 405
    assert response["Allow"] == allow
    assert response.json()["code"] == "method_not_allowed"


def test_a_host_not_allowed_is_json_400_under_api_only():
    api = APIClient(HTTP_HOST="evil.example")
    response = api.get("/api/sessions/")
    assert (response.status_code, response["Content-Type"], response.json()["code"]) == (400, "application/json", "bad_request")
    assert api.get("/admin/").status_code == 400 and api.get("/admin/")["Content-Type"].startswith("text/html")


def test_an_uncaught_error_under_api_is_json_500(rf):
    from hermes_sessions.api import handlers

    response = handlers.server_error(rf.get("/api/sessions/"))
    assert (response.status_code, json.loads(response.content)["code"]) == (500, "server_error")
    assert handlers.server_error(rf.get("/admin/"))["Content-Type"].startswith("text/html")


def test_nul_in_an_api_url_is_json_400(client):
    response = client.get("/api/sessions/?page=%00")
    assert response.status_code == 400
    assert response.json()["code"] == "bad_request"


# --- what a reader looks for first: the turns list, the API root, the landing page -----------------------


def test_a_sessions_turns_are_listed_newest_first_and_paged(client, session, schema):
    turns = [TurnFactory(session=session, seq=seq) for seq in (1, 2, 3)]
    TurnFactory(session=SessionFactory(owner=UserFactory()), seq=1)  # another user's: never listed
    first = client.get(f"/api/sessions/{session.id}/turns/?page_size=2")
    assert first.status_code == 200
    assert_documented(schema, "/api/sessions/{session_id}/turns/", "GET", first)
    body = first.json()
    assert body["count"] == 3 and [t["id"] for t in body["results"]] == [str(turns[2].id), str(turns[1].id)]
    second = client.get(body["next"])
    assert [t["seq"] for t in second.json()["results"]] == [1] and second.json()["next"] is None


def test_posting_a_turn_still_works_on_the_listed_path(client, session):
    assert client.post(f"/api/sessions/{session.id}/turns/", {"input": "hello"}, format="json").status_code == 202
    assert [t["input"] for t in client.get(f"/api/sessions/{session.id}/turns/").json()["results"]] == ["hello"]


def test_the_api_root_lists_every_route_of_the_schema_to_anyone(schema):
    response = APIClient().get("/api/")
    assert response.status_code == 200
    assert_documented(schema, "/api/", "GET", response)
    body = response.json()
    assert body["schema"] == "http://testserver/api/schema/" and body["docs"] == "http://testserver/api/docs/"
    listed = {(route["path"], method) for route in body["routes"] for method in route["methods"]}
    documented = {(path, method.upper()) for path, item in schema["paths"].items() for method in item if path != "/api/"}
    assert listed == documented
    assert all(route["summary"] for route in body["routes"])


def test_every_route_summary_of_the_api_root_is_one_plain_complete_sentence():
    """Each listed summary is the view's whole first docstring line: a sentence (capital first,
    full stop last), no rST backticks, not cut mid-sentence (the next docstring line is blank)."""
    from hermes_sessions.api import urls

    docs = {}
    for pattern in urls.urlpatterns:
        view = getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None) or pattern.callback
        docs[pattern.callback] = (view.__doc__ or "").strip().splitlines()
    for route in APIClient().get("/api/").json()["routes"]:
        summary = route["summary"]
        assert summary[:1].isupper() and summary.endswith("."), route
        assert "`" not in summary and "``" not in summary and len(summary) <= 120, route
    for lines in docs.values():
        assert len(lines) == 1 or lines[1].strip() == "", lines[:2]


def test_the_landing_page_links_the_api_its_docs_and_the_admin():
    response = APIClient().get("/")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    for href in ('href="/api/"', 'href="/api/docs/"', 'href="/api/schema/"', 'href="/admin/"'):
        assert href in html


def test_the_admins_view_site_link_is_the_landing_page(admin_client):
    index = admin_client.get("/admin/")
    assert index.status_code == 200 and 'href="/"' in index.content.decode()
    assert admin_client.get("/").status_code == 200


def test_notices_list_matches_the_schema(client, session, schema):
    NoticeFactory(session=session)
    response = client.get(f"/api/sessions/{session.id}/notices/")
    assert response.status_code == 200 and response.json()["count"] == 1
    assert_documented(schema, "/api/sessions/{session_id}/notices/", "GET", response)
