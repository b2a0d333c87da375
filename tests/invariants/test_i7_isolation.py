"""I7 — isolation: a user sees and drives only their own sessions (another user's are 404, and
nothing is written through them); each session's codex runs in its own work directory."""
from __future__ import annotations

import json
import tomllib

import pytest
from rest_framework.test import APIClient

from hermes_sessions import selectors
from hermes_sessions.models import Message, Notice, Session, Turn
from tests.factories import MessageFactory, NoticeFactory, SessionFactory, TurnFactory, UserFactory
from tests.support.dispatch import hold_dispatches


@pytest.fixture
def mallory():
    client = APIClient()
    client.force_authenticate(UserFactory(username="mallory"))
    return client


@pytest.fixture
def alices():
    """Alice's session with a transcript row, a notice and a queued turn."""
    session = SessionFactory(owner=UserFactory(username="alice"), id="sess-alice", last_turn_seq=1, last_message_seq=1)
    MessageFactory(session=session, seq=1, content="alice's secret")
    NoticeFactory(session=session)
    turn = TurnFactory(session=session, seq=1, status=Turn.Status.QUEUED)
    return session, turn


@pytest.mark.django_db
def test_another_users_session_is_404_everywhere_and_cannot_be_driven(mallory, alices, monkeypatch):
    sent = hold_dispatches(monkeypatch)
    session, turn = alices
    for path in (f"/api/sessions/{session.id}/", f"/api/sessions/{session.id}/messages/",
                 f"/api/sessions/{session.id}/notices/", f"/api/turns/{turn.id}/"):
        response = mallory.get(path)
        assert response.status_code == 404, path
        assert "secret" not in response.content.decode()
    assert mallory.get("/api/sessions/").json()["results"] == []

    posted = mallory.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                          content_type="application/json")
    cancelled = mallory.post(f"/api/turns/{turn.id}/cancel/")
    assert (posted.status_code, cancelled.status_code) == (404, 404)

    assert list(Turn.objects.filter(session=session).values_list("seq", "status")) == [(1, "queued")]
    assert Turn.objects.get(pk=turn.pk).cancel_requested_at is None
    assert Message.objects.filter(session=session).count() == 1
    assert Notice.objects.filter(session=session).count() == 1
    assert sent == []


@pytest.mark.django_db
def test_the_plain_session_lookups_find_only_the_owners_session(alices):
    """``selectors.session_owned`` (a session's turns, transcript, notices, a new turn) and
    ``session_is_owned`` (opening its event stream): another user's session is not found, like an
    unknown or malformed id."""
    session, _ = alices
    mallory = UserFactory(username="mallory")
    assert selectors.session_owned(user=session.owner, session_id=session.id) == session
    assert selectors.session_is_owned(user=session.owner, session_id=session.id)
    for session_id in (session.id, "sess-nobody", "not a session id\x00"):
        with pytest.raises(Session.DoesNotExist):
            selectors.session_owned(user=mallory, session_id=session_id)
        assert not selectors.session_is_owned(user=mallory, session_id=session_id)


@pytest.mark.django_db
def test_the_owner_does_see_and_drive_it(alices, monkeypatch):
    """The control for the test above: the same requests by the owner succeed."""
    hold_dispatches(monkeypatch)
    session, turn = alices
    owner = APIClient()
    owner.force_authenticate(session.owner)
    assert owner.get(f"/api/sessions/{session.id}/").status_code == 200
    assert owner.get(f"/api/turns/{turn.id}/").status_code == 200
    assert "alice's secret" in owner.get(f"/api/sessions/{session.id}/messages/").content.decode()
    assert owner.post(f"/api/sessions/{session.id}/turns/", data=json.dumps({"input": "hi"}),
                      content_type="application/json").status_code == 202


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(30)
def test_each_session_runs_codex_in_its_own_directory_and_may_write_only_there(user, scripted_codex, run_turn_now):
    from hermes_sessions import services

    one = services.session_create(owner=user, model_config={"sandbox": "workspace-write"})
    two = services.session_create(owner=user, model_config={"sandbox": "workspace-write"})
    for session in (one, two):
        assert run_turn_now(session=session, text="hello", user=user).status == Turn.Status.SUCCEEDED

    starts = [c["params"] for c in scripted_codex.calls() if c["method"] == "turn/start"]
    cwds = [p["cwd"] for p in starts]
    assert len(set(cwds)) == 2
    assert cwds[0].endswith(one.id) and cwds[1].endswith(two.id)
    assert not cwds[1].startswith(cwds[0] + "/") and not cwds[0].startswith(cwds[1] + "/")
    # The sandbox is the app-server's permission profile (docs/codex.md §10): the only writable path
    # it names is the session's own directory; no legacy sandbox field rides on the requests.
    for params, argv in zip(starts, scripted_codex.argvs(), strict=True):
        assert "sandboxPolicy" not in params
        assert 'default_permissions="hermes-workspace-write"' in argv
        table = next(a for a in argv if a.startswith("permissions.hermes-workspace-write.filesystem="))
        writable = [k for k, v in tomllib.loads("t = " + table.split("=", 1)[1])["t"].items() if v == "write"]
        assert writable == [params["cwd"]]
