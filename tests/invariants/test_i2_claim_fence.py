"""I2 — the claim-token fence: a worker that lost its claim commits nothing, even while the turn is
still RUNNING under another worker's claim.

The scenario is the dangerous one: worker A claims a turn, stalls past its lease, the sweep takes
the turn back and worker B claims it again (a new token). When A wakes up and reports — a finished
codex turn, a failure, a requeue, a heartbeat — the turn's status is still ``running``, so only the
token tells A's write apart from B's. Every stale write must change nothing; B's write must still
work afterwards (so the fence is the token, not a turn that is simply gone).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from hermes_sessions import services, worker
from hermes_sessions.models import CodexBinding, Message, Notice, Turn
from tests.factories import CodexBindingFactory

from .conftest import expire_lease, queue_turn

pytestmark = pytest.mark.django_db

OLD_THREAD = "019a0000-0000-7000-8000-00000000aaaa"
NEW_THREAD = "019a0000-0000-7000-8000-00000000bbbb"


@pytest.fixture
def stolen(user):
    """A bound session whose turn was claimed by worker A, taken back by the sweep after A's lease
    expired, and claimed again by worker B. Returns (session, turn, claim_a, claim_b)."""
    session = services.session_create(owner=user)
    CodexBindingFactory(session=session, thread_id=OLD_THREAD)
    turn = queue_turn(session=session, text="hello", user=user)
    claim_a = services.turn_claim(turn_id=turn.id)
    assert claim_a is not None and claim_a.thread_id == OLD_THREAD
    expire_lease(turn)
    assert worker.turns_sweep().requeued == 1
    claim_b = services.turn_claim(turn_id=turn.id)
    assert claim_b is not None and claim_b.token != claim_a.token and claim_b.attempt == 2
    # A fixed lease, so a stale heartbeat that renewed it would show.
    Turn.objects.filter(pk=turn.id).update(lease_expires_at=timezone.now() + timedelta(seconds=5))
    turn.refresh_from_db()
    assert (turn.status, turn.claim_token) == (Turn.Status.RUNNING, claim_b.token)
    return session, turn, claim_a, claim_b


def snapshot(session):
    """Everything a turn's commit could touch."""
    turn_fields = ("status", "claim_token", "attempt", "lease_expires_at", "error", "final_text",
                   "codex_thread_id", "codex_turn_id", "thread_action", "usage", "finished_at")
    return {
        "messages": list(Message.objects.filter(session=session).order_by("seq").values_list("seq", "role", "content")),
        "bindings": list(CodexBinding.objects.filter(session=session).order_by("id")
                         .values_list("thread_id", "status", "ended_reason")),
        "notices": list(Notice.objects.filter(session=session).values_list("text", flat=True)),
        "turns": list(Turn.objects.filter(session=session).order_by("seq").values_list(*turn_fields)),
        "session_seq": type(session).objects.filter(pk=session.pk).values_list("last_message_seq", flat=True)[0],
    }


def late_result(turn_outcome):
    """What worker A's codex run produced: a rotation to a new thread, a reply, usage."""
    return turn_outcome(
        thread_action="rotated", thread_id=NEW_THREAD, codex_turn_id="codex-turn-a", status="completed",
        messages=[{"role": "assistant", "content": "late reply from A", "codex_item_id": "msg_a"}],
        final_text="late reply from A", usage={"total_tokens": 7}, methods=["thread/resume", "thread/start"],
        rotated_from=OLD_THREAD, rotation_reason=f"no rollout found for thread id {OLD_THREAD}",
    )


STALE_WRITES = {
    "turn_finalize": lambda claim, result: services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=result),
    "turn_fail": lambda claim, result: services.turn_fail(turn_id=claim.turn_id, token=claim.token,
                                                          reason="codex died under A", result=result),
    "turn_requeue": lambda claim, result: services.turn_requeue(turn_id=claim.turn_id, token=claim.token,
                                                                reason="thread busy under A"),
}


@pytest.mark.parametrize("write", list(STALE_WRITES))
def test_a_stale_claim_commits_nothing_while_the_turn_runs_under_another(stolen, turn_outcome, write):
    session, turn, claim_a, claim_b = stolen
    before = snapshot(session)
    assert before["messages"] == [(1, "user", "hello")]  # the re-claim did not write the user row twice

    assert STALE_WRITES[write](claim_a, late_result(turn_outcome)) is None

    assert snapshot(session) == before  # no rows, no binding change, no notice, turn untouched
    turn.refresh_from_db()
    assert (turn.status, turn.claim_token) == (Turn.Status.RUNNING, claim_b.token)


def test_a_stale_heartbeat_neither_renews_the_lease_nor_relays_a_cancel(stolen):
    session, turn, claim_a, claim_b = stolen
    services.turn_cancel(turn=turn)  # a cancel request is pending for B
    before = snapshot(session)

    beat = services.turn_heartbeat(turn_id=claim_a.turn_id, token=claim_a.token)

    assert (beat.held, beat.cancel_requested) == (False, False)  # A must stop, and commit nothing
    assert snapshot(session) == before  # B's lease is not A's to renew
    own = services.turn_heartbeat(turn_id=claim_b.turn_id, token=claim_b.token)
    assert (own.held, own.cancel_requested) == (True, True)


def test_after_the_stale_writes_the_current_claim_still_commits(stolen, turn_outcome):
    """The control: the same writes with B's token do land, so the fence above is the token."""
    session, turn, claim_a, claim_b = stolen
    for write in STALE_WRITES.values():
        write(claim_a, late_result(turn_outcome))
    services.turn_heartbeat(turn_id=claim_a.turn_id, token=claim_a.token)

    result = late_result(turn_outcome)
    result.messages = [{"role": "assistant", "content": "reply from B", "codex_item_id": "msg_b"}]
    result.final_text = "reply from B"
    done = services.turn_finalize(turn_id=claim_b.turn_id, token=claim_b.token, result=result)

    assert done is not None and done.status == Turn.Status.SUCCEEDED
    assert snapshot(session)["messages"] == [(1, "user", "hello"), (2, "assistant", "reply from B")]
    assert CodexBinding.objects.get(session=session, status="active").thread_id == NEW_THREAD
    assert CodexBinding.objects.get(session=session, thread_id=OLD_THREAD).status == "ended"
    assert list(Notice.objects.filter(session=session).values_list("text", flat=True)) == [services.NOTICE_THREAD_ROTATED]
    # …and once B has committed, A's token stays worthless.
    assert services.turn_finalize(turn_id=claim_a.turn_id, token=claim_a.token, result=late_result(turn_outcome)) is None
    assert Message.objects.filter(session=session).count() == 2
