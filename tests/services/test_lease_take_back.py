"""Lease recovery without beat: ``recovery.leases_take_back``, shared by the sweep and
every keeping worker's affinity job (``affinity.AffinityLoop``; its tick: ``test_affinity.py``), takes back running turns whose lease
expired — once, however many callers race, none waiting on another, none taking a live turn.

Real PostgreSQL (transactional: the take-back is a durable transaction; racing callers need their own
connections); nothing is sent (``dispatch.turn_dispatch_on_commit`` records the ids).
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from hermes_sessions import worker
from hermes_sessions.models import Session, Turn, TurnEvent
from hermes_sessions.services import dispatch, events
from hermes_sessions.worker import recovery
from tests.factories import SessionFactory, TurnFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
def sent(monkeypatch) -> list[uuid.UUID]:
    """Turn ids passed to ``dispatch.turn_dispatch_on_commit`` (nothing is sent)."""
    calls: list[uuid.UUID] = []
    def record(turn_id, **_) -> None:  # the stamp the real one writes (the sweep counts from it)
        Turn.objects.filter(pk=turn_id).update(dispatched_at=timezone.now())
        calls.append(turn_id)

    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", record)
    return calls


def running_turn(*, expires_in: float, attempt: int = 1) -> Turn:
    """A running turn of a fresh session whose lease ends ``expires_in`` seconds from now."""
    return TurnFactory(session=SessionFactory(), seq=1, status=Turn.Status.RUNNING, attempt=attempt,
                       claim_token=uuid.uuid4(), lease_expires_at=timezone.now() + timedelta(seconds=expires_in))


def take_back_events(turn: Turn) -> int:
    return TurnEvent.objects.filter(turn=turn, kind=events.RETRYING).count()


def test_an_expired_running_turn_is_requeued_and_a_live_one_is_not(sent):
    lost, live = running_turn(expires_in=-1), running_turn(expires_in=30)

    assert recovery.leases_take_back(limit=10, by="test") == (1, 0)

    lost.refresh_from_db()
    live_before = (live.status, live.claim_token, live.lease_expires_at)
    live.refresh_from_db()
    assert (lost.status, lost.claim_token, lost.lease_expires_at) == (Turn.Status.QUEUED, None, None)
    assert (live.status, live.claim_token, live.lease_expires_at) == live_before
    assert sent == [lost.pk] and take_back_events(lost) == 1
    assert recovery.leases_take_back(limit=10, by="test") == (0, 0)  # idempotent: nothing left


def test_past_max_attempts_the_turn_fails(sent, settings):
    settings.HERMES_MAX_ATTEMPTS = 2
    doomed = running_turn(expires_in=-1, attempt=2)
    assert recovery.leases_take_back(limit=10, by="test") == (0, 1)
    doomed.refresh_from_db()
    assert doomed.status == Turn.Status.FAILED and "lost 2 time(s)" in doomed.error
    assert sent == []


def test_the_limit_bounds_one_call_oldest_first(sent):
    turns = [running_turn(expires_in=-10 + i) for i in range(5)]
    assert recovery.leases_take_back(limit=2, by="test") == (2, 0)
    assert sent == [turns[0].pk, turns[1].pk]
    assert recovery.leases_take_back(limit=10, by="test") == (3, 0)


def test_nothing_to_do_is_one_query(sent, django_assert_num_queries):
    running_turn(expires_in=30)
    with django_assert_num_queries(1):
        assert recovery.leases_take_back(limit=10, by="test") == (0, 0)


def test_the_candidate_query_uses_the_status_lease_index():
    """The per-round read of every worker: an index scan on (status, lease_expires_at), not a scan of
    the turns table (planner told not to seq-scan, as it would on a near-empty table)."""
    query = Turn.objects.filter(status=Turn.Status.RUNNING, lease_expires_at__lt=Now()).order_by(
        "lease_expires_at").values_list("pk", flat=True)[:20]
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        try:
            plan = query.explain()
        finally:
            cursor.execute("SET enable_seqscan = on")
    index = next(i.name for i in Turn._meta.indexes if i.fields == ["status", "lease_expires_at"])
    assert index in plan, plan


def test_concurrent_callers_take_each_turn_back_exactly_once(sent):
    """Two workers' loops (own threads, own connections) race over the same expired turns: each turn is
    requeued once — one retrying event, one dispatch — and the totals add up."""
    lost = [running_turn(expires_in=-1) for _ in range(12)]
    start = threading.Barrier(2)
    results: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def caller(name: str) -> None:
        try:
            start.wait()
            results.append(recovery.leases_take_back(limit=100, by=name))
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=caller, args=(f"worker {i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert sum(r for r, _ in results) == len(lost)
    assert sorted(map(str, sent)) == sorted(str(t.pk) for t in lost)
    assert all(take_back_events(t) == 1 for t in lost)
    assert set(Turn.objects.filter(pk__in=[t.pk for t in lost]).values_list("status", "attempt")) == {
        (Turn.Status.QUEUED, 1)}


def _dsn() -> str:
    db = django_settings.DATABASES["default"]
    return (f"host={db['HOST'] or '127.0.0.1'} port={db['PORT'] or 5432} dbname={db['NAME']} "
            f"user={db['USER']} password={db['PASSWORD'] or ''}")


@pytest.mark.parametrize("table", [Session, Turn])
def test_a_locked_turn_is_skipped_without_waiting_and_taken_next_round(sent, table):
    """A row another transaction holds (another caller taking the turn back, a frozen writer) is left
    to it: no wait, no error; the next round takes the turn."""
    lost = running_turn(expires_in=-1)
    pk = lost.session_id if table is Session else lost.pk
    with psycopg.connect(_dsn()) as other:
        other.execute(f'SELECT 1 FROM "{table._meta.db_table}" WHERE id = %s FOR UPDATE', [pk])
        t0 = time.monotonic()
        assert recovery.leases_take_back(limit=10, by="test") == (0, 0)
        assert time.monotonic() - t0 < 2
        other.rollback()
    assert recovery.leases_take_back(limit=10, by="test") == (1, 0)
    assert sent == [lost.pk]


def test_a_lease_renewed_between_selection_and_lock_is_left_alone(sent, monkeypatch):
    """The check under the lock: the turn's heartbeat renewed the lease after the candidate read."""
    lost = running_turn(expires_in=-1)
    real_lock = recovery.lock_session_and_turn

    def renew_then_lock(turn_id, **kw):
        Turn.objects.filter(pk=turn_id).update(lease_expires_at=timezone.now() + timedelta(seconds=30))
        return real_lock(turn_id, **kw)

    monkeypatch.setattr(recovery, "lock_session_and_turn", renew_then_lock)
    assert recovery.leases_take_back(limit=10, by="test") == (0, 0)
    lost.refresh_from_db()
    assert lost.status == Turn.Status.RUNNING and sent == []


