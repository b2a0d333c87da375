"""Admin operations: create a session, run and cancel turns, acknowledge notices from the session
page, the notice count on the index, the notices filter, and what the turns list shows."""
from __future__ import annotations

import uuid
from datetime import timedelta
from html import unescape

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone

from hermes_sessions.models import Notice, Session, Turn
from tests.factories import NoticeFactory, SessionFactory, TurnFactory, UserFactory
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db

ADD_URL = reverse("admin:hermes_sessions_session_add")


def page(session_id: str) -> str:
    return reverse("admin:hermes_sessions_session_change", args=[quote(session_id)])


def action_url(name: str, session_id: str) -> str:
    return reverse(f"admin:hermes_sessions_session_{name}", args=[quote(session_id)])


@pytest.fixture
def dispatched(monkeypatch):
    return hold_dispatches(monkeypatch)


def test_admin_creates_a_session_through_the_service(admin_client, admin_user):
    owner = UserFactory()
    response = admin_client.post(ADD_URL, {
        "id": "ops.made:1", "owner": owner.pk, "title": "made in admin",
        "model_config": '{"model": "gpt-5.5", "sandbox": "read-only"}',
    })
    assert response.status_code == 302
    assert response["Location"] == page("ops.made:1")
    session = Session.objects.get(pk="ops.made:1")
    assert session.owner == owner and session.title == "made in admin"
    assert session.model_config == {"model": "gpt-5.5", "sandbox": "read-only"}
    assert admin_client.get(response["Location"]).status_code == 200


def test_admin_session_id_is_optional(admin_client, admin_user):
    response = admin_client.post(ADD_URL, {"id": "", "owner": admin_user.pk, "title": "t", "model_config": "{}"})
    assert response.status_code == 302
    assert Session.objects.get().id.startswith("sess-")


@pytest.mark.parametrize(("data", "field", "reason"), [
    ({"model_config": '{"cwd": "/etc"}'}, "model_config", "cwd"),
    ({"model_config": '{"sandbox": "danger-full-access"}'}, "model_config", "staff"),
    ({"model_config": "[1, 2]"}, "model_config", "JSON object"),
    ({"model_config": "{not json"}, "model_config", "JSON"),
    ({"id": "bad id with spaces"}, "id", "1-64 characters"),
    ({"id": "taken"}, "id", "already taken"),
])
def test_admin_create_refuses_bad_input_with_a_form_error(admin_client, data, field, reason):
    SessionFactory(id="taken")
    owner = UserFactory()  # not staff: danger-full-access is refused for them
    body = {"id": "", "owner": owner.pk, "title": "", "model_config": "{}", **data}
    response = admin_client.post(ADD_URL, body)
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert reason in " ".join(errors[field]), errors
    assert Session.objects.count() == 1


def test_run_turn_from_the_session_page_queues_it_like_the_api(admin_client, admin_user, dispatched):
    session = SessionFactory(id="ops-run")
    response = admin_client.post(action_url("run_turn", session.id), {"input": "hello from admin", "on_busy": "enqueue"},
                                 follow=True)
    assert response.status_code == 200
    turn = Turn.objects.get(session=session)
    assert (turn.status, turn.input, turn.seq, turn.created_by) == ("queued", "hello from admin", 1, admin_user)
    assert turn.dispatched_at is not None  # sent through services.dispatch after commit
    html = response.content.decode()
    assert f"Turn 1 queued ({turn.id})." in html
    assert f'<tr id="turn-1" data-turn="{turn.id}">' in html
    assert 'class="turn-status status-queued">queued<' in html
    assert '<p id="turns-in-progress">1 turn queued or running' in html


def test_run_turn_refusals_are_messages_not_errors(admin_client, dispatched):
    session = SessionFactory(id="ops-refuse")
    response = admin_client.post(action_url("run_turn", session.id), {"input": "   ", "on_busy": "enqueue"}, follow=True)
    assert "No turn queued: input: input must not be empty" in response.content.decode()
    busy = TurnFactory(session=session, seq=1, status="running")
    response = admin_client.post(action_url("run_turn", session.id), {"input": "x", "on_busy": "reject"}, follow=True)
    assert f"No turn queued: turn {busy.id} of this session is running" in response.content.decode()
    assert Turn.objects.filter(session=session).count() == 1
    assert admin_client.get(action_url("run_turn", session.id)).status_code == 405
    response = admin_client.post(action_url("run_turn", "no-such-session"), {"input": "x"}, follow=True)
    assert "No session with id" in response.content.decode()


