"""REST API of approvals (docs/contract.md §9, docs/api.md): list, read, decide — ownership, the
decisions offered, 409 for a closed one, Idempotency-Key. No codex: the rows come from the service the
worker calls (``services.approval_request``) on a claimed turn."""
from __future__ import annotations

import json
import threading
import uuid

import pytest
from django.db import connection
from rest_framework.test import APIClient

from hermes_sessions import services
from hermes_sessions.codex.server_requests import approval_request
from hermes_sessions.models import Approval, Turn, TurnEvent
from tests.factories import SessionFactory, UserFactory

pytestmark = pytest.mark.django_db

COMMAND_PARAMS = {
    "threadId": "t-1", "turnId": "ct-1", "itemId": "call_1", "command": "/bin/bash -lc 'touch approved.txt'",
    "cwd": "/w", "commandActions": [{"type": "unknown", "command": "touch approved.txt"}],
    "availableDecisions": ["accept", {"acceptWithExecpolicyAmendment": {"execpolicy_amendment": ["touch"]}}, "cancel"],
}


@pytest.fixture(autouse=True)
def _no_codex(dispatched):
    """Record dispatches instead of running codex."""


def claimed_turn(session):
    turn = services.turn_enqueue(session=session, input_text="RUNCMD touch approved.txt", user=session.owner)
    claim = services.turn_claim(turn_id=turn.id)
    assert claim is not None
    return claim


def ask(claim, *, method="item/commandExecution/requestApproval", params=None, request_id="1", timeout=900.0):
    request = approval_request(method, params or COMMAND_PARAMS)
    request.request_id = request_id
    return services.approval_request(turn_id=claim.turn_id, token=claim.token, request=request, timeout=timeout)


def decide(client, approval_id, body, **headers):
    return client.post(f"/api/approvals/{approval_id}/decision/", data=json.dumps(body),
                       content_type="application/json", **headers)


@pytest.fixture
def session(user):
    return SessionFactory(owner=user, id="sess-approvals", model_config={"approval_policy": "untrusted"})


def test_a_pending_approval_is_listed_shown_and_its_turn_waits(client, session):
    claim = claimed_turn(session)
    approval = ask(claim)
    listed = client.get(f"/api/sessions/{session.id}/approvals/?status=pending").json()["results"]
    assert [a["id"] for a in listed] == [str(approval.pk)]
    shown = client.get(f"/api/approvals/{approval.pk}/").json()
    assert shown["kind"] == "command" and shown["status"] == "pending"
    assert shown["request"]["command"] == COMMAND_PARAMS["command"] and shown["request"]["cwd"] == "/w"
    # codex's offer, plus decline (always taken) and acceptForSession (hermes keeps the session's grant).
    assert shown["available_decisions"] == ["accept", "acceptForSession", "acceptWithExecpolicyAmendment",
                                            "cancel", "decline"]
    assert shown["turn"] == str(claim.turn_id) and shown["decided_by"] is None
    assert client.get(f"/api/turns/{claim.turn_id}/").json()["waiting_for_approval"] is True
    listed_turn = client.get(f"/api/sessions/{session.id}/turns/").json()["results"][0]
    assert listed_turn["waiting_for_approval"] is True
    kinds = list(TurnEvent.objects.filter(turn_id=claim.turn_id).values_list("kind", flat=True))
    assert kinds[-1] == "approval.requested"


def test_accept_decides_once_and_a_second_decision_is_409(client, session, user):
    claim = claimed_turn(session)
    approval = ask(claim)
    first = decide(client, approval.pk, {"decision": "accept"})
    assert first.status_code == 200, first.content
    assert (first.json()["status"], first.json()["decision"], first.json()["decided_by"]) == (
        "accepted", "accept", user.username)
    second = decide(client, approval.pk, {"decision": "decline"})
    assert second.status_code == 409 and second.json()["code"] == "approval_closed"
    assert second.json()["approval"]["status"] == "accepted"
    assert client.get(f"/api/turns/{claim.turn_id}/").json()["waiting_for_approval"] is False
    resolved = TurnEvent.objects.filter(turn_id=claim.turn_id, kind="approval.resolved")
    assert [e.data["decision"] for e in resolved] == ["accept"]


