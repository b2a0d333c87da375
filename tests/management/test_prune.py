"""``manage.py prune_sessions --before`` (``services/retention.py``): deletes sessions last active
before the date with every row they own, lists and counts with ``--dry-run``, and refuses a session
with a queued or running turn."""
from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from hermes_sessions.models import (
    Approval,
    CodexBinding,
    CodexRollout,
    IdempotencyKey,
    Message,
    Notice,
    RolloutChunk,
    Session,
    Turn,
    TurnEvent,
)
from tests.factories import SessionFactory, TurnFactory
from tests.support.rotation import make_rotated_session

pytestmark = pytest.mark.django_db(transaction=True)  # the turns' worker heartbeat uses its own connection

CUTOFF = "2026-01-01"


def age(session: Session, *, days: int) -> None:
    """Make the session, its turns and their times ``days`` old (before CUTOFF when > ~335 days ago)."""
    then = timezone.now() - timedelta(days=days)
    Session.objects.filter(pk=session.pk).update(updated_at=then)
    Turn.objects.filter(session=session).update(created_at=then, started_at=then, finished_at=then)


def owned_counts(session_id: str) -> dict[str, int]:
    return {
        "approvals": Approval.objects.filter(session_id=session_id).count(),
        "messages": Message.objects.filter(session_id=session_id).count(),
        "turns": Turn.objects.filter(session_id=session_id).count(),
        "turn_events": TurnEvent.objects.filter(session_id=session_id).count(),
        "bindings": CodexBinding.objects.filter(session_id=session_id).count(),
        "notices": Notice.objects.filter(session_id=session_id).count(),
        "rollouts": CodexRollout.objects.filter(session_id=session_id).count(),
        "rollout_chunks": RolloutChunk.objects.filter(rollout__session_id=session_id).count(),
    }


@pytest.fixture
def old_rotated(user, scripted_codex, run_turn_now):
    made = make_rotated_session(owner=user, run_turn_now=run_turn_now, scripted_codex=scripted_codex,
                                session_id="sess-prune-old")
    IdempotencyKey.objects.create(user=user, scope="sessions", key="k1", request_hash="h", object_id=made.session.id)
    age(made.session, days=3650)
    return made.session


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("prune_sessions", "--before", CUTOFF, *args, stdout=out)
    return out.getvalue()


def test_dry_run_lists_and_counts_but_deletes_nothing(old_rotated):
    recent = SessionFactory(id="sess-prune-recent", owner=old_rotated.owner)
    counts = owned_counts(old_rotated.id)
    assert counts["messages"] == 6 and counts["rollout_chunks"] >= 1 and counts["notices"] == 1

    out = prune("--dry-run")
    assert f"would delete {old_rotated.id} (last active " in out
    assert recent.id not in out
    detail = ", ".join(f"{n} {k}" for k, n in sorted({**counts, "idempotency_keys": 1}.items()))
    assert out.rstrip().endswith(
        f"would delete 1 session(s) last active before 2026-01-01T00:00:00+00:00 ({detail}); refused 0")
    assert owned_counts(old_rotated.id) == counts
    assert Session.objects.count() == 2


def test_prune_deletes_old_sessions_with_all_their_rows_and_keeps_the_rest(old_rotated):
    recent = SessionFactory(id="sess-prune-recent", owner=old_rotated.owner)
    TurnFactory(session=recent, seq=1, status="succeeded")
    # Old by updated_at, but a turn finished recently: its last activity is recent, so it stays.
    busy_lately = SessionFactory(id="sess-prune-lately", owner=old_rotated.owner)
    Session.objects.filter(pk=busy_lately.pk).update(updated_at=timezone.now() - timedelta(days=3650))
    TurnFactory(session=busy_lately, seq=1, status="succeeded", finished_at=timezone.now())
    counts = owned_counts(old_rotated.id)

    out = prune()
    assert f"deleted {old_rotated.id} (last active " in out
    assert f"{counts['messages']} messages" in out and f"{counts['turns']} turns" in out
    assert out.rstrip().endswith("deleted 1 session(s) last active before 2026-01-01T00:00:00+00:00 ("
                                 + ", ".join(f"{n} {k}" for k, n in sorted({**counts, "idempotency_keys": 1}.items()))
                                 + "); refused 0")
    assert not Session.objects.filter(pk=old_rotated.id).exists()
    assert all(n == 0 for n in owned_counts(old_rotated.id).values())
    assert not IdempotencyKey.objects.filter(object_id=old_rotated.id).exists()
    assert sorted(Session.objects.values_list("id", flat=True)) == ["sess-prune-lately", "sess-prune-recent"]
    assert Turn.objects.filter(session=recent).count() == 1

    assert prune().rstrip().endswith("deleted 0 session(s) last active before 2026-01-01T00:00:00+00:00; refused 0")


@pytest.mark.parametrize("status", ["queued", "running"])
def test_prune_refuses_a_session_with_a_queued_or_running_turn(old_rotated, status):
    stuck = SessionFactory(id="sess-prune-stuck", owner=old_rotated.owner)
    TurnFactory(session=stuck, seq=1, status=status)
    age(stuck, days=3650)

    out = io.StringIO()
    with pytest.raises(CommandError, match="refused 1 session\\(s\\) with a queued or running turn: sess-prune-stuck"):
        call_command("prune_sessions", "--before", CUTOFF, stdout=out)
    assert "refused sess-prune-stuck: 1 queued or running turn(s)" in out.getvalue()
    assert Session.objects.filter(pk=stuck.id).exists() and Turn.objects.filter(session=stuck).count() == 1
    assert not Session.objects.filter(pk=old_rotated.id).exists()  # the others still go


def test_before_must_be_a_date(db):
    with pytest.raises(CommandError, match="not YYYY-MM-DD"):
        call_command("prune_sessions", "--before", "last tuesday")
