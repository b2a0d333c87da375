"""I2 — a turn's effects are applied once: a second delivery, a second finalize, a re-claim after a
crash write nothing twice, and the database's unique constraints (not hope) refuse duplicates."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from hermes_sessions import services, worker
from hermes_sessions.models import CodexBinding, Message, Notice, Turn
from tests.factories import CodexBindingFactory, MessageFactory, NoticeFactory, TurnFactory

from .conftest import expire_lease, queue_turn

pytestmark = pytest.mark.django_db

THREAD = "019a0000-0000-7000-8000-00000000cccc"


def rows(session):
    return list(Message.objects.filter(session=session).order_by("seq").values_list("seq", "role", "content"))


def test_a_second_claim_of_a_running_turn_is_refused(user):
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="hello", user=user)
    first = services.turn_claim(turn_id=turn.id)
    assert first is not None

    assert services.turn_claim(turn_id=turn.id) is None  # a second delivery of the same task

    turn.refresh_from_db()
    assert (turn.status, turn.claim_token, turn.attempt) == (Turn.Status.RUNNING, first.token, 1)
    assert rows(session) == [(1, "user", "hello")]


def test_finalize_twice_writes_once(user, turn_outcome):
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    result = turn_outcome(thread_action="started", thread_id=THREAD, codex_turn_id="ct", status="completed",
                          messages=[{"role": "assistant", "content": "hi", "codex_item_id": "msg_1"}],
                          final_text="hi", usage={"total_tokens": 3})

    assert services.turn_finalize(turn_id=turn.id, token=claim.token, result=result) is not None
    assert services.turn_finalize(turn_id=turn.id, token=claim.token, result=result) is None
    assert services.turn_fail(turn_id=turn.id, token=claim.token, reason="again", result=result) is None

    assert rows(session) == [(1, "user", "hello"), (2, "assistant", "hi")]
    assert list(CodexBinding.objects.filter(session=session).values_list("thread_id", "status")) == [(THREAD, "active")]
    turn.refresh_from_db()
    assert (turn.status, turn.error, turn.usage) == (Turn.Status.SUCCEEDED, "", {"total_tokens": 3})


def test_a_reclaimed_turn_keeps_one_user_row(user):
    session = services.session_create(owner=user)
    turn = queue_turn(session=session, text="hello", user=user)
    for _ in range(2):  # two workers in turn die holding it
        assert services.turn_claim(turn_id=turn.id) is not None
        expire_lease(turn)
        worker.turns_sweep()
    assert services.turn_claim(turn_id=turn.id) is not None
    assert rows(session) == [(1, "user", "hello")]


# The database refuses duplicates even if a code path forgets to check (design I2: "let unique
# constraints, not hope, enforce it"). Each case writes one row, then a duplicate of it.
def _message_seq(session, turn):
    MessageFactory(session=session, seq=1, role="user")
    MessageFactory(session=session, seq=1, role="assistant")


def _message_item(session, turn):
    MessageFactory(session=session, seq=1, turn=turn, role="assistant", codex_item_id="item_1")
    MessageFactory(session=session, seq=2, turn=turn, role="assistant", codex_item_id="item_1")


def _turn_seq(session, turn):
    TurnFactory(session=session, seq=turn.seq)


def _active_binding(session, turn):
    CodexBindingFactory(session=session)
    CodexBindingFactory(session=session)


def _notice_per_turn(session, turn):
    NoticeFactory(session=session, turn=turn)
    NoticeFactory(session=session, turn=turn)


@pytest.mark.parametrize("duplicate", [_message_seq, _message_item, _turn_seq, _active_binding, _notice_per_turn],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_the_database_refuses_duplicate_effects(user, duplicate):
    session = services.session_create(owner=user)
    turn = TurnFactory(session=session, seq=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        duplicate(session, turn)


def test_the_database_allows_what_is_not_a_duplicate(user):
    """The control for the constraints above: ended bindings, other turns' items, user rows."""
    session = services.session_create(owner=user)
    t1, t2 = TurnFactory(session=session, seq=1), TurnFactory(session=session, seq=2)
    CodexBindingFactory(session=session, status="ended")
    CodexBindingFactory(session=session, status="ended")
    CodexBindingFactory(session=session)
    MessageFactory(session=session, seq=1, turn=t1, role="assistant", codex_item_id="item_1")
    MessageFactory(session=session, seq=2, turn=t1, role="tool", codex_item_id="item_1")
    MessageFactory(session=session, seq=3, turn=t2, role="assistant", codex_item_id="item_1")
    MessageFactory(session=session, seq=4, turn=t2, role="user", codex_item_id="")
    MessageFactory(session=session, seq=5, turn=t2, role="user", codex_item_id="")
    NoticeFactory(session=session, turn=None)
    NoticeFactory(session=session, turn=None)
    assert Message.objects.filter(session=session).count() == 5
    assert Notice.objects.filter(session=session).count() == 2