def test_a_decision_not_offered_is_400_listing_the_offered_ones(client, session):
    approval = ask(claimed_turn(session))
    response = decide(client, approval.pk, {"decision": "applyNetworkPolicyAmendment"})
    assert response.status_code == 400 and response.json()["code"] == "invalid_decision"
    assert "accept" in response.json()["available_decisions"]
    assert decide(client, approval.pk, {"decision": "yes please"}).status_code == 400  # not a decision at all
    assert decide(client, approval.pk, {}).status_code == 400
    assert Approval.objects.get(pk=approval.pk).status == Approval.Status.PENDING


def test_another_users_approval_is_404_and_unknown_ids_too(session):
    approval = ask(claimed_turn(session))
    other = APIClient()
    other.force_authenticate(UserFactory())
    assert other.get(f"/api/approvals/{approval.pk}/").status_code == 404
    assert decide(other, approval.pk, {"decision": "accept"}).status_code == 404
    assert other.get(f"/api/sessions/{session.id}/approvals/").status_code == 404
    assert other.get("/api/approvals/not-a-uuid/").status_code == 404
    assert other.get(f"/api/approvals/{uuid.uuid4()}/").status_code == 404
    assert Approval.objects.get(pk=approval.pk).status == Approval.Status.PENDING


def test_an_unknown_status_filter_is_400(client, session):
    response = client.get(f"/api/sessions/{session.id}/approvals/?status=maybe")
    assert response.status_code == 400 and response.json()["code"] == "invalid_status"


def test_the_same_idempotency_key_returns_the_decision_instead_of_409(client, session):
    approval = ask(claimed_turn(session))
    first = decide(client, approval.pk, {"decision": "decline"}, HTTP_IDEMPOTENCY_KEY="k-1")
    again = decide(client, approval.pk, {"decision": "decline"}, HTTP_IDEMPOTENCY_KEY="k-1")
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json() == first.json() and again.json()["status"] == "declined"
    other_body = decide(client, approval.pk, {"decision": "accept"}, HTTP_IDEMPOTENCY_KEY="k-1")
    assert other_body.status_code == 422


def test_cancelling_the_turn_cancels_its_pending_approvals_and_a_late_decision_is_409(client, session):
    claim = claimed_turn(session)
    approval = ask(claim)
    assert client.post(f"/api/turns/{claim.turn_id}/cancel/").status_code == 202
    closed = Approval.objects.get(pk=approval.pk)
    assert (closed.status, closed.decision) == (Approval.Status.CANCELLED, "decline")
    late = decide(client, approval.pk, {"decision": "accept"})
    assert late.status_code == 409 and late.json()["approval"]["status"] == "cancelled"


def test_a_decision_on_a_turn_that_ended_is_409(client, session):
    claim = claimed_turn(session)
    approval = ask(claim)
    Turn.objects.filter(pk=claim.turn_id).update(status=Turn.Status.FAILED, claim_token=None)  # ended elsewhere
    response = decide(client, approval.pk, {"decision": "accept"})
    assert response.status_code == 409
    assert Approval.objects.get(pk=approval.pk).status == Approval.Status.PENDING  # not applied


def test_a_decision_on_a_turn_taken_back_after_a_lost_worker_is_kept_for_its_rerun(client, session):
    claim = claimed_turn(session)
    approval = ask(claim)
    Turn.objects.filter(pk=claim.turn_id).update(status=Turn.Status.QUEUED, claim_token=None)  # taken back
    assert client.get(f"/api/turns/{claim.turn_id}/").json()["waiting_for_approval"] is True
    response = decide(client, approval.pk, {"decision": "accept"})
    assert response.status_code == 200, response.content
    rerun = services.turn_claim(turn_id=claim.turn_id)
    assert rerun is not None and rerun.attempt == 2
    again = ask(rerun)  # codex asks the same command again
    assert again.pk == approval.pk and (again.status, again.attempt) == (Approval.Status.ACCEPTED, 2)
    assert Approval.objects.filter(turn_ref=claim.turn_id).count() == 1


