"""``services.pipelining``: a transaction's statements sent together (psycopg's pipeline mode) keep the
semantics of one-at-a-time statements — program order, all-or-nothing, commit callbacks only after the
commit — and cost the round trips they claim, on the wire (``tests.support.round_trips``)."""
import hashlib

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.backends.postgresql.base import ServerBindingCursor

from hermes_sessions import services
from hermes_sessions.models import CodexBinding, CodexRollout, Session, Turn
from hermes_sessions.services.pipelining import pipelined_atomic
from tests.services.test_query_counts import STORED, THREAD, _outcome
from tests.support.dispatch import hold_dispatches
from tests.support.round_trips import counting, round_trips_counted

pytestmark = pytest.mark.django_db(transaction=True)

TITLE = 'UPDATE "hermes_sessions_session" SET "title" = %s WHERE "id" = %s'


def _title(pk):
    return Session.objects.get(pk=pk).title


def test_batched_statements_and_the_commit_go_in_one_round_trip_and_callbacks_run_after_it(user):
    session = services.session_create(owner=user)
    ran = []
    with round_trips_counted() as wire, counting(wire) as trips:
        with pipelined_atomic(durable=True) as batch:
            first = batch.add(TITLE + " RETURNING title", ["one", session.pk])
            batch.add(TITLE, ["two", session.pk])
            transaction.on_commit(lambda: ran.append(_title(session.pk)))
            assert batch.unsent == 2 and not ran
    assert trips == [2]  # BEGIN + both + COMMIT; then the callback's own read
    assert first.one() == ("one",) and first.rowcount == 1
    assert ran == ["two"]  # after the commit, and it sees it
    assert batch.round_trips == 1


def test_another_statement_sends_what_is_batched_first(user):
    """Program order: an ORM query while statements are batched sends them before itself."""
    session = services.session_create(owner=user)
    with pipelined_atomic() as batch:
        batch.add(TITLE, ["batched", session.pk])
        assert batch.unsent == 1
        assert _title(session.pk) == "batched"  # the ORM read ran after the batched UPDATE
        assert batch.unsent == 0
    assert _title(session.pk) == "batched"


def test_a_failing_statement_rolls_back_the_whole_transaction_and_no_callback_runs(user):
    session = services.session_create(owner=user)
    ran = []
    with pytest.raises(IntegrityError), pipelined_atomic(durable=True) as batch:
        batch.add(TITLE, ["changed", session.pk])
        batch.add('INSERT INTO "hermes_sessions_session" ("id") VALUES (%s)', [session.pk])  # NOT NULL / duplicate
        transaction.on_commit(lambda: ran.append(True))
    assert _title(session.pk) == "" and ran == []
    # The connection is usable afterwards, out of any transaction.
    assert connection.in_atomic_block is False and Session.objects.filter(pk=session.pk).exists()


def test_an_exception_in_the_block_sends_nothing_batched(user):
    session = services.session_create(owner=user)
    with pytest.raises(RuntimeError), pipelined_atomic(durable=True) as batch:
        batch.add(TITLE, ["never", session.pk])
        raise RuntimeError("the caller gave up")
    assert _title(session.pk) == ""


def test_set_rollback_commits_nothing_that_was_sent(user):
    session = services.session_create(owner=user)
    with pipelined_atomic(durable=True) as batch:
        batch.add(TITLE, ["sent, then undone", session.pk]).one()  # sent: one round trip
        transaction.set_rollback(True)
    assert _title(session.pk) == ""


def test_inside_another_transaction_statements_run_at_once_and_the_outer_one_decides(user):
    """Never a COMMIT of the caller's transaction: a nested block is a savepoint, each ``add`` runs now."""
    session = services.session_create(owner=user)
    with pytest.raises(RuntimeError), transaction.atomic():
        with pipelined_atomic() as batch:
            assert not batch.pipelined
            assert batch.add(TITLE, ["inner", session.pk]).rowcount == 1  # known at once
        assert _title(session.pk) == "inner"
        raise RuntimeError("outer rollback")
    assert _title(session.pk) == ""


def test_batched_statements_are_prepared_after_the_threshold_and_the_connection_runs_in_its_modes_after(settings):
    """The batch binds server-side (psycopg's ``cursor_factory``, set back after) so PostgreSQL prepares a text
    after ``DATABASE_PREPARE_THRESHOLD`` runs; the batch's BEGIN rode psycopg's public ``autocommit``, and the
    connection is back in Django's modes once the block ends."""
    settings.DATABASE_PREPARE_THRESHOLD = 2
    for i in range(3):
        with pipelined_atomic() as batch:
            got = batch.add("SELECT %s::int + 1", [i])
        assert got.one() == (i + 1,)
    raw = connection.connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT $1::int + 1%%'")
        assert cursor.fetchone() == (1,)
    assert raw.cursor_factory is not ServerBindingCursor and raw.autocommit and connection.get_autocommit()
    with transaction.atomic():
        Session.objects.count()
        assert not raw.autocommit  # Django's atomic turned it off again: psycopg opens the transaction


