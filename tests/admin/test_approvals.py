"""Admin: the pending-approvals count on the index, the pending list, the approval's page and the session
page's waiting section, and deciding from them through ``services.approval_decide`` — a refused decision
is an error message and changes nothing; only staff see the approvals, whoever owns the session."""
from __future__ import annotations

from urllib.parse import urlencode

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.urls import reverse

from hermes_sessions.models import Approval, TurnEvent
from tests.factories import ApprovalFactory, SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db

INDEX_URL = reverse("admin:index")
LIST_URL = reverse("admin:hermes_sessions_approval_changelist")
PENDING_URL = LIST_URL + "?status__exact=pending"


def decide_url(approval: Approval) -> str:
    return reverse("admin:hermes_sessions_approval_decide", args=[quote(str(approval.pk))])


def approval_url(approval: Approval) -> str:
    return reverse("admin:hermes_sessions_approval_change", args=[quote(str(approval.pk))])


def session_url(session_id: str) -> str:
    return reverse("admin:hermes_sessions_session_change", args=[quote(session_id)])


def waiting(*, session=None, command: str = "touch approved.txt", cwd: str = "/work/s1", **kwargs) -> Approval:
    """A pending command approval of a running turn (its claim's attempt), as the worker records one."""
    turn = TurnFactory(status="running", attempt=1, **({"session": session} if session else {}))
    return ApprovalFactory(turn=turn, attempt=1, request={"method": "item/commandExecution/requestApproval",
                                                          "command": command, "cwd": cwd}, **kwargs)


def said(response) -> list[tuple[str, str]]:
    return [(m.level_tag, str(m)) for m in get_messages(response.wsgi_request)]


def test_index_counts_pending_approvals_and_links_to_the_pending_list(admin_client):
    waiting()
    waiting()
    waiting(status=Approval.Status.ACCEPTED, decision="accept")
    html = admin_client.get(INDEX_URL).content.decode()
    assert 'id="pending-approval-count">2</strong>' in html
    assert f'href="{PENDING_URL}" id="pending-approvals-link"' in html


def test_pending_list_shows_command_cwd_and_only_the_offered_decisions(admin_client):
    pending = waiting(command="rm -rf build", cwd="/work/sess-a", available_decisions=["accept", "decline"])
    decided = waiting(command="echo done", status=Approval.Status.DECLINED, decision="decline")
    response = admin_client.get(PENDING_URL)
    assert response.status_code == 200
    assert [a.pk for a in response.context["cl"].result_list] == [pending.pk]
    html = response.content.decode()
    assert "rm -rf build  (in /work/sess-a)" in html and "echo done" not in html
    assert f'formaction="{decide_url(pending)}?next=' in html
    assert 'value="accept" class="approval-decision decision-accept"' in html
    assert 'value="decline"' in html
    assert 'value="acceptForSession"' not in html and 'value="cancel"' not in html
    # A decided one has no buttons on its page, only what was decided.
    page = admin_client.get(approval_url(decided)).content.decode()
    assert 'class="approval-decide"' not in page and 'id="approval-outcome"' in page


def test_accept_from_the_list_decides_through_the_service_and_says_so(admin_client, admin_user):
    approval = waiting()
    response = admin_client.post(f"{decide_url(approval)}?{urlencode({'next': PENDING_URL})}", {"decision": "accept"})
    assert response.status_code == 302 and response["Location"] == PENDING_URL
    assert said(response) == [("success", "Approval accepted (accept): touch approved.txt  (in /work/s1)")]
    approval.refresh_from_db()
    assert (approval.status, approval.decision, approval.decided_by) == ("accepted", "accept", admin_user)
    assert TurnEvent.objects.filter(turn=approval.turn, kind="approval.resolved").count() == 1
    assert 'id="pending-approval-count">0</strong>' in admin_client.get(INDEX_URL).content.decode()


def test_a_decision_on_an_approval_already_decided_is_an_error_message_and_changes_nothing(admin_client, admin_user):
    approval = waiting()
    first = admin_client.post(decide_url(approval), {"decision": "decline", "next": approval_url(approval)})
    assert said(first) == [("success", "Approval declined (decline): touch approved.txt  (in /work/s1)")]
    admin_client.get(first["Location"])  # the page shows (and so consumes) that message
    again = admin_client.post(decide_url(approval), {"decision": "accept", "next": approval_url(approval)})
    assert again.status_code == 302 and again["Location"] == approval_url(approval)
    assert said(again) == [("error", "Approval not decided: approval already declined.")]
    approval.refresh_from_db()
    assert (approval.status, approval.decision) == ("declined", "decline")
    assert TurnEvent.objects.filter(turn=approval.turn, kind="approval.resolved").count() == 1


@pytest.mark.parametrize(("decision", "why"), [
    ("cancel", "decision 'cancel' is not offered for this approval; offered: accept, acceptForSession, decline"),
    ("x" * 500, f"decision '{'x' * 64}' is not offered for this approval; offered: accept, acceptForSession, decline"),
])
def test_a_decision_not_offered_is_refused_with_the_services_reason(admin_client, decision, why):
    approval = waiting()
    response = admin_client.post(decide_url(approval), {"decision": decision})
    assert said(response) == [("error", f"Approval not decided: {why}.")]
    approval.refresh_from_db()
    assert approval.is_pending


def test_a_decision_after_the_turn_ended_is_refused(admin_client):
    approval = waiting()
    approval.turn.status = "succeeded"
    approval.turn.save(update_fields=["status"])
    response = admin_client.post(decide_url(approval), {"decision": "accept"})
    assert said(response)[0][0] == "error" and "the turn that asked no longer runs" in said(response)[0][1]
    approval.refresh_from_db()
    assert approval.is_pending