def test_an_interrupting_input_closes_the_running_turns_pending_approvals(client, session):
    claim = claimed_turn(session)
    approval = ask(claim)
    posted = client.post(f"/api/sessions/{session.id}/turns/", data={"input": "stop that", "on_busy": "interrupt"},
                         format="json")
    assert posted.status_code == 202, posted.content
    closed = Approval.objects.get(pk=approval.pk)
    assert (closed.status, closed.decision) == (Approval.Status.CANCELLED, "decline")
    assert "interrupted" in closed.reason
    assert decide(client, approval.pk, {"decision": "accept"}).status_code == 409


def test_user_input_needs_an_answer_to_every_question(client, session):
    params = {"threadId": "t-1", "turnId": "ct-1", "itemId": "call_q",
              "questions": [{"id": "q1", "header": "H", "question": "Which?", "options": [{"label": "yes"}]}]}
    approval = ask(claimed_turn(session), method="item/tool/requestUserInput", params=params)
    assert approval.kind == Approval.Kind.USER_INPUT
    assert decide(client, approval.pk, {"decision": "accept"}).status_code == 400
    assert decide(client, approval.pk, {"decision": "accept", "answers": {"q2": "x"}}).status_code == 400
    assert decide(client, approval.pk, {"decision": "accept", "answers": {"q1": 5}}).status_code == 400
    ok = decide(client, approval.pk, {"decision": "accept", "answers": {"q1": "yes"}})
    assert ok.status_code == 200, ok.content
    assert ok.json()["response"] == {"answers": {"q1": ["yes"]}}


@pytest.mark.django_db(transaction=True)
def test_two_decisions_racing_one_wins_the_other_is_409(session, user):
    claim = claimed_turn(session)
    approval = ask(claim)
    results: list[int] = []
    barrier = threading.Barrier(2)

    def person(decision):
        api = APIClient()
        api.force_authenticate(user)
        barrier.wait()
        results.append(decide(api, approval.pk, {"decision": decision}).status_code)
        connection.close()

    people = [threading.Thread(target=person, args=(d,)) for d in ("accept", "decline")]
    for p in people:
        p.start()
    for p in people:
        p.join()
    assert sorted(results) == [200, 409]
    assert TurnEvent.objects.filter(turn_id=claim.turn_id, kind="approval.resolved").count() == 1


def test_accept_for_session_answers_the_same_request_later_without_a_person(client, session):
    first = ask(claimed_turn(session))
    assert decide(client, first.pk, {"decision": "acceptForSession"}).status_code == 200
    again = ask(claimed_turn_after(session, first))  # the session's next turn asks the same
    assert (again.status, again.decision) == (Approval.Status.ACCEPTED, "acceptForSession")
    assert again.decided_by is None and str(first.pk) in again.reason
    other = ask(claimed_turn_after(session, again), params={**COMMAND_PARAMS, "command": "rm -rf /"})
    assert other.status == Approval.Status.PENDING  # another command is asked


def claimed_turn_after(session, approval):
    Turn.objects.filter(pk=approval.turn_ref).update(status=Turn.Status.SUCCEEDED)
    return claimed_turn(session)


def test_a_decision_after_the_approval_expired_is_409_and_expires_it(client, session):
    # Its worker was lost, so nobody expired it at expires_at; the decision must not be applied late.
    claim = claimed_turn(session)
    approval = ask(claim, timeout=0.0)
    Turn.objects.filter(pk=claim.turn_id).update(status=Turn.Status.QUEUED, claim_token=None)  # taken back
    late = decide(client, approval.pk, {"decision": "accept"})
    assert late.status_code == 409 and late.json()["approval"]["status"] == "expired", late.content
    closed = Approval.objects.get(pk=approval.pk)
    assert (closed.status, closed.decision, closed.decided_by) == (Approval.Status.EXPIRED, "decline", None)