def test_cancel_from_the_session_page(admin_client):
    session = SessionFactory(id="ops-cancel")
    running = TurnFactory(session=session, seq=1, status="running", started_at=timezone.now())
    queued = TurnFactory(session=session, seq=2)
    done = TurnFactory(session=session, seq=3, status="succeeded")
    html = admin_client.get(page(session.id)).content.decode()
    assert html.count('class="cancel-turn"') == 2  # only the unfinished ones offer it
    url = action_url("cancel_turn", session.id)
    assert "Turn 2 cancelled." in admin_client.post(url, {"turn": str(queued.id)}, follow=True).content.decode()
    assert "Turn 1 asked to stop" in admin_client.post(url, {"turn": str(running.id)}, follow=True).content.decode()
    assert "already succeeded" in admin_client.post(url, {"turn": str(done.id)}, follow=True).content.decode()
    assert "No such turn" in admin_client.post(url, {"turn": "not-a-uuid"}, follow=True).content.decode()
    assert "No such turn" in admin_client.post(url, {"turn": str(uuid.uuid4())}, follow=True).content.decode()
    queued.refresh_from_db()
    running.refresh_from_db()
    assert queued.status == "cancelled"
    assert running.status == "running" and running.cancel_requested_at is not None


def test_turns_list_cancel_action(admin_client):
    queued = TurnFactory(seq=1)
    response = admin_client.post(reverse("admin:hermes_sessions_turn_changelist"),
                                 {"action": "cancel_turns", "_selected_action": [queued.pk]}, follow=True)
    assert response.status_code == 200
    queued.refresh_from_db()
    assert queued.status == "cancelled"


def test_acknowledge_one_and_all_from_the_session_page(admin_client, admin_user):
    session = SessionFactory(id="ops-ack")
    first, second, third = (NoticeFactory(session=session, text=f"notice {n}") for n in range(3))
    elsewhere = NoticeFactory(text="another session's")
    html = admin_client.get(page(session.id)).content.decode()
    assert 'id="acknowledge-notices"' in html and html.count('class="acknowledge-notice"') == 3
    url = action_url("acknowledge", session.id)
    response = admin_client.post(url, {"notice": [str(first.pk), str(elsewhere.pk)]}, follow=True)
    assert f"No notice acknowledged: no notice {elsewhere.pk} in this session." in response.content.decode()
    assert Notice.objects.filter(acknowledged_at__isnull=True).count() == 4
    response = admin_client.post(url, {"notice": str(first.pk)}, follow=True)
    assert "Acknowledged 1 notice." in response.content.decode()
    first.refresh_from_db()
    assert first.acknowledged_by == admin_user
    response = admin_client.post(url, {}, follow=True)
    assert "Acknowledged 2 notices." in response.content.decode()
    assert 'id="session-notices"' not in response.content.decode()
    assert Notice.objects.filter(acknowledged_at__isnull=True).get() == elsewhere


@pytest.mark.parametrize(("value", "reason"), [
    ("abc", "'abc' is not a notice id"),  # a bulk action given a non-id must not acknowledge all notices
    ("", "'' is not a notice id"),
    ("-1", "'-1' is not a notice id"),
    ("\u00b2", "'\u00b2' is not a notice id"),  # str.isdigit() says yes; int() says no
    ("9" * 30, "is not a notice id"),
    ("999999", "no notice 999999 in this session"),
])
def test_acknowledge_with_a_bad_or_unknown_id_acknowledges_nothing(admin_client, value, reason):
    session = SessionFactory(id="ops-ack-bad")
    first = NoticeFactory(session=session, text="one")
    NoticeFactory(session=session, text="two")
    for posted in ([value], [str(first.pk), value]):  # alone (as the tester sent it), and beside a good id
        response = admin_client.post(action_url("acknowledge", session.id), {"notice": posted}, follow=True)
        html = unescape(response.content.decode())
        assert response.status_code == 200 and "No notice acknowledged: " in html and reason in html
        assert "Acknowledged" not in html
        assert Notice.objects.filter(acknowledged_at__isnull=True).count() == 2


