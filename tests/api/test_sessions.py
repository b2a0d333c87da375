"""REST API: creating, listing and reading sessions; isolation between users; error mapping."""
from __future__ import annotations

import json

import pytest
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from hermes_sessions.models import Session
from tests.factories import CodexBindingFactory, NoticeFactory, SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db

LIST_URL = "/api/sessions/"


def post_json(client, url, body):
    return client.post(url, data=json.dumps(body), content_type="application/json")


def test_unauthenticated_requests_are_refused():
    anonymous = APIClient()
    session = SessionFactory()
    for url in (LIST_URL, f"/api/sessions/{session.id}/", f"/api/sessions/{session.id}/messages/"):
        assert anonymous.get(url).status_code in (401, 403)
    assert anonymous.post(LIST_URL, {"title": "x"}, format="json").status_code in (401, 403)
    assert not Session.objects.exclude(pk=session.pk).exists()


def test_token_authentication_works(user):
    token = Token.objects.create(user=user)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert api.get(LIST_URL).status_code == 200


def test_create_session_with_chosen_id(client, user):
    response = post_json(client, LIST_URL, {"id": "sess-codex-restart", "title": "Restart demo"})
    assert response.status_code == 201, response.content
    assert response.json()["id"] == "sess-codex-restart"
    assert response.json()["codex_thread_id"] is None
    session = Session.objects.get(pk="sess-codex-restart")
    assert session.owner == user
    assert session.title == "Restart demo"


def test_create_session_without_id_generates_one(client):
    response = post_json(client, LIST_URL, {})
    assert response.status_code == 201, response.content
    assert response.json()["id"].startswith("sess-")


def test_duplicate_session_id_is_409_even_when_another_user_owns_it(client):
    SessionFactory(id="taken-id")
    response = post_json(client, LIST_URL, {"id": "taken-id"})
    assert response.status_code == 409
    body = response.json()
    assert "taken" in body["detail"]
    assert body["code"] == "session_id_taken"


# Session ids are one namespace for all users (docs/contract.md §9 "Session ids"): a taken id cannot be
# created again, so the answer to it necessarily tells that it is taken — and must tell nothing more.

def _answer(response, session_id: str) -> tuple[int, dict[str, str], str]:
    """Status, headers (without ``Date``) and body, with the id itself masked."""
    headers = {name: value for name, value in response.headers.items() if name.lower() != "date"}
    return response.status_code, headers, response.content.decode().replace(session_id, "<id>")


@pytest.mark.parametrize("key", [None, "fresh-key"])
def test_a_taken_id_gets_the_same_409_whether_it_is_yours_or_anothers(client, user, key):
    """Nothing beyond "taken": not whose, not that it exists among yours."""
    SessionFactory(id="taken-mine", owner=user)
    SessionFactory(id="taken-them", title="secret")
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    answers = [_answer(client.post(LIST_URL, data=json.dumps({"id": sid}), content_type="application/json", **extra),
                       sid) for sid in ("taken-mine", "taken-them")]
    assert answers[0] == answers[1]
    assert answers[0][0] == 409 and json.loads(answers[0][2]) == {
        "detail": "session id '<id>' is already taken", "code": "session_id_taken", "field": "id"}
    assert Session.objects.get(pk="taken-them").title == "secret"


