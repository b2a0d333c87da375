"""The sweep: nothing stays stuck. Path 3 of the delivery table (docs/architecture.md §4).

Every worker process runs ``sweep_round`` every ``sweep_round_seconds()`` (≤ 1 s) as a job on its
scheduler thread (``affinity.AffinityLoop`` or ``SweepLoop``, ``scheduler.py``), and Celery beat runs ``turns_sweep`` (the same, with larger
limits, plus the ``Idempotency-Key`` purge) every ``HERMES_SWEEP_SECONDS``:

* A ``running`` turn whose lease expired (its worker died: kill -9, OOM, lost host) is taken back:
  queued again and dispatched, up to ``HERMES_MAX_ATTEMPTS`` claims in all, else ``failed`` with the
  reason. The old worker, should it still be alive, can no longer commit (its claim token is gone).
  The re-run resumes the thread and adopts the turn if codex had already completed it
  (``leases_take_back``).
* A ``queued`` turn that is its session's next is dispatched to the shared queue
  (``turns_dispatch_unclaimed``) when nothing is on its way to a worker: no dispatch recorded
  (``dispatched_at`` NULL: a send that failed, or a delivery that reached a process busy with a woken
  turn); its session's holder was notified more than ``HERMES_AFFINITY_DEADLINE`` ago and has not
  claimed it (busy, frozen, dead, or the wake was lost) — the session's ``WarmThread`` row is deleted, so
  the turn goes cold; or it was dispatched more than ``HERMES_REDISPATCH_SECONDS`` ago (a message lost
  with the broker, or with an API process that died between its commit and its send).
* A worker that kept threads loaded and whose heartbeat is older than ``HERMES_WORKER_STALE_SECONDS``
  is removed: its routing rows, and its sessions' queued turns are dispatched to the shared queue
  (``workers_sweep``).
* ``Idempotency-Key`` rows older than ``HERMES_IDEMPOTENCY_TTL`` are deleted (beat only).
* Due webhook deliveries are claimed and their sending task sent (``webhooks.webhooks_dispatch_due``).

Each action locks its rows ``SKIP LOCKED`` and checks again under the lock, so any number of callers may
run at once; the candidates come from one indexed read each (``status``), nothing else when none is due.

Bounds: a dead worker's turn is re-run within ``HERMES_LEASE_SECONDS`` + one round while any worker
lives; a holder's turn goes cold within ``HERMES_AFFINITY_DEADLINE`` + one round.

Logs: nothing when it finds nothing to do; otherwise one line per action (a turn taken back, a turn
dispatched, old keys deleted; a turn it fails is logged as that turn's end, ``turn_log.py``). Celery's own
per-run lines for this task are dropped by ``project/logfilters.py``.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from ..metrics.process import lease_taken_back
from ..models import IdempotencyKey, Turn, TurnWorker, WarmThread
from ..services import approvals, dispatch, events, routing, turns
from ..services.locks import lock_session_and_turn
from ..services.turn_log import turn_ended_on_commit
from .process import runtime
from .scheduler import Job, Scheduler
from .webhooks import webhooks_dispatch_due

logger = logging.getLogger(__name__)

#: A holder that has not claimed its woken turn by ``HERMES_AFFINITY_DEADLINE`` loses it to the shared
#: queue at the next round: logged with these words (``make faults``' freeze-warm-holder counts them).
HANDED_TO_SHARED_QUEUE = "not claimed within HERMES_AFFINITY_DEADLINE by the worker holding its thread"


@dataclass
class SweepReport:
    requeued: int = 0
    failed: int = 0
    redispatched: int = 0
    keys_deleted: int = 0
    workers_removed: int = 0
    webhooks_claimed: int = 0


def sweep_round_seconds() -> float:
    """How often each worker process runs ``sweep_round``: ``HERMES_WORKER_HEARTBEAT_SECONDS``, at most 1 s."""
    return min(1.0, float(settings.HERMES_WORKER_HEARTBEAT_SECONDS))


def sweep_round(*, by: str, limit: int = 20) -> SweepReport:
    """One round of the sweep (module docstring), at most ``limit`` turns of each kind; ``by`` names the
    caller in the log lines (``"sweep"``, ``"worker <route>"``)."""
    report = SweepReport()
    report.requeued, report.failed = leases_take_back(limit=limit, by=by)
    report.redispatched = turns_dispatch_unclaimed(limit=limit, by=by)
    report.workers_removed = len(workers_sweep(by=by))
    report.webhooks_claimed = webhooks_dispatch_due()
    return report


def turns_sweep() -> SweepReport:
    """Celery beat's sweep (``tasks.sweep_turns``): ``sweep_round`` with larger limits, and old
    ``Idempotency-Key`` rows purged."""
    report = sweep_round(by="sweep", limit=SWEEP_TAKE_BACK_LIMIT)
    ttl = timezone.now() - timedelta(seconds=settings.HERMES_IDEMPOTENCY_TTL)
    report.keys_deleted, _ = IdempotencyKey.objects.filter(created_at__lt=ttl).delete()
    if report.keys_deleted:
        logger.info("sweep: deleted %s Idempotency-Key rows older than %s s", report.keys_deleted,
                    settings.HERMES_IDEMPOTENCY_TTL)
    return report


# --- queued turns nothing is on its way for ----------------------------------------------------

def _unclaimed_q(now: datetime) -> Q:
    """The dispatch of a queued turn is over due (``turns_dispatch_unclaimed``); needs ``routed``."""
    return (Q(dispatched_at__isnull=True)
            | Q(dispatched_at__lt=now - timedelta(seconds=settings.HERMES_REDISPATCH_SECONDS))
            | Q(routed=True, dispatched_at__lt=now - timedelta(seconds=settings.HERMES_AFFINITY_DEADLINE)))


def turns_dispatch_unclaimed(*, limit: int, by: str) -> int:
    """Dispatch to the shared queue up to ``limit`` queued turns that are their session's next and that
    nothing is on its way for (module docstring); how many. A routed one's ``WarmThread`` row is deleted
    in the same transaction: it runs cold on whichever worker takes it."""
    now = timezone.now()
    earlier = Turn.objects.filter(session=OuterRef("session"), seq__lt=OuterRef("seq"),
                                  status__in=(Turn.Status.QUEUED, Turn.Status.RUNNING))
    heads = (Turn.objects.filter(status=Turn.Status.QUEUED)
             .annotate(routed=Exists(WarmThread.objects.filter(session=OuterRef("session"))))
             .filter(_unclaimed_q(now)).exclude(Exists(earlier)))
    sent = 0
    for turn_id in list(heads.order_by("created_at").values_list("pk", flat=True)[:limit]):
        sent += _dispatch_unclaimed(turn_id, by=by)
    return sent


def _dispatch_unclaimed(turn_id: uuid.UUID, *, by: str) -> int:
    """``turns_dispatch_unclaimed`` of one turn, checked again under its row lock (``SKIP LOCKED``: a turn
    another caller is dispatching, or a claim is taking, is left to them); 1 when dispatched."""
    now = timezone.now()
    with transaction.atomic():
        turn = (Turn.objects.select_for_update(skip_locked=True).filter(pk=turn_id, status=Turn.Status.QUEUED)
                .values("session_id", "dispatched_at").first())
        if turn is None:
            return 0
        warm = (WarmThread.objects.select_for_update(skip_locked=True).filter(session_id=turn["session_id"])
                .values_list("queue", flat=True).first())
        sent_at = turn["dispatched_at"]
        if sent_at is None:
            why = "had no dispatch on its way (a failed send, or a worker process busy with a woken turn)"
        elif sent_at < now - timedelta(seconds=settings.HERMES_REDISPATCH_SECONDS):
            why = f"queued at its session's head since {sent_at} with no worker"
        elif warm is not None and sent_at < now - timedelta(seconds=settings.HERMES_AFFINITY_DEADLINE):
            why = f"was {HANDED_TO_SHARED_QUEUE} ({warm})"
        else:
            return 0  # dispatched meanwhile, or its WarmThread row is being written
        if warm is not None:
            WarmThread.objects.filter(session_id=turn["session_id"]).delete()  # it goes cold
        dispatch.turn_dispatch_on_commit(turn_id, wake=False)
    # A delivery refused by a busy process is routine under load (INFO); the others mean a message or a
    # holder was lost (WARNING).
    logger.log(logging.INFO if sent_at is None else logging.WARNING,
               "%s: turn %s %s; dispatched to the shared queue (session %s)", by, turn_id, why, turn["session_id"])
    return 1


# --- expired leases ------------------------------------------------------------------------------

#: At most this many turns of each kind per call by beat's sweep (every ``HERMES_SWEEP_SECONDS``); a
#: worker's round takes ``LOOP_TAKE_BACK_LIMIT``.
SWEEP_TAKE_BACK_LIMIT = 500
LOOP_TAKE_BACK_LIMIT = 20

_renewed_here: set[uuid.UUID] = set()
_renewed_here_lock = threading.Lock()


def lease_renewed_here(token: uuid.UUID, *, renewing: bool) -> None:
    """Register (``renewing=True``) or drop the claim ``token`` whose lease a thread of this process
    renews (``heartbeats.TurnHeartbeats.beating``, for the turn's run). ``leases_take_back`` in this process
    never takes such a turn back: a process whose threads all stalled (SIGSTOP, a paused VM) wakes with
    its own turn's lease expired, and its affinity loop may run before the turn's heartbeat renews it —
    the turn is alive, its own heartbeat decides (it stops the turn if another process took it back)."""
    with _renewed_here_lock:
        if renewing:
            _renewed_here.add(token)
        else:
            _renewed_here.discard(token)


def leases_take_back(*, limit: int, by: str) -> tuple[int, int]:
    """Take back up to ``limit`` running turns whose lease expired (their worker died: kill -9, OOM,
    a lost host): each is requeued, or failed past ``HERMES_MAX_ATTEMPTS`` (``_take_back``). Returns
    ``(requeued, failed)``. ``by`` names the caller in the log lines (``"sweep"``, ``"worker <queue>"``).

    Called by the sweep (beat) *and* by every worker process's round (``sweep_round``), so a dead
    worker's turn comes back within ``HERMES_LEASE_SECONDS`` + ``HERMES_WORKER_HEARTBEAT_SECONDS``
    while any worker lives — even when the dead one embedded beat (``make faults`` kill-beat-with-worker).
    Safe to run anywhere at once: the candidates come from one indexed read (``status``, ``lease_expires_at``;
    nothing else when none expired), and each take-back locks its rows ``SKIP LOCKED`` in its own
    durable transaction and checks again under the lock — a row another caller is taking back is
    skipped (no wait), one already taken back or renewed meanwhile is left alone. Expiry is judged by
    the database's clock (``Now()``), not this process's: a caller whose clock runs ahead takes nothing
    early. Turns whose lease this process renews (``lease_renewed_here``) are never taken."""
    expired = Turn.objects.filter(status=Turn.Status.RUNNING, lease_expires_at__lt=Now())
    with _renewed_here_lock:
        mine = list(_renewed_here)
    if mine:
        expired = expired.exclude(claim_token__in=mine)
    requeued = failed = 0
    for turn_id in list(expired.order_by("lease_expires_at").values_list("pk", flat=True)[:limit]):
        outcome = _take_back(turn_id, by=by)
        if outcome in ("requeued", "failed"):  # committed (its own durable transaction)
            lease_taken_back(outcome)
        if outcome == "requeued":
            requeued += 1
        elif outcome == "failed":
            failed += 1
    return requeued, failed


class SweepLoop:
    """A worker process's sweep when it runs no affinity loop (more than one pool process, or keeping off):
    ``sweep_round`` every ``sweep_round_seconds()``, named ``by``, as a job on the process's scheduler
    (``scheduler.py``) — so that such a worker, too, takes back a dead worker's turns and dispatches
    unclaimed ones without beat (``affinity.AffinityLoop`` does it for the keeping workers)."""

    def __init__(self, by: str) -> None:
        self.by = by
        self.job: Job | None = None

    def tick(self) -> None:
        sweep_round(by=self.by)

    def start(self, scheduler: Scheduler) -> None:
        self.job = scheduler.every(sweep_round_seconds, self.tick, name="sweep round",
                                   first_after=sweep_round_seconds(), slow=True)


def sweep_loop_start(*, by: str) -> SweepLoop:
    """Start this process's ``SweepLoop`` once (``process.runtime().sweep``); returns it."""
    rt = runtime()
    with rt.lock:
        if rt.sweep is None:
            rt.sweep = SweepLoop(by)
            rt.sweep.start(rt.scheduler)
        return rt.sweep


def sweep_loop_stop() -> None:
    """Worker process shutdown: stop this process's ``SweepLoop``, if it runs one (a round under way
    ends first)."""
    rt = runtime()
    with rt.lock:
        loop, rt.sweep = rt.sweep, None
    if loop is not None:
        rt.scheduler.cancel(loop.job, wait=10.0)


def _take_back(turn_id: uuid.UUID, *, by: str = "sweep") -> str:
    """Requeue (or, past ``HERMES_MAX_ATTEMPTS``, fail) a running turn whose lease expired; returns
    ``"requeued"``, ``"failed"``, ``"cancelled"`` (its user cancelled it meanwhile: it ends so, not
    requeued) or ``""`` (renewed or finished meanwhile, or its rows are locked — by
    another caller taking it back, or by a writer that ends soon: the next round sees). A durable
    transaction; its locks are ``SKIP LOCKED`` (``lock_session_and_turn``)."""
    with transaction.atomic(durable=True):
        locked = lock_session_and_turn(turn_id, skip_locked=True)
        if locked is None:
            return ""
        session, turn = locked
        if turn.status != Turn.Status.RUNNING or turn.lease_expires_at is None:
            return ""  # finished or taken back meanwhile
        if not Turn.objects.filter(pk=turn.pk, lease_expires_at__lt=Now()).exists():
            return ""  # renewed meanwhile (by the database's clock, as the selection)
        lost_at = turn.lease_expires_at
        if turn.cancel_requested_at is not None:
            # Its user cancelled it meanwhile: it ends now, not queued again to be cancelled at the claim.
            turns.turn_end_cancelled_unrun(session, turn)
            logger.warning("%s: turn %s: worker lost (lease expired %s); cancelled, as its user asked", by, turn.pk,
                           lost_at)
            return "cancelled"
        turn.claim_token = None
        turn.lease_expires_at = None
        if turn.attempt >= settings.HERMES_MAX_ATTEMPTS:
            turn.status = Turn.Status.FAILED
            turn.finished_at = timezone.now()
            turn.error = (
                f"the worker running this turn was lost {turn.attempt} time(s) (last lease expired {lost_at:%Y-%m-%d %H:%M:%S} UTC);"
                " giving up — the binding is kept"
            )
            turn.save(update_fields=["status", "finished_at", "error", "claim_token", "lease_expires_at"])
            approvals.approvals_close_for_turn(turn=turn, reason="the turn failed: its worker was lost")
            events.event_terminal(turn=turn)
            dispatch.session_dispatch_next_on_commit(session)
            turn_ended_on_commit(turn)  # this action's one line (hermes_sessions.turns)
            return "failed"
        turn.status = Turn.Status.QUEUED
        turn.save(update_fields=["status", "claim_token", "lease_expires_at"])
        events.event_append(turn=turn, kind=events.RETRYING, data={
            "reason": f"the worker running attempt {turn.attempt} was lost (lease expired); queued again",
            "requeued": True})
        dispatch.turn_dispatch_on_commit(turn.pk)
        logger.warning("%s: turn %s: worker lost (lease expired %s); queued again (attempt %s next)", by, turn.pk, lost_at,
                       turn.attempt + 1)
        return "requeued"


# --- dead workers (session affinity, worker/affinity.py) ---------------------------------------

def workers_sweep(*, by: str = "sweep") -> list[str]:
    """Remove workers whose heartbeat is older than ``HERMES_WORKER_STALE_SECONDS``: delete their
    sessions' ``WarmThread`` rows, dispatch those sessions' queued head turns to the shared queue, delete
    their row. Returns the routes removed."""
    stale_before = timezone.now() - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
    removed = []
    for queue in list(TurnWorker.objects.filter(heartbeat_at__lt=stale_before).values_list("queue", flat=True)[:100]):
        with transaction.atomic():
            # Re-checked under the row lock: a worker whose heartbeat came back meanwhile keeps everything.
            # skip_locked: a row another transaction holds is being written (a heartbeat, a clean stop) — and
            # one held by a process frozen mid-transaction must not stall the whole sweep; next round.
            if not TurnWorker.objects.select_for_update(skip_locked=True).filter(
                    queue=queue, heartbeat_at__lt=stale_before).exists():
                continue
            sessions = list(WarmThread.objects.filter(queue=queue).values_list("session_id", flat=True))
            routing.warm_thread_forget(queue=queue)
            heads = _queued_heads(sessions)
            for turn_id in heads:
                dispatch.turn_dispatch_on_commit(turn_id, wake=False)
            TurnWorker.objects.filter(queue=queue, heartbeat_at__lt=stale_before).delete()
        logger.warning("%s: worker %s has had no heartbeat since before %s: removed (%s warm sessions, "
                       "%s queued turns dispatched to the shared queue)", by, queue, stale_before, len(sessions),
                       len(heads))
        removed.append(queue)
    return removed


def _queued_heads(session_ids: list[str]) -> list[uuid.UUID]:
    """The oldest queued turn of each of ``session_ids`` that has no running turn."""
    heads = []
    for session_id in session_ids:
        if Turn.objects.filter(session_id=session_id, status=Turn.Status.RUNNING).exists():
            continue
        first = Turn.objects.filter(session_id=session_id, status=Turn.Status.QUEUED).order_by("seq").values_list(
            "pk", flat=True).first()
        if first is not None:
            heads.append(first)
    return heads

