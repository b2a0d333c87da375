"""The approval lifecycle through the worker (docs/contract.md §9), on the scripted app-server: codex asks
mid-turn, the worker records a pending approval and waits; a person's decision (or the expiry, or the
turn's cancel) is what codex is answered — once, with the JSON-RPC result for its method."""
from __future__ import annotations

import json
import time

import pytest

from hermes_sessions import services
from hermes_sessions.codex.server_requests import (
    ApprovalRequest,
    Verdict,
    answer,
    approval_request,
    make_server_request_handler,
)
from hermes_sessions.models import Approval, Turn, TurnEvent
from tests.support.approvals import turn_with_person

pytestmark = pytest.mark.django_db(transaction=True)

COMMAND = {"method": "item/commandExecution/requestApproval", "params": {
    "itemId": "call_1", "command": "/bin/bash -lc 'touch approved.txt'", "cwd": "/w",
    "availableDecisions": ["accept", {"acceptWithExecpolicyAmendment": {"execpolicy_amendment": ["touch"]}}, "cancel"]}}
QUESTION = {"method": "item/tool/requestUserInput", "params": {
    "itemId": "call_q", "questions": [{"id": "q1", "header": "H", "question": "Which?", "options": [{"label": "yes"}]}]}}


@pytest.fixture(autouse=True)
def fast_clock(settings):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1


def run_deciding(run_turn_now, session, user, text, act):
    """Run the turn while a person calls ``act(approval)`` once the session's approval is pending."""
    return turn_with_person(run_turn_now, session=session, user=user, text=text, act=act, wait=10.0,
                            find_pending=lambda: Approval.objects.filter(session=session,
                                                                         status=Approval.Status.PENDING).first())


def deciding(user, decision, **extra):
    """``act`` for ``run_deciding``: ``user`` gives ``decision`` (with ``answers`` or ``content``)."""
    return lambda approval: services.approval_decide(approval_id=approval.pk, user=user, decision=decision, **extra)


def answers(scripted_codex) -> list[dict]:
    path = scripted_codex.state / "server_answers.jsonl"
    return [json.loads(line)["answer"] for line in path.read_text().splitlines()] if path.exists() else []


def asked_session(user, scripted_codex, request):
    scripted_codex.script({"turn/start": [{"server_request": request}]})
    return services.session_create(owner=user, model_config={"approval_policy": "untrusted"})


def test_an_accepted_command_is_answered_accept_and_the_turn_goes_on(user, scripted_codex, run_turn_now):
    session = asked_session(user, scripted_codex, COMMAND)
    turn = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", deciding(user, "accept"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex) == [{"id": 0, "result": {"decision": "accept"}}]
    approval = Approval.objects.get(session=session)
    assert (approval.status, approval.decided_by, approval.turn_id) == (Approval.Status.ACCEPTED, user, turn.pk)
    assert "approval_wait_ms" in turn.timings
    kinds = list(TurnEvent.objects.filter(turn=turn).values_list("kind", flat=True))
    assert kinds.index("approval.requested") < kinds.index("approval.resolved") < kinds.index("completed")


def test_an_amendment_is_answered_as_codex_offered_it(user, scripted_codex, run_turn_now):
    session = asked_session(user, scripted_codex, COMMAND)
    amend = deciding(user, "acceptWithExecpolicyAmendment")
    run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", amend)
    assert answers(scripted_codex)[0]["result"] == {
        "decision": {"acceptWithExecpolicyAmendment": {"execpolicy_amendment": ["touch"]}}}


def test_a_declined_command_is_answered_decline(user, scripted_codex, run_turn_now):
    session = asked_session(user, scripted_codex, COMMAND)
    turn = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", deciding(user, "decline"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex)[0]["result"] == {"decision": "decline"}
    assert Approval.objects.get(session=session).status == Approval.Status.DECLINED


def test_no_decision_in_time_expires_and_answers_decline(user, scripted_codex, run_turn_now, settings):
    settings.HERMES_APPROVAL_TIMEOUT_SECONDS = 0.5
    session = asked_session(user, scripted_codex, COMMAND)
    turn = run_turn_now(session=session, text="RUNCMD touch approved.txt", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex)[0]["result"] == {"decision": "decline"}
    approval = Approval.objects.get(session=session)
    assert (approval.status, approval.decision) == (Approval.Status.EXPIRED, "decline")
    assert "HERMES_APPROVAL_TIMEOUT_SECONDS" in approval.reason
    with pytest.raises(services.ApprovalClosed):
        services.approval_decide(approval_id=approval.pk, user=user, decision="accept")