def test_a_transaction_that_sent_nothing_commits_nothing(user):
    with round_trips_counted() as wire, counting(wire) as trips, pipelined_atomic(durable=True):
        pass
    assert trips == [0]


def test_a_finalize_whose_claim_is_gone_leaves_the_rollout_store_sent_with_its_locks_undone(user, monkeypatch):
    """The finalize sends the rollout's fenced store with its locks, before it knows whether its claim still
    holds; a lost claim rolls it back with everything else."""
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    CodexBinding.objects.create(session=session, thread_id=THREAD)
    CodexRollout.objects.create(thread_id=THREAD, session=session, relpath="sessions/r.jsonl", length=len(STORED),
                                sha256=hashlib.sha256(STORED).hexdigest(), generation=3)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    Turn.objects.filter(pk=turn.pk).update(claim_token=None)  # another worker took it back meanwhile
    assert services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=_outcome(session, 1)) is None
    rollout = CodexRollout.objects.get(thread_id=THREAD)
    assert rollout.generation == 3 and rollout.length == len(STORED) and not rollout.chunks.exists()


@pytest.mark.parametrize("reached", [True, False], ids=["commit-answer-lost", "commit-lost-on-its-way"])
def test_a_claim_whose_connection_is_lost_with_its_commit_runs_once_not_after_the_lease(user, monkeypatch, reached):
    """A claim's COMMIT answer lost must not leave the turn running under a claim nobody holds until its
    lease expires (30 s), nor a COMMIT lost on its way leave it queued until the sweep (64 s). A proxy
    cuts the worker off at its claim's last write — after PostgreSQL got it (the COMMIT ran, its answer
    never came back) or before. ``turn_claim`` asks on a new connection: its own claim committed is returned,
    one that did not is made again. Either way one claim, attempt 1, one user row, one running event."""
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    with round_trips_counted(cut_after=b"COMMIT", cut_forwards=reached) as wire:
        claim = services.turn_claim(turn_id=turn.id)
        assert wire.cut
    assert claim is not None and claim.attempt == 1
    turn.refresh_from_db()
    assert turn.status == Turn.Status.RUNNING and turn.claim_token == claim.token and turn.attempt == 1
    assert list(turn.messages.values_list("role", flat=True)) == ["user"]
    assert list(turn.events.values_list("kind", flat=True)) == ["queued", "running"]


def test_a_lost_claim_commit_still_running_when_asked_about_is_found_after_the_reclaims_locks(user, monkeypatch):
    """The claim is one round trip, so the COMMIT whose answer was lost can still be executing when
    ``turn_claim`` asks about it on a new connection (about once in ~20 runs of the test above): asked then, it
    sees the turn queued, claims again, finds the turn running (its own lost claim, committed meanwhile) and
    gives up — the turn would wait for its lease. The re-claim's locks wait for that transaction: asked again after
    them, the claim is found. Here the first question is made to come too early.

    On a loaded host the lost transaction's backend may not even have taken its locks when the re-claim
    arrives: then the re-claim claims the turn and the lost transaction, run after it, finds the turn
    running and writes nothing. Either way the turn is claimed once, by the claim returned."""
    from hermes_sessions.services import turns as turns_module

    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hi", user=user)
    real, asked = turns_module._claim_held_by, []

    def too_early(pk, token):
        asked.append(token)
        return None if len(asked) == 1 else real(pk, token)

    monkeypatch.setattr(turns_module, "_claim_held_by", too_early)
    with round_trips_counted(cut_after=b"COMMIT", cut_forwards=True) as wire:
        claim = services.turn_claim(turn_id=turn.id)
        assert wire.cut
    assert claim is not None and claim.attempt == 1
    if len(asked) == 1:  # the re-claim took the locks first and claimed the turn itself
        assert claim.token != asked[0]
    else:  # the re-claim waited for the lost COMMIT, then found it
        assert len(asked) == 2 and claim.token == asked[0]
    turn.refresh_from_db()
    assert turn.status == Turn.Status.RUNNING and turn.claim_token == claim.token and turn.attempt == 1
    assert list(turn.messages.values_list("role", flat=True)) == ["user"]
    assert list(turn.events.values_list("kind", flat=True)) == ["queued", "running"]
