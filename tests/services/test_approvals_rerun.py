"""The same request after a lost worker (docs/contract.md §10, A8), through the worker's real code on the
scripted app-server: the turn's first claim asked a command and lost its worker while the approval was
pending; the sweep took the turn back; its re-run's codex asks the same command again. Nobody is asked
twice, and a decision — given before the re-run asks or after — reaches codex once."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from hermes_sessions import services
from hermes_sessions.codex.server_requests import approval_request
from hermes_sessions.models import Approval, Turn, TurnEvent, WebhookDelivery
from hermes_sessions.worker import recovery
from tests.support.approvals import turn_with_person
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db(transaction=True)

COMMAND = {"method": "item/commandExecution/requestApproval", "params": {
    "itemId": "call_1", "command": "/bin/bash -lc 'touch approved.txt'", "cwd": "/w",
    "availableDecisions": ["accept", "cancel"]}}
OTHER = {**COMMAND, "params": {**COMMAND["params"], "command": "/bin/bash -lc 'rm -rf work'"}}


@pytest.fixture(autouse=True)
def fast_clock(settings):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    settings.HERMES_APPROVAL_TIMEOUT_SECONDS = 5.0  # a request nobody decides ends the turn soon


def answers(scripted_codex) -> list[dict]:
    path = scripted_codex.state / "server_answers.jsonl"
    return [json.loads(line)["answer"] for line in path.read_text().splitlines()] if path.exists() else []


def asked_then_lost(user, scripted_codex, monkeypatch, *, rerun_asks=COMMAND):
    """A turn whose first claim recorded ``COMMAND`` pending, then lost its worker; the sweep's take-back
    queued it again. Returns ``(turn, the pending approval, run_again)``: ``run_again()`` delivers the
    turn once more through the real task code, whose codex asks ``rerun_asks`` (``None``: nothing)."""
    from hermes_sessions.tasks import run_turn

    scripted_codex.script({"turn/start": [{"server_request": rerun_asks}]} if rerun_asks else {})
    session = services.session_create(owner=user, model_config={"approval_policy": "untrusted"})
    with monkeypatch.context() as held:
        hold_dispatches(held)
        turn = services.turn_enqueue(session=session, input_text="RUNCMD touch approved.txt", user=user)
        claim = services.turn_claim(turn_id=turn.pk)
        assert claim is not None
        request = approval_request(COMMAND["method"], {"threadId": "t-lost", **COMMAND["params"]})
        request.request_id = "1"
        first = services.approval_request(turn_id=turn.pk, token=claim.token, request=request, timeout=900)
        assert first is not None and first.is_pending
        Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
        assert recovery.leases_take_back(limit=5, by="test") != (0, 0)
    turn.refresh_from_db()
    assert (turn.status, turn.attempt) == (Turn.Status.QUEUED, 1)

    def run_again() -> Turn:
        run_turn(str(turn.pk))
        turn.refresh_from_db()
        return turn

    return turn, first, run_again


def test_a_decision_given_while_the_turn_is_taken_back_is_applied_by_its_rerun(user, scripted_codex, monkeypatch):
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch)
    services.approval_decide(approval_id=first.pk, user=user, decision="accept")  # the turn is queued: taken
    turn = run_again()
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex) == [{"id": 0, "result": {"decision": "accept"}}]
    rows = list(Approval.objects.filter(turn_ref=turn.pk))
    assert len(rows) == 1  # nobody was asked again
    assert (rows[0].status, rows[0].attempt, rows[0].decided_by) == (Approval.Status.ACCEPTED, 2, user)
    assert rows[0].answered_at is not None
    again = TurnEvent.objects.filter(turn=turn, attempt=2, kind__startswith="approval.")
    assert list(again.values_list("kind", flat=True)) == ["approval.requested", "approval.resolved"]


def test_a_pending_approval_is_carried_to_the_rerun_and_decided_there(user, scripted_codex, monkeypatch):
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch)

    def carried():
        return Approval.objects.filter(pk=first.pk, attempt=2, status=Approval.Status.PENDING).first()

    turn = turn_with_person(lambda **_: run_again(), session=turn.session, user=user, text="", wait=10.0,
                            find_pending=carried,
                            act=lambda a: services.approval_decide(approval_id=a.pk, user=user, decision="accept"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert answers(scripted_codex) == [{"id": 0, "result": {"decision": "accept"}}]
    assert Approval.objects.filter(turn_ref=turn.pk).count() == 1
    assert Approval.objects.get(pk=first.pk).expires_at == first.expires_at  # its wait stays bounded as asked


def test_a_decision_that_reached_codex_is_not_applied_again(user, scripted_codex, monkeypatch, settings):
    settings.HERMES_APPROVAL_TIMEOUT_SECONDS = 0.5
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch)
    services.approval_decide(approval_id=first.pk, user=user, decision="accept")
    Approval.objects.filter(pk=first.pk).update(answered_at=timezone.now())  # its worker had answered codex
    turn = run_again()
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    asked_again = Approval.objects.filter(turn_ref=turn.pk).exclude(pk=first.pk).get()
    assert asked_again.status == Approval.Status.EXPIRED  # put to a person (who did not answer in time)
    assert answers(scripted_codex) == [{"id": 0, "result": {"decision": "decline"}}]


def test_another_request_on_the_rerun_is_asked_and_the_earlier_one_ends_with_the_turn(user, scripted_codex,
                                                                                    monkeypatch, settings):
    settings.HERMES_APPROVAL_TIMEOUT_SECONDS = 0.5
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch, rerun_asks=OTHER)
    turn = run_again()
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert Approval.objects.filter(turn_ref=turn.pk).count() == 2
    earlier = Approval.objects.get(pk=first.pk)
    assert (earlier.status, earlier.attempt) == (Approval.Status.CANCELLED, 1)
    assert not Approval.objects.filter(turn_ref=turn.pk, status=Approval.Status.PENDING).exists()


def test_a_turn_given_up_after_its_last_attempt_closes_the_earlier_claims_approval(user, scripted_codex,
                                                                                  monkeypatch, settings):
    settings.HERMES_MAX_ATTEMPTS = 2
    turn, first, _ = asked_then_lost(user, scripted_codex, monkeypatch)
    claim = services.turn_claim(turn_id=turn.pk)
    assert claim is not None and claim.attempt == 2
    services.turn_requeue(turn_id=turn.pk, token=claim.token, reason="codex busy")
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED
    assert Approval.objects.get(pk=first.pk).status == Approval.Status.CANCELLED


def test_cancelling_a_taken_back_turn_closes_its_approval(user, scripted_codex, monkeypatch):
    turn, first, _ = asked_then_lost(user, scripted_codex, monkeypatch)
    services.turn_cancel(turn=turn)
    assert Approval.objects.get(pk=first.pk).status == Approval.Status.CANCELLED
    with pytest.raises(services.ApprovalClosed):
        services.approval_decide(approval_id=first.pk, user=user, decision="accept")


def test_a_stale_worker_cannot_answer_from_a_row_carried_to_another_claim(user, scripted_codex, monkeypatch):
    turn, first, _ = asked_then_lost(user, scripted_codex, monkeypatch)
    services.approval_decide(approval_id=first.pk, user=user, decision="accept")
    Approval.objects.filter(pk=first.pk).update(attempt=2)  # the re-run carried it over
    assert not services.approval_answered(approval_id=first.pk, attempt=1)  # the lost worker, waking up
    assert services.approval_answered(approval_id=first.pk, attempt=2)
    assert not services.approval_answered(approval_id=first.pk, attempt=2)  # once


def test_an_approval_carried_to_the_rerun_is_not_announced_by_webhook_again(user, scripted_codex, monkeypatch,
                                                                           settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    services.webhook_endpoint_create(owner=user, url="http://127.0.0.1:9/hook", event_types=["approval.requested"])
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch)
    turn = turn_with_person(
        lambda **_: run_again(), session=turn.session, user=user, text="", wait=10.0,
        find_pending=lambda: Approval.objects.filter(pk=first.pk, attempt=2, status=Approval.Status.PENDING).first(),
        act=lambda a: services.approval_decide(approval_id=a.pk, user=user, decision="accept"))
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    requested = TurnEvent.objects.filter(turn=turn, kind="approval.requested").order_by("id")
    assert [e.data["status"] for e in requested] == ["pending", "pending"]  # on each claim's stream
    assert WebhookDelivery.objects.filter(turn_id=turn.pk, event_type="approval.requested").count() == 1


def test_a_rerun_that_asks_nothing_ends_the_earlier_claims_approval_with_the_turn(user, scripted_codex, monkeypatch):
    turn, first, run_again = asked_then_lost(user, scripted_codex, monkeypatch, rerun_asks=None)
    turn = run_again()
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    earlier = Approval.objects.get(pk=first.pk)
    assert (earlier.status, earlier.answered_at) == (Approval.Status.CANCELLED, None)
    assert "ended (succeeded)" in earlier.reason