def test_staff_without_rights_cannot_act(client):
    staff = UserFactory(username="viewer", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client.force_login(staff)
    session = SessionFactory(id="ops-rights")
    NoticeFactory(session=session)
    html = client.get(page(session.id)).content.decode()
    assert 'id="run-turn-form"' not in html and 'id="acknowledge-notices"' not in html
    assert client.post(action_url("run_turn", session.id), {"input": "x"}).status_code == 403
    assert client.post(action_url("acknowledge", session.id)).status_code == 403
    assert client.get(ADD_URL).status_code == 403
    assert Turn.objects.count() == 0 and Notice.objects.filter(acknowledged_at__isnull=True).count() == 1


def test_index_shows_the_unacknowledged_notice_count_and_view_links(admin_client):
    NoticeFactory()
    NoticeFactory()
    NoticeFactory(acknowledged_at=timezone.now())
    html = admin_client.get(reverse("admin:index")).content.decode()
    assert '<strong id="unacknowledged-notice-count">2</strong>' in html
    # Read-only models say "View", not "Change".
    for model in ("turn", "notice", "message", "session"):
        url = reverse(f"admin:hermes_sessions_{model}_changelist")
        row = html.split(f'href="{url}"')[-1].split("</tr>")[0]
        assert "viewlink" in row and "changelink" not in row, model


def test_sessions_list_notices_column_and_filter(admin_client):
    waiting = SessionFactory(id="ops-waiting")
    NoticeFactory(session=waiting)
    NoticeFactory(session=waiting)
    quiet = SessionFactory(id="ops-quiet")
    NoticeFactory(session=quiet, acknowledged_at=timezone.now())
    url = reverse("admin:hermes_sessions_session_changelist")
    yes = admin_client.get(url + "?unacknowledged=yes")
    assert [s.pk for s in yes.context["cl"].result_list] == ["ops-waiting"]
    assert 'class="field-unacknowledged_notices">2<' in yes.content.decode()
    no = admin_client.get(url + "?unacknowledged=no")
    assert [s.pk for s in no.context["cl"].result_list] == ["ops-quiet"]


def test_turns_list_shows_input_error_duration_and_tokens(admin_client):
    start = timezone.now() - timedelta(seconds=90)
    TurnFactory(seq=1, status="failed", input="please summarise the log", error="codex exited with 137",
                started_at=start, finished_at=start + timedelta(seconds=2.5), usage={"total_tokens": 1234})
    html = admin_client.get(reverse("admin:hermes_sessions_turn_changelist")).content.decode()
    for text in ("please summarise the log", "codex exited with 137", "2.5 s", "1234"):
        assert text in html


def test_session_page_token_totals(admin_client):
    session = SessionFactory(id="ops-tokens")
    TurnFactory(session=session, seq=1, status="succeeded", usage={"input_tokens": 100, "output_tokens": 7, "total_tokens": 107})
    TurnFactory(session=session, seq=2, status="succeeded", usage={"input_tokens": 50, "output_tokens": 3, "total_tokens": 53})
    TurnFactory(session=session, seq=3)  # queued: no usage yet
    response = admin_client.get(page(session.id))
    assert response.context["token_totals"] == {"input_tokens": 150, "cached_input_tokens": 0, "output_tokens": 10,
                                                 "reasoning_output_tokens": 0, "total_tokens": 160}
    assert '<td class="token-total_tokens">160</td>' in response.content.decode()


def test_a_turn_run_from_the_admin_runs_through_the_worker_code(admin_client, scripted_codex,
                                                                 django_capture_on_commit_callbacks):
    """The admin's turn takes the API's path: the task sent after commit runs it (eagerly here, on the
    scripted app-server) and the session page then shows it succeeded, with its reply in the transcript."""
    session = SessionFactory(id="ops-real")
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(action_url("run_turn", session.id), {"input": "hello from the admin", "on_busy": "enqueue"})
    turn = Turn.objects.get(session=session)
    assert turn.status == "succeeded", turn.error
    assert turn.thread_action == "started"
    assert [m["method"] for m in scripted_codex.calls()][:3] == ["initialize", "thread/start", "turn/start"]
    html = admin_client.get(page(session.id)).content.decode()
    assert 'class="turn-status status-succeeded">succeeded<' in html
    assert 'id="turns-in-progress"' not in html
    assert "hello from the admin" in html.split('<table id="transcript">')[1]


def test_transcript_and_turns_are_escaped(admin_client):
    from tests.factories import MessageFactory

    session = SessionFactory(id="ops-escape")
    MessageFactory(session=session, seq=1, content="<script>alert(1)</script>\nsecond line")
    TurnFactory(session=session, seq=1, input="<img src=x onerror=alert(2)>", error="<b>boom</b>")
    html = admin_client.get(page(session.id)).content.decode()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;<br>second line" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert "<b>boom</b>" not in html and "&lt;b&gt;boom&lt;/b&gt;" in html