def test_a_caller_whose_clock_runs_ahead_takes_nothing_early(sent, monkeypatch):
    """Expiry is judged by the database's clock: a worker whose clock is an hour fast (or that woke from a
    stall believing much time passed) does not take a live turn."""
    live = running_turn(expires_in=30)
    monkeypatch.setattr(timezone, "now", lambda: live.lease_expires_at + timedelta(hours=1))
    assert recovery.leases_take_back(limit=10, by="test") == (0, 0)
    monkeypatch.undo()
    live.refresh_from_db()
    assert live.status == Turn.Status.RUNNING


def test_a_process_never_takes_back_a_turn_whose_lease_it_renews(sent):
    """A process whose threads all stalled wakes with its own turn's lease expired; its loop may run before
    the turn's heartbeat (``heartbeats.TurnHeartbeats.beating`` registers the claim): the turn is left to that heartbeat.
    Any other process takes it back."""
    own = running_turn(expires_in=-1)
    recovery.lease_renewed_here(own.claim_token, renewing=True)
    try:
        assert recovery.leases_take_back(limit=10, by="test") == (0, 0)
    finally:
        recovery.lease_renewed_here(own.claim_token, renewing=False)
    assert recovery.leases_take_back(limit=10, by="test") == (1, 0)


def test_the_sweep_uses_the_same_take_back(sent, monkeypatch):
    calls = []
    monkeypatch.setattr(recovery, "leases_take_back", lambda **kw: calls.append(kw) or (2, 1))
    report = worker.turns_sweep()
    assert (report.requeued, report.failed) == (2, 1)
    assert calls == [{"limit": recovery.SWEEP_TAKE_BACK_LIMIT, "by": "sweep"}]


