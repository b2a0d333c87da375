"""Approvals with the real codex binary (0.171.0) and the model stand-in (docs/contract.md §9).

A session with ``approval_policy: untrusted`` and ``RUNCMD <cmd>`` makes codex ask
``item/commandExecution/requestApproval``; the turn runs through the real task code (eager, in-process)
while a "person" (a thread) decides through the REST API.
"""
from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
from django.db import connection
from rest_framework.test import APIClient

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.models import Approval, Message, Turn, TurnEvent
from tests.support.approvals import turn_with_person
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
UNTRUSTED = {"sandbox": "workspace-write", "approval_policy": "untrusted"}


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin):
    settings.HERMES_HEARTBEAT_SECONDS = 0.2
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        yield stand_in


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def decide(user, approval_id, decision: str, **extra) -> int:
    response = api(user).post(f"/api/approvals/{approval_id}/decision/", data=json.dumps({"decision": decision, **extra}),
                              content_type="application/json")
    return response.status_code


def run_deciding(run_turn_now, session, user, text, act, *, wait: float = 60.0) -> tuple[Turn, dict]:
    """Run the turn while a person waits until the session's approval is pending — seen through the API —
    and calls ``act(approval id)``; also returns what the API showed then (``approval``, its ``turn``)."""
    seen: dict = {}

    def pending():
        found = api(user).get(f"/api/sessions/{session.id}/approvals/?status=pending").json()["results"]
        if found:
            seen["approval"] = found[0]
            seen["turn"] = api(user).get(f"/api/turns/{found[0]['turn']}/").json()
        return found

    turn = turn_with_person(run_turn_now, session=session, user=user, text=text, wait=wait,
                            find_pending=pending, act=lambda found: act(found[0]["id"]))
    return turn, seen


def workdir(settings, session) -> Path:
    return Path(settings.CODEX_WORK_ROOT) / session.id


def tool_text(turn) -> str:
    return "\n".join(Message.objects.filter(turn=turn, role="tool").values_list("content", flat=True))


def test_accept_runs_the_command_and_its_output_is_in_the_transcript(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    mark = f"ran-{uuid.uuid4().hex[:8]}"
    turn, seen = run_deciding(run_turn_now, session, user, f"RUNCMD touch approved.txt && echo {mark}",
        lambda a: decide(user, a, "accept"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert seen["approval"]["kind"] == "command" and "touch approved.txt" in seen["approval"]["request"]["command"]
    assert "accept" in seen["approval"]["available_decisions"] and "decline" in seen["approval"]["available_decisions"]
    assert seen["turn"]["waiting_for_approval"] is True
    assert (workdir(settings, session) / "approved.txt").exists()
    assert mark in tool_text(turn)
    kinds = list(TurnEvent.objects.filter(turn=turn).values_list("kind", flat=True))
    assert "approval.requested" in kinds and "approval.resolved" in kinds
    assert Approval.objects.get(session=session).status == Approval.Status.ACCEPTED


def test_decline_ends_the_item_declined_and_the_turn_completes(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    turn, _ = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt",
        lambda a: decide(user, a, "decline"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert not (workdir(settings, session) / "approved.txt").exists()
    assert "declined" in tool_text(turn).lower() or "rejected" in turn.final_text.lower()
    assert Approval.objects.get(session=session).status == Approval.Status.DECLINED


def test_an_approval_nobody_decides_expires_and_the_command_does_not_run(user, real_codex, run_turn_now, settings):
    settings.HERMES_APPROVAL_TIMEOUT_SECONDS = 1.5
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    turn = run_turn_now(session=session, text="RUNCMD touch approved.txt", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert not (workdir(settings, session) / "approved.txt").exists()
    approval = Approval.objects.get(session=session)
    assert approval.status == Approval.Status.EXPIRED
    assert decide(user, approval.pk, "accept") == 409


def test_cancel_while_pending_cancels_turn_and_approval_and_a_late_accept_is_409(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    late: list[int] = []

    def cancel_then_accept(approval_id):
        assert api(user).post(f"/api/turns/{Approval.objects.get(pk=approval_id).turn_ref}/cancel/").status_code == 202
        late.append(decide(user, approval_id, "accept"))

    turn, _ = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", cancel_then_accept)
    assert late == [409]
    assert turn.status == Turn.Status.CANCELLED, turn.error
    assert Approval.objects.get(session=session).status == Approval.Status.CANCELLED
    assert not (workdir(settings, session) / "approved.txt").exists()


def test_two_decisions_racing_one_wins_and_the_other_is_409(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    codes: list[int] = []

    def race(approval_id):
        gate = threading.Barrier(2)

        def one(decision):
            gate.wait()
            codes.append(decide(user, approval_id, decision))
            connection.close()

        racers = [threading.Thread(target=one, args=(d,)) for d in ("accept", "decline")]
        for r in racers:
            r.start()
        for r in racers:
            r.join()

    turn, _ = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt", race)
    assert sorted(codes) == [200, 409]
    approval = Approval.objects.get(session=session)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    # codex did what the winning decision says, and only that.
    assert (workdir(settings, session) / "approved.txt").exists() == (approval.status == Approval.Status.ACCEPTED)


def test_accept_for_session_answers_the_next_identical_request_without_asking(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    first, _ = run_deciding(run_turn_now, session, user, "RUNCMD touch approved.txt",
        lambda a: decide(user, a, "acceptForSession"))
    assert first.status == Turn.Status.SUCCEEDED, first.error
    (workdir(settings, session) / "approved.txt").unlink()
    second = run_turn_now(session=session, text="RUNCMD touch approved.txt", user=user)  # nobody decides now
    assert second.status == Turn.Status.SUCCEEDED, second.error
    assert (workdir(settings, session) / "approved.txt").exists()
    granted = Approval.objects.get(turn=second)
    assert (granted.status, granted.decision, granted.decided_by) == (Approval.Status.ACCEPTED, "acceptForSession", None)
    assert "approval_wait_ms" not in second.timings


def test_a_file_change_is_put_to_a_person_with_its_diff(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    turn, seen = run_deciding(run_turn_now, session, user, "PATCHFILE patched.txt hello-patch",
        lambda a: decide(user, a, "accept"), wait=30)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert seen, f"codex asked no approval for the patch: {turn.final_text!r}"
    assert seen["approval"]["kind"] == "file_change", seen
    assert (workdir(settings, session) / "patched.txt").exists()


def test_questions_are_put_to_a_person_and_the_answer_reaches_the_model(user, real_codex, run_turn_now, settings):
    settings.CODEX_USER_INPUT_IN_DEFAULT_MODE = True  # codex 0.171.0 offers request_user_input then only
    session = services.session_create(owner=user, model_config=UNTRUSTED)
    turn, seen = run_deciding(run_turn_now, session, user, "ASKUSER Shall I go on?",
        lambda a: decide(user, a, "accept", answers={"q1": "yes"}), wait=30)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert seen, f"codex asked no question: {turn.final_text!r}"
    assert seen["approval"]["kind"] == "user_input"
    assert "yes" in turn.final_text