def test_a_replayed_key_whose_session_id_now_belongs_to_another_user_is_409_not_their_session(client, user):
    """The failing input: user A creates ``reused-id`` with an Idempotency-Key; an operator deletes the
    session (``prune_sessions``); user B creates ``reused-id``; A repeats the request with the key. The
    replay loaded the session by id alone (B's) and answered 500 when the owner check refused it. Now the
    key's session is looked up among A's only: it is gone, so the key is spent, the request runs again
    and gets the 409 any taken id gets."""
    body = {"id": "reused-id", "title": "mine"}
    first = client.post(LIST_URL, data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert first.status_code == 201
    Session.objects.filter(pk="reused-id").delete()
    SessionFactory(id="reused-id", title="theirs")
    again = client.post(LIST_URL, data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert (again.status_code, again.json()["code"]) == (409, "session_id_taken")
    assert "theirs" not in again.content.decode()
    assert Session.objects.get(pk="reused-id").title == "theirs"


@pytest.mark.parametrize("bad_id", ["bad id", "-leading-dash", "x" * 65, "abc\n", "a/b", "a\u0000b", 42, ["a"]])
def test_malformed_session_id_is_400(client, bad_id):
    response = post_json(client, LIST_URL, {"id": bad_id})
    assert response.status_code == 400, response.content
    assert response.json()["detail"]
    assert not Session.objects.exists()


def test_session_ids_with_dots_and_colons_route(client):
    assert post_json(client, LIST_URL, {"id": "a.b:c"}).status_code == 201
    assert client.get("/api/sessions/a.b:c/").json()["id"] == "a.b:c"
    assert client.get("/api/sessions/a.b:c/messages/").status_code == 200
    assert client.get("/api/sessions/a.b:c/notices/").status_code == 200
    assert reverse("api:session-detail", kwargs={"session_id": "a.b:c"}) == "/api/sessions/a.b:c/"


def test_staff_only_sandbox_is_403_for_a_regular_user(client):
    response = post_json(client, LIST_URL, {"model_config": {"sandbox": "danger-full-access"}})
    assert response.status_code == 403
    assert "staff" in response.json()["detail"]
    assert response.json()["field"] == "model_config.sandbox"
    assert not Session.objects.exists()


def test_staff_may_choose_the_staff_only_sandbox():
    staff = UserFactory(is_staff=True)
    api = APIClient()
    api.force_authenticate(staff)
    response = post_json(api, LIST_URL, {"model_config": {"sandbox": "danger-full-access"}})
    assert response.status_code == 201, response.content
    assert response.json()["model_config"] == {"sandbox": "danger-full-access"}


def test_a_client_cannot_choose_the_working_directory(client):
    response = post_json(client, LIST_URL, {"model_config": {"cwd": "/etc"}})
    assert response.status_code == 403
    assert response.json()["field"] == "model_config.cwd"
    assert not Session.objects.exists()


@pytest.mark.parametrize(
    "config",
    [{"temperature": 2}, {"sandbox": "everything"}, {"approval_policy": "always"}, {"model": ""},
     {"auto_approve": True}, {"approvals": "accept"}],
)
def test_model_config_outside_policy_is_400(client, config):
    response = post_json(client, LIST_URL, {"model_config": config})
    assert response.status_code == 400, response.content
    assert response.json()["detail"]
    assert not Session.objects.exists()


def test_model_config_must_be_an_object(client):
    assert post_json(client, LIST_URL, {"model_config": ["sandbox"]}).status_code == 400


def test_model_config_is_stored_cleaned(client):
    config = {"model": "gpt-5", "sandbox": "workspace-write", "approval_policy": "never"}
    response = post_json(client, LIST_URL, {"id": "cfg", "model_config": config})
    assert response.status_code == 201
    assert Session.objects.get(pk="cfg").model_config == config


def test_list_shows_only_own_sessions_with_counts(client, user):
    mine = SessionFactory(owner=user)
    SessionFactory()  # someone else's
    TurnFactory(session=mine, seq=1)
    TurnFactory(session=mine, seq=2)
    binding = CodexBindingFactory(session=mine)
    CodexBindingFactory(session=mine, status="ended")
    NoticeFactory(session=mine)
    response = client.get(LIST_URL)
    assert response.status_code == 200
    rows = response.json()["results"]
    assert [row["id"] for row in rows] == [mine.id]
    assert rows[0]["codex_thread_id"] == binding.thread_id
    assert rows[0]["turn_count"] == 2
    assert rows[0]["unacknowledged_notice_count"] == 1


def test_list_costs_the_same_queries_for_many_sessions(client, user, django_assert_max_num_queries):
    for _ in range(6):
        session = SessionFactory(owner=user)
        TurnFactory(session=session, seq=1)
        NoticeFactory(session=session)
        CodexBindingFactory(session=session)
    with django_assert_max_num_queries(3):  # auth is forced; count + page
        assert len(client.get(LIST_URL).json()["results"]) == 6


def test_detail_of_another_users_session_is_404(client):
    other = SessionFactory()
    response = client.get(f"/api/sessions/{other.id}/")
    assert response.status_code == 404
    assert response.json()["detail"]


@pytest.mark.parametrize("path", ["/api/sessions/nope/", "/api/sessions/a%0A/", "/api/sessions/" + "x" * 300 + "/"])
def test_unknown_or_malformed_session_id_is_json_404(client, path):
    response = client.get(path)
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")


def test_nul_in_a_session_url_is_400(client):
    assert client.get("/api/sessions/%00/").status_code == 400


def test_detail_shows_fields(client, user):
    session = SessionFactory(owner=user, title="T", model_config={"model": "m"})
    binding = CodexBindingFactory(session=session)
    body = client.get(f"/api/sessions/{session.id}/").json()
    assert body["id"] == session.id
    assert body["title"] == "T"
    assert body["model_config"] == {"model": "m"}
    assert body["codex_thread_id"] == binding.thread_id
    for key in ("created_at", "updated_at", "last_activity", "turn_count", "unacknowledged_notice_count"):
        assert key in body