def test_a_turn_cancelled_while_its_worker_was_lost_ends_cancelled_without_a_retrying_event(sent):
    """The take-back must not write ``retrying`` (queued again) for a turn the claim would then end
    ``cancelled`` — a stream would show the turn coming back before it ended. It ends at once, and the
    session's next queued turn is sent."""
    lost = running_turn(expires_in=-1)
    nxt = TurnFactory(session=lost.session, seq=2, status=Turn.Status.QUEUED)
    Turn.objects.filter(pk=lost.pk).update(cancel_requested_at=timezone.now())

    assert recovery.leases_take_back(limit=10, by="test") == (0, 0)

    lost.refresh_from_db()
    assert (lost.status, lost.claim_token, lost.lease_expires_at) == (Turn.Status.CANCELLED, None, None)
    assert lost.finished_at is not None and "cancelled" in lost.error
    kinds = list(TurnEvent.objects.filter(turn=lost).order_by("id").values_list("kind", flat=True))
    assert events.RETRYING not in kinds and kinds[-1] == "cancelled"
    assert sent == [nxt.pk]
    assert recovery.leases_take_back(limit=10, by="test") == (0, 0)


# --- workers without an affinity loop (more than one turn slot, keeping off): recovery.SweepLoop -----------

def test_a_sweep_loop_takes_back_an_expired_turn_on_the_scheduler(sent, settings):
    settings.HERMES_WORKER_HEARTBEAT_SECONDS = 0.05
    lost = running_turn(expires_in=-1)
    loop = recovery.sweep_loop_start(by="worker process test")
    try:
        assert recovery.sweep_loop_start(by="again") is loop  # once per process
        deadline = time.monotonic() + 10
        while Turn.objects.get(pk=lost.pk).status != Turn.Status.QUEUED:
            assert time.monotonic() < deadline, "the loop took nothing back"
            time.sleep(0.05)
    finally:
        recovery.sweep_loop_stop()
    assert sent == [lost.pk] and take_back_events(lost) == 1
    assert loop.job is not None and loop.job.cancelled


def test_a_pool_process_without_a_route_runs_the_sweep_loop(monkeypatch):
    """``project/celery.py``: a pool process that starts no affinity loop (no keeper, or no route) starts a
    sweep loop; one with an affinity loop does not (that loop runs the sweep's round itself)."""
    from hermes_sessions.worker import execution
    from hermes_sessions.worker.warm import kept
    from hermes_sessions.worker.warm import spares as warm
    from project import celery as celery_module

    started: list[str] = []
    monkeypatch.setattr(warm, "spare_pool", lambda: None)
    monkeypatch.setattr(recovery, "sweep_loop_start", lambda by: started.append(by))
    for keeper, affinity_loop, expected in [(None, None, 1), (object(), None, 1), (object(), object(), 0)]:
        started.clear()
        monkeypatch.setattr(kept, "keeper_make", lambda k=keeper: k)
        monkeypatch.setattr(execution, "start_affinity", lambda k, loop=affinity_loop: loop)
        celery_module._start_worker_process()
        assert len(started) == expected, (keeper, affinity_loop)


