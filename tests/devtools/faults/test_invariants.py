"""The checks of ``make faults`` can fail: a clean transcript passes, and each defect the harness hunts,
planted in the test database, is reported — no stack needed, so this runs in a second."""
from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from devtools.faults.invariants import Tally, check_database, row
from devtools.faults.record import Posted, Record
from hermes_sessions.models import CodexBinding, Message, Notice, Session, Turn
from tests.factories import CodexBindingFactory, MessageFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db

BOUND = 20.0
THREAD = "thread-a"


def clean_session(turns: int = 3) -> tuple[Session, Record]:
    """A session as a clean run leaves it: ``turns`` succeeded turns one after the other on one thread,
    each with its user row and reply, the binding made by the first; all of them accepted by a POST."""
    session = SessionFactory()
    rec = Record(name="planted", sessions=[session.pk])
    start = timezone.now() - timedelta(seconds=10)
    for n in range(1, turns + 1):
        text = f"input {n}"
        turn = TurnFactory(session=session, seq=n, input=text, status=Turn.Status.SUCCEEDED,
                           thread_action="started" if n == 1 else "resumed", codex_thread_id=THREAD,
                           final_text=f"echo: {text}", started_at=start + timedelta(seconds=2 * n),
                           finished_at=start + timedelta(seconds=2 * n + 1))
        MessageFactory(session=session, seq=2 * n - 1, turn=turn, role=Message.Role.USER, content=text)
        MessageFactory(session=session, seq=2 * n, turn=turn, role=Message.Role.ASSISTANT, content=f"echo: {text}",
                       codex_item_id=f"msg-{n}")
        rec.posted.append(Posted(str(turn.pk), session.pk, text, time.time() - 12))
        if n == 1:
            CodexBindingFactory(session=session, thread_id=THREAD, created_by_turn=turn)
    Session.objects.filter(pk=session.pk).update(last_message_seq=2 * turns, last_turn_seq=turns)
    return session, rec


def turn(session: Session, seq: int) -> Turn:
    return Turn.objects.get(session=session, seq=seq)


def test_a_clean_session_passes_every_check():
    _, rec = clean_session()
    tally = check_database(rec, BOUND)
    assert rec.violations == []
    assert (tally.accepted, tally.terminal, tally.lost, tally.duplicates, tally.stuck) == (3, 3, 0, 0, 0)
    assert 0 < tally.longest < BOUND


def double_user_row(session: Session) -> None:
    Message.objects.create(session=session, seq=7, turn=turn(session, 1), role="user", content="input 1")


def lose_reply(session: Session) -> None:
    Message.objects.filter(turn=turn(session, 2), role="assistant").delete()


def overlap_turns(session: Session) -> None:
    Turn.objects.filter(pk=turn(session, 3).pk).update(started_at=turn(session, 2).finished_at - timedelta(milliseconds=50))


def stray_notice(session: Session) -> None:
    Notice.objects.create(session=session, turn=turn(session, 3), text="planted")


def bind_wrong_thread(session: Session) -> None:
    CodexBinding.objects.filter(session=session, status="active").update(thread_id="planted-thread")


def leave_running(session: Session) -> None:
    Turn.objects.filter(pk=turn(session, 3).pk).update(status="running")


def delete_accepted_turn(session: Session) -> None:
    Turn.objects.filter(pk=turn(session, 3).pk).delete()


def add_unposted_turn(session: Session) -> None:
    TurnFactory(session=session, seq=4, input="nobody posted this", status=Turn.Status.FAILED)


def two_turns_for_one_input(session: Session) -> None:
    TurnFactory(session=session, seq=4, input="input 2", status=Turn.Status.FAILED)


def second_thread_without_rotation(session: Session) -> None:
    Turn.objects.filter(pk=turn(session, 2).pk).update(codex_thread_id="thread-b")


@pytest.mark.parametrize(
    ("plant", "reported", "counted"),
    [
        (double_user_row, "user rows", "duplicates"),
        (lose_reply, "lacks its assistant reply", "lost"),
        (overlap_turns, "overlapped or ran out of order", None),  # I3
        (stray_notice, "notices for 0 rotations", None),
        (bind_wrong_thread, "is not the thread of its latest succeeded turn", None),  # I2
        (leave_running, "not terminal", "stuck"),
        (delete_accepted_turn, "does not exist", "lost"),
        (add_unposted_turn, "exists that no POST accepted", "duplicates"),
        (two_turns_for_one_input, "has 2 turns", "duplicates"),
        (second_thread_without_rotation, "did not resume the session's thread", None),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_each_planted_defect_is_reported(plant: Callable[[Session], None], reported: str, counted: str | None):
    session, rec = clean_session()
    plant(session)
    tally = check_database(rec, BOUND)
    assert any(reported in v for v in rec.violations), rec.violations
    if counted:
        assert getattr(tally, counted) >= 1


def test_a_turn_slower_than_the_bound_is_reported():
    session, rec = clean_session()
    rec.posted[0].posted_at = time.time() - 3600
    check_database(rec, BOUND)
    assert any("took longer than 20 s" in v for v in rec.violations), rec.violations


def test_a_post_answered_with_an_error_must_create_no_turn():
    session, rec = clean_session(turns=1)
    TurnFactory(session=session, seq=2, input="refused", status=Turn.Status.SUCCEEDED)
    rec.unanswered.append((session.pk, "refused"))
    check_database(rec, BOUND)
    assert any("a POST answered with an error still created turn" in v for v in rec.violations), rec.violations


def test_row_carries_the_counts_and_violations():
    rec = Record(name="concurrent-posts", runs=50, violations=["x"], notes=["n"])
    tally = Tally(accepted=3, terminal=2, lost=1, duplicates=0, longest=1.26, failed_turns=1)
    tally.failed["codex turn failed"] += 1
    assert row(rec, tally) == {
        "scenario": "concurrent-posts", "runs": 50, "accepted": 3, "terminal": 2, "lost": 1, "duplicates": 0,
        "longest_s": 1.3, "failed": 1, "worker_restarts": 0, "stuck": 0, "violations": ["x"],
        "failed_reasons": {"codex turn failed": 1}, "notes": ["n"], "rotations": 0,
    }