@pytest.mark.parametrize("object_id", ["not-a-uuid", "00000000-0000-0000-0000-000000000000"])
def test_an_unknown_approval_is_a_message_never_a_500(admin_client, object_id):
    url = reverse("admin:hermes_sessions_approval_decide", args=[object_id])
    response = admin_client.post(url, {"decision": "accept"})
    assert response.status_code == 302 and response["Location"] == PENDING_URL
    assert said(response) == [("error", f"No approval with id {object_id!r}.")]
    assert admin_client.get(url).status_code == 405
    page = admin_client.get(reverse("admin:hermes_sessions_approval_change", args=[object_id]))
    assert page.status_code == 302  # Django's admin: "… doesn't exist. Perhaps it was deleted?"


def test_no_decision_and_a_foreign_next_are_handled(admin_client):
    approval = waiting()
    response = admin_client.post(decide_url(approval), {"next": "https://elsewhere.example/"})
    assert response["Location"] == approval_url(approval)
    assert said(response) == [("error", "No decision given: press one of the approval's buttons.")]


def test_session_page_shows_what_its_turn_waits_for_and_decides_back_to_the_page(admin_client):
    session = SessionFactory(id="sess-waits")
    approval = waiting(session=session, command="make deploy", cwd="/work/sess-waits")
    html = admin_client.get(session_url(session.id)).content.decode()
    assert f'id="approval-{approval.pk}"' in html
    assert '<dd class="approval-command"><code>make deploy</code></dd>' in html
    assert '<dd class="approval-cwd"><code>/work/sess-waits</code></dd>' in html
    assert f'action="{decide_url(approval)}"' in html and 'value="acceptForSession"' in html
    response = admin_client.post(decide_url(approval), {"decision": "acceptForSession", "next": session_url(session.id)})
    assert response["Location"] == session_url(session.id)
    approval.refresh_from_db()
    assert (approval.status, approval.decision) == ("accepted", "acceptForSession")
    assert 'id="session-approvals"' not in admin_client.get(session_url(session.id)).content.decode()


def test_a_file_change_shows_its_diff(admin_client):
    turn = TurnFactory(status="running")
    approval = ApprovalFactory(turn=turn, kind=Approval.Kind.FILE_CHANGE, request={
        "method": "item/fileChange/requestApproval", "reason": "", "grant_root": "",
        "changes": [{"path": "/work/s/patched.txt", "kind": "add", "diff": "+hello <patch>\n"}]})
    html = admin_client.get(approval_url(approval)).content.decode()
    assert '<code class="approval-path">/work/s/patched.txt</code> (add)' in html
    assert '<pre class="approval-diff">+hello &lt;patch&gt;\n</pre>' in html
    assert "change /work/s/patched.txt" in admin_client.get(PENDING_URL).content.decode()


def test_questions_need_an_answer_to_accept(admin_client):
    turn = TurnFactory(status="running")
    approval = ApprovalFactory(turn=turn, kind=Approval.Kind.USER_INPUT, available_decisions=["accept", "decline"],
                               request={"method": "item/tool/requestUserInput", "questions": [
                                   {"id": "q1", "header": "Go", "question": "Shall I go on?",
                                    "options": [{"label": "yes"}, {"label": "no"}]}]})
    page = admin_client.get(approval_url(approval)).content.decode()
    assert 'name="answer-q1"' in page and '<option value="yes">' in page
    listed = admin_client.get(PENDING_URL).content.decode()
    assert 'class="approval-answer-link"' in listed and 'value="accept"' not in listed
    unanswered = admin_client.post(decide_url(approval), {"decision": "accept", "answer-q1": "  "})
    assert said(unanswered)[0][0] == "error" and "missing ['q1']" in said(unanswered)[0][1]
    approval.refresh_from_db()
    assert approval.is_pending
    admin_client.post(decide_url(approval), {"decision": "accept", "answer-q1": "yes"})
    approval.refresh_from_db()
    assert (approval.status, approval.response) == ("accepted", {"answers": {"q1": ["yes"]}})


def test_approvals_of_any_users_session_are_for_staff_only(client, admin_client):
    owner = UserFactory(username="alice-owner")
    approval = waiting(session=SessionFactory(owner=owner))
    # Staff see another user's session's approval.
    assert [a.pk for a in admin_client.get(PENDING_URL).context["cl"].result_list] == [approval.pk]
    # Its owner, not staff, gets the login page and decides nothing.
    client.force_login(owner)
    for response in (client.get(PENDING_URL), client.post(decide_url(approval), {"decision": "accept"})):
        assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))
    # Staff who may only view: the list without buttons, and a decision is refused.
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_approval"))
    client.force_login(viewer)
    html = client.get(PENDING_URL).content.decode()
    assert "touch approved.txt" in html and "approval-decision" not in html
    assert client.post(decide_url(approval), {"decision": "accept"}).status_code == 403
    approval.refresh_from_db()
    assert approval.is_pending


def test_an_exec_policy_amendment_is_offered_with_the_prefix_it_would_allow(admin_client):
    # codex 0.171.0 offers it as an object (docs/codex.md): the button names the prefix; the decision is its name.
    approval = waiting(available_decisions=["accept", "acceptForSession", "acceptWithExecpolicyAmendment", "cancel", "decline"],
                       offered=["accept", {"acceptWithExecpolicyAmendment": {"execpolicy_amendment": ["touch", "approved.txt"]}},
                                "cancel"])
    html = admin_client.get(approval_url(approval)).content.decode()
    assert ('value="acceptWithExecpolicyAmendment" class="approval-decision decision-acceptWithExecpolicyAmendment">'
            "Accept and allow commands starting “touch approved.txt”</button>") in html
    assert ">Decline and stop the turn</button>" in html and ">Accept for this session</button>" in html