def test_the_wait_for_a_person_does_not_count_against_the_turn_timeout(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_TURN_TIMEOUT = 1.0
    session = asked_session(user, scripted_codex, COMMAND)

    def late(approval):
        time.sleep(1.5)
        services.approval_decide(approval_id=approval.pk, user=user, decision="accept")

    turn = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", late)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert turn.timings["approval_wait_ms"] >= 1400


def test_cancelling_the_turn_while_pending_cancels_the_approval_and_answers_cancel(user, scripted_codex, run_turn_now):
    session = asked_session(user, scripted_codex, COMMAND)
    cancel = lambda a: services.turn_cancel(turn=Turn.objects.get(pk=a.turn_ref))  # noqa: E731
    turn = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", cancel)
    approval = Approval.objects.get(session=session)
    assert approval.status == Approval.Status.CANCELLED, approval.reason
    assert answers(scripted_codex)[0]["result"] == {"decision": "cancel"}  # codex offered it
    assert turn.is_terminal
    with pytest.raises(services.ApprovalClosed):
        services.approval_decide(approval_id=approval.pk, user=user, decision="accept")


def test_user_input_answers_reach_codex(user, scripted_codex, run_turn_now):
    session = asked_session(user, scripted_codex, QUESTION)
    turn = run_deciding(run_turn_now, session, user, "ASKUSER Which?", deciding(user, "accept", answers={"q1": ["yes"]}))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex)[0]["result"] == {"answers": {"q1": {"answers": ["yes"]}}}


def request_of(kind_method: str, params: dict) -> ApprovalRequest:
    request = approval_request(kind_method, {"threadId": "t", "turnId": "u", **params})
    assert request is not None
    return request


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(("method", "params", "verdict", "expected"), [
    # acceptForSession is hermes's grant, never codex's: a kept app-server would widen it.
    ("item/fileChange/requestApproval", {"itemId": "c"}, Verdict("acceptForSession"), {"decision": "accept"}),
    ("item/permissions/requestApproval", {"permissions": {"network": {"enabled": True}}}, Verdict("acceptForSession"),
     {"permissions": {"network": {"enabled": True}}, "scope": "turn"}),
    ("item/fileChange/requestApproval", {"itemId": "c"}, Verdict("bogus"), {"decision": "decline"}),
    ("item/commandExecution/requestApproval", {"availableDecisions": ["accept", "cancel"]}, Verdict("acceptForSession"),
     {"decision": "accept"}),  # not offered by codex: hermes keeps the grant, codex is told accept
    ("item/permissions/requestApproval", {"permissions": {"network": {"enabled": True}}}, Verdict("accept"),
     {"permissions": {"network": {"enabled": True}}, "scope": "turn"}),
    ("item/permissions/requestApproval", {"permissions": {"network": {"enabled": True}}}, Verdict("decline"),
     {"permissions": {}, "scope": "turn"}),
    ("mcpServer/elicitation/request", {"serverName": "s", "mode": "form", "message": "m"},
     Verdict("accept", {"content": {"x": 1}}), {"action": "accept", "content": {"x": 1}, "_meta": None}),
    ("mcpServer/elicitation/request", {"serverName": "s"}, Verdict("cancel"),
     {"action": "cancel", "content": None, "_meta": None}),
])
def test_answer_per_kind(method, params, verdict, expected):
    assert answer(request_of(method, params), verdict) == expected


@pytest.mark.django_db(transaction=False)
def test_without_a_person_every_answer_fails_closed():
    handle = make_server_request_handler(approval_policy="untrusted", ask=lambda request: None)
    assert handle(COMMAND["method"], COMMAND["params"]) == {"decision": "decline"}
    with pytest.raises(LookupError):
        handle(QUESTION["method"], QUESTION["params"])


@pytest.mark.django_db(transaction=False)
def test_the_fingerprint_names_the_same_command_in_the_same_directory():
    one = request_of(COMMAND["method"], COMMAND["params"])
    same = request_of(COMMAND["method"], {**COMMAND["params"], "itemId": "call_2"})
    elsewhere = request_of(COMMAND["method"], {**COMMAND["params"], "cwd": "/other"})
    assert one.fingerprint() == same.fingerprint() != elsewhere.fingerprint()
