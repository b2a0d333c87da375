"""I1 — durable before bound: a binding is published only in the finalize transaction, together with
the turn's rows and final state; a thread whose turn is not in our transcript is never bound."""
from __future__ import annotations

import pytest
from django.db import DatabaseError, connection

from hermes_sessions import services
from hermes_sessions.models import CodexBinding, Message, Notice, Turn
from tests.factories import CodexBindingFactory

from .conftest import queue_turn

THREAD = "019a0000-0000-7000-8000-00000000dddd"
OLD_THREAD = "019a0000-0000-7000-8000-00000000eeee"


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(30)
def test_a_first_turn_that_dies_after_thread_start_binds_nothing(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"exit_mid_turn": 1}]})  # codex dies mid-turn

    turn = run_turn_now(session=session, text="hello", user=user)

    assert turn.status == Turn.Status.FAILED and turn.error
    assert scripted_codex.processes()[0][:3] == ["initialize", "thread/start", "turn/start"]
    assert not CodexBinding.objects.filter(session=session).exists()
    assert list(Message.objects.filter(session=session).values_list("role", flat=True)) == ["user"]


@pytest.mark.django_db
def test_a_thread_started_then_cancelled_before_turn_start_is_not_bound(user, turn_outcome):
    """The runner reports a started thread with no codex turn (cancelled before ``turn/start``):
    codex wrote no rollout for it, so it can never be resumed."""
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    result = turn_outcome(thread_action="started", thread_id=THREAD, status="interrupted", methods=["thread/start"])

    done = services.turn_finalize(turn_id=turn.id, token=claim.token, result=result)

    assert done is not None and done.status == Turn.Status.CANCELLED
    assert not CodexBinding.objects.filter(session=session).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("codex_status", [None, "completed"])
def test_a_failed_turn_binds_nothing_even_if_codex_ran_it(user, turn_outcome, codex_status):
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    result = turn_outcome(thread_action="started", thread_id=THREAD, codex_turn_id="ct", status=codex_status)

    services.turn_fail(turn_id=turn.id, token=claim.token, reason="transport failed after turn/start", result=result)

    assert not CodexBinding.objects.filter(session=session).exists()


REFUSE_FINISH = """
CREATE FUNCTION pg_temp.refuse_finish() RETURNS trigger AS $$
BEGIN
  IF NEW.status IS DISTINCT FROM OLD.status AND NEW.status IN ('succeeded', 'failed', 'cancelled') THEN
    RAISE EXCEPTION 'test: the final state of turn % cannot be written', NEW.id;
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER refuse_finish BEFORE UPDATE ON hermes_sessions_turn
  FOR EACH ROW EXECUTE FUNCTION pg_temp.refuse_finish();
"""


@pytest.mark.django_db
def test_rows_binding_notice_and_state_commit_together_or_not_at_all(user, turn_outcome):
    """Writing the turn's final state fails (the database refuses it): then the binding, the
    rotation, the notice and the transcript rows of that commit must not be there either."""
    session = services.session_create(owner=user)
    CodexBindingFactory(session=session, thread_id=OLD_THREAD)
    turn = queue_turn(session=session, text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    result = turn_outcome(
        thread_action="rotated", thread_id=THREAD, codex_turn_id="ct", status="completed",
        messages=[{"role": "assistant", "content": "hi", "codex_item_id": "msg_1"}], final_text="hi",
        rotated_from=OLD_THREAD, rotation_reason=f"no rollout found for thread id {OLD_THREAD}",
    )
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_FINISH)

    with pytest.raises(DatabaseError, match="cannot be written"):
        services.turn_finalize(turn_id=turn.id, token=claim.token, result=result)

    assert list(CodexBinding.objects.filter(session=session).values_list("thread_id", "status")) == [(OLD_THREAD, "active")]
    assert not Notice.objects.filter(session=session).exists()
    assert list(Message.objects.filter(session=session).values_list("role", flat=True)) == ["user"]
    turn.refresh_from_db()
    assert (turn.status, turn.claim_token) == (Turn.Status.RUNNING, claim.token)

    with connection.cursor() as cursor:  # the control: without the fault the same commit lands whole
        cursor.execute("DROP TRIGGER refuse_finish ON hermes_sessions_turn")
    assert services.turn_finalize(turn_id=turn.id, token=claim.token, result=result) is not None
    assert CodexBinding.objects.get(session=session, status="active").thread_id == THREAD
    assert Notice.objects.filter(session=session).count() == 1


@pytest.mark.django_db
def test_a_failed_turn_after_codex_proved_the_thread_gone_ends_the_dead_binding_once(user, turn_outcome):
    """``turn_fail`` with a result whose ``rotated_from`` is set: the thread is gone for good, so its
    binding ends (with the one rotation notice) even though the turn failed; nothing new is bound."""
    session = services.session_create(owner=user)
    CodexBindingFactory(session=session, thread_id="thread-gone")
    turn = queue_turn(session=session, text="hi", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    assert claim is not None and claim.thread_id == "thread-gone"
    result = turn_outcome(thread_action="rotated", thread_id="thread-new", rotated_from="thread-gone",
                          rotation_reason="no rollout found for thread id thread-gone")
    services.turn_fail(turn_id=turn.id, token=claim.token, reason="thread/start failed", result=result)
    assert not CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).exists()
    ended = CodexBinding.objects.get(session=session, thread_id="thread-gone")
    assert ended.status == CodexBinding.Status.ENDED and "no rollout found" in ended.ended_reason
    assert Notice.objects.filter(session=session).count() == 1
