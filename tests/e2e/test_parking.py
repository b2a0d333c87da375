"""A turn waiting for a person parks, with a real ``celery worker -c 1``, the real codex binary and the
model stand-in (docs/contract.md §10 "What a waiting turn holds").

Session A (``approval_policy: untrusted``) asks to run a command and waits for a person; meanwhile the
same worker, with one turn permit (``HERMES_WORKER_TURNS=1``), runs session B's turns to their end. Accepted, A runs the command. A warm shutdown
while A is parked gives A back to the queue: another worker's re-run asks codex again and carries the
pending approval over (one row, A8), and the decision finishes it.
"""
from __future__ import annotations

import os
import signal
import uuid

import pytest

from hermes_sessions import services
from hermes_sessions.models import Approval, Message, Turn

from .test_affinity import _turn, _turn_done, _wait, stand_in, workers  # noqa: F401 — the fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
UNTRUSTED = {"sandbox": "workspace-write", "approval_policy": "untrusted"}


def _asking(user, session_id: str) -> tuple[Turn, str]:
    """Session ``session_id`` posts a command that waits for a person; returns the turn and the mark the
    command echoes once it runs."""
    session = services.session_create(owner=user, session_id=session_id, model_config=UNTRUSTED)
    mark = f"ran-{uuid.uuid4().hex[:8]}"
    turn = services.turn_enqueue(session=session, input_text=f"RUNCMD touch approved.txt && echo {mark}", user=user)
    _wait(lambda: Approval.objects.filter(turn_ref=turn.pk, status=Approval.Status.PENDING).exists(), 60,
          "codex asked no approval")
    return turn, mark


def _parked(workers, name: str, turn: Turn) -> None:  # noqa: F811 — the fixture's value
    _wait(lambda: f"turn {turn.pk} waits for a person: parked" in workers.log(name), 15, "the turn did not park")


def _tool_text(turn: Turn) -> str:
    return "\n".join(Message.objects.filter(turn=turn, role="tool").values_list("content", flat=True))


def test_other_sessions_turns_run_and_finish_while_a_turn_waits_for_a_person(user, workers, tmp_path):  # noqa: F811
    workers.env["HERMES_WORKER_TURNS"] = "1"  # one permit: B's turns run only because A's turn parked
    workers.start("a")
    asking, mark = _asking(user, "park-a")
    _parked(workers, "a", asking)
    other = services.session_create(owner=user, session_id="park-b")
    for text in ("one", "two"):
        done = _turn(other, user, text, timeout=60)
        assert done.status == Turn.Status.SUCCEEDED, done.error
    approval = Approval.objects.get(turn_ref=asking.pk)
    assert (approval.status, Turn.objects.get(pk=asking.pk).status) == (Approval.Status.PENDING, Turn.Status.RUNNING)

    services.approval_decide(approval_id=approval.pk, user=user, decision="accept")
    done = _turn_done(asking)
    assert (done.status, done.attempt) == (Turn.Status.SUCCEEDED, 1), done.error
    assert (tmp_path / "work" / "park-a" / "approved.txt").exists()
    assert mark in _tool_text(done)


def test_a_warm_shutdown_gives_a_parked_turn_back_and_its_rerun_carries_the_approval(user, workers, tmp_path):  # noqa: F811
    a = workers.start("a")
    asking, mark = _asking(user, "park-stop")
    _parked(workers, "a", asking)
    os.kill(a.pid, signal.SIGTERM)  # Celery's warm shutdown: no task of its own runs, the pool process stops
    a.wait(timeout=60)
    assert "given back to the queue" in workers.log("a")
    assert workers.codex_of("a") == []
    approval = Approval.objects.get(turn_ref=asking.pk)
    assert (approval.status, approval.answered_at, approval.attempt) == (Approval.Status.PENDING, None, 1)

    workers.start("b")
    _wait(lambda: Approval.objects.get(pk=approval.pk).attempt == 2, 60, "the re-run did not carry the approval over")
    services.approval_decide(approval_id=approval.pk, user=user, decision="accept")
    done = _turn_done(asking)
    assert (done.status, done.attempt) == (Turn.Status.SUCCEEDED, 2), done.error
    assert Approval.objects.filter(turn_ref=asking.pk).count() == 1  # nobody was asked twice
    assert (tmp_path / "work" / "park-stop" / "approved.txt").exists()
    assert mark in _tool_text(done)
