"""The checks of ``make faults`` can fail: a clean transcript passes, and each defect the harness hunts,
planted in the test database, is reported — no stack needed, so this runs in a second."""
from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from devtools.faults.invariants import Tally, check_database, row
from devtools.faults.record import Posted, Record
from hermes_sessions.models import CodexBinding, CodexRollout, Message, Notice, RolloutChunk, Session, Turn
from tests.factories import CodexBindingFactory, MessageFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db

BOUND = 20.0
THREAD = "thread-a"


def store_rollout(session: Session, inputs: list[str]) -> CodexRollout:
    """The thread's rollout as the turns' finalizes store it: one chunk per turn (zlib), the row's
    length, sha256 and generation describing their concatenation."""
    parts = [f'{{"type":"user_message","message":"{text}"}}\n{{"type":"agent_message"}}\n'.encode() for text in inputs]
    whole = b"".join(parts)
    rollout = CodexRollout.objects.create(thread_id=THREAD, session=session, relpath=f"sessions/rollout-x-{THREAD}.jsonl",
                                          length=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                                          generation=len(parts))
    offset = 0
    for seq, raw in enumerate(parts, start=1):
        RolloutChunk.objects.create(rollout=rollout, seq=seq, offset=offset, size=len(raw), compression="zlib",
                                    data=zlib.compress(raw), sha256=hashlib.sha256(raw).hexdigest())
        offset += len(raw)
    return rollout


def clean_session(turns: int = 3) -> tuple[Session, Record]:
    """A session as a clean run leaves it: ``turns`` succeeded turns one after the other on one thread,
    each with its user row and reply, the binding made by the first, the thread's rollout stored with
    one chunk per turn; all of them accepted by a POST."""
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
    store_rollout(session, [f"input {n}" for n in range(1, turns + 1)])
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


def forget_rollout(session: Session) -> None:
    CodexRollout.objects.filter(thread_id=THREAD).delete()


def lose_last_chunk(session: Session) -> None:
    """The turn committed, its chunk did not (the row still describes the longer rollout)."""
    RolloutChunk.objects.filter(rollout__thread_id=THREAD, seq=3).delete()


def skip_generation(session: Session) -> None:
    CodexRollout.objects.filter(thread_id=THREAD).update(generation=4)


def corrupt_chunk(session: Session) -> None:
    chunk = RolloutChunk.objects.get(rollout__thread_id=THREAD, seq=2)
    chunk.data = zlib.compress(zlib.decompress(bytes(chunk.data)).replace(b"input 2", b"input X"))
    chunk.save()


def store_turn_twice(session: Session) -> None:
    """A chunk stored again at the next offset: lengths and the row no longer agree."""
    c = RolloutChunk.objects.get(rollout__thread_id=THREAD, seq=3)
    RolloutChunk.objects.create(rollout=c.rollout, seq=4, offset=c.offset + c.size, size=c.size, compression=c.compression,
                                data=c.data, sha256=c.sha256)


def rollout_without_a_turn(session: Session) -> None:
    """Chunks and row agree, but the third turn's bytes were never stored (its input is not there)."""
    rollout = CodexRollout.objects.get(thread_id=THREAD)
    RolloutChunk.objects.filter(rollout=rollout).delete()
    rollout.delete()
    store_rollout(session, ["input 1", "input 2"])


def rotate_with_notice(session: Session) -> None:
    Turn.objects.filter(pk=turn(session, 3).pk).update(thread_action="rotated")
    Notice.objects.create(session=session, turn=turn(session, 3), text="Codex thread could not be resumed")


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
        (forget_rollout, "has no rollout in PostgreSQL", None),
        (lose_last_chunk, "the row says", None),
        (skip_generation, "generation 4 with 3 chunk(s)", None),
        (corrupt_chunk, "wrong sha256", None),
        (store_turn_twice, "generation 3 with 4 chunk(s)", None),
        (rollout_without_a_turn, "is not in its thread's stored rollout", "lost"),
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


def test_a_rotation_is_reported_where_the_scenario_forbids_it():
    session, rec = clean_session()
    rotate_with_notice(session)
    check_database(rec, BOUND)
    assert not any("rotation(s), where" in v for v in rec.violations), rec.violations  # allowed by default
    rec.expect_no_rotation, rec.violations = True, []
    tally = check_database(rec, BOUND)
    assert tally.rotations == 1
    assert any("1 rotation(s), where every thread's rollout is stored" in v for v in rec.violations), rec.violations


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


def tool_turn(session: Session, *, replies: int) -> None:
    """Turn 3 as a ``RUNCMD`` turn leaves it: the assistant's call, the tool's output, then ``replies``
    assistant rows reporting it (1 when clean)."""
    t3 = turn(session, 3)
    Message.objects.filter(turn=t3, role=Message.Role.ASSISTANT).delete()
    report = "tool said: ran"
    Turn.objects.filter(pk=t3.pk).update(input="RUNCMD echo ran", final_text=report)
    Message.objects.filter(turn=t3, role=Message.Role.USER).update(content="RUNCMD echo ran")
    MessageFactory(session=session, seq=6, turn=t3, role=Message.Role.ASSISTANT, content="",
                   tool_calls=[{"id": "call-1", "type": "function"}], codex_item_id="call-1")
    MessageFactory(session=session, seq=7, turn=t3, role=Message.Role.TOOL, content="ran\n", codex_item_id="call-1-out")
    for n in range(replies):
        MessageFactory(session=session, seq=8 + n, turn=t3, role=Message.Role.ASSISTANT, content=report,
                       codex_item_id=f"msg-tool-{n}")
    Session.objects.filter(pk=session.pk).update(last_message_seq=7 + replies)


@pytest.mark.parametrize(("replies", "violations"), [(1, 0), (2, 1)])
def test_a_turn_that_ran_a_tool_has_one_reply_reporting_it(replies, violations):
    session, rec = clean_session()
    rec.posted[2].text = "RUNCMD echo ran"
    tool_turn(session, replies=replies)
    check_database(rec, BOUND)
    assert len([v for v in rec.violations if "assistant replies" in v or "does not answer" in v]) == violations, rec.violations
