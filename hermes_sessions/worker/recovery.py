"""The periodic sweep (Celery beat, ``tasks.sweep_turns``): nothing stays stuck.

* A ``running`` turn whose lease expired (its worker died: kill -9, OOM, lost host) is taken back:
  queued again and dispatched, up to ``HERMES_MAX_ATTEMPTS`` claims in all, else ``failed`` with the
  reason. The old worker, should it still be alive, can no longer commit (its claim token is gone).
  The re-run resumes the thread and adopts the turn if codex had already completed it. This part
  (``leases_take_back``) also runs in every keeping worker's affinity loop (``affinity.AffinityLoop``),
  every ``HERMES_WORKER_HEARTBEAT_SECONDS``: lease recovery does not depend on beat, which may have
  died with the worker that embedded it (adversary F2). The rest below runs only here, in beat.
* A ``queued`` turn that is its session's next turn and was last sent more than
  ``HERMES_REDISPATCH_SECONDS`` ago is sent again (a task lost with a broker restart).
* ``Idempotency-Key`` rows older than ``HERMES_IDEMPOTENCY_TTL`` are deleted.
* A worker that kept threads loaded and whose heartbeat is older than ``HERMES_WORKER_STALE_SECONDS``
  is removed: its routing rows, its own queue on the broker, and its sessions' queued turns are sent
  again to the shared queue (``workers_sweep``).

Bound: a dead worker's turn is re-run within ``HERMES_LEASE_SECONDS`` + ``HERMES_WORKER_HEARTBEAT_SECONDS``
while a keeping worker lives (else ``HERMES_LEASE_SECONDS`` + ``HERMES_SWEEP_SECONDS``, by beat).

Logs: nothing when it finds nothing to do; otherwise one line per action (a turn taken back, a turn
sent again, old keys deleted; a turn it fails is logged as that turn's end, ``turn_log.py``). Celery's own
per-run lines for this task are dropped by ``project/logfilters.py``.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from ..models import IdempotencyKey, Turn, TurnWorker, WarmThread
from ..services import dispatch, events, routing, turns
from ..services.locks import lock_session_and_turn
from ..services.turn_log import turn_ended_on_commit
from . import own_queues as worker_queues
from .periodic import PeriodicLoop

logger = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: int = 0
    failed: int = 0
    redispatched: int = 0
    keys_deleted: int = 0
    workers_removed: int = 0


def turns_sweep() -> SweepReport:
    """Take back expired claims (``leases_take_back``), re-dispatch stale queued turns, remove stale
    workers, purge old idempotency keys."""
    report = SweepReport()
    now = timezone.now()
    report.requeued, report.failed = leases_take_back(limit=SWEEP_TAKE_BACK_LIMIT, by="sweep")

    stale = now - timedelta(seconds=settings.HERMES_REDISPATCH_SECONDS)
    earlier = Turn.objects.filter(
        session=OuterRef("session"), seq__lt=OuterRef("seq"), status__in=(Turn.Status.QUEUED, Turn.Status.RUNNING)
    )
    heads = (
        Turn.objects.filter(status=Turn.Status.QUEUED)
        .annotate(last_sent=Coalesce("dispatched_at", "created_at"))
        .filter(last_sent__lt=stale)
        .exclude(Exists(earlier))
    )
    for turn_id, last_sent in list(heads.values_list("pk", "last_sent")[:500]):
        with transaction.atomic():
            dispatch.turn_dispatch_on_commit(turn_id)
        report.redispatched += 1
        logger.warning("sweep: turn %s queued at its session's head since %s with no worker; sent again", turn_id, last_sent)

    report.workers_removed = len(workers_sweep())

    ttl = now - timedelta(seconds=settings.HERMES_IDEMPOTENCY_TTL)
    report.keys_deleted, _ = IdempotencyKey.objects.filter(created_at__lt=ttl).delete()
    if report.keys_deleted:
        logger.info("sweep: deleted %s Idempotency-Key rows older than %s s", report.keys_deleted,
                    settings.HERMES_IDEMPOTENCY_TTL)
    return report


# --- expired leases (the sweep, and every worker's affinity loop) ---------------------------------

#: At most this many turns taken back per call: by the sweep (every ``HERMES_SWEEP_SECONDS``) and by
#: each worker's affinity loop (every ``HERMES_WORKER_HEARTBEAT_SECONDS``, ``affinity.AffinityLoop``).
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

    Called by the sweep (beat) *and* by every keeping worker's affinity loop each round, so a dead
    worker's turn comes back within ``HERMES_LEASE_SECONDS`` + ``HERMES_WORKER_HEARTBEAT_SECONDS``
    while any such worker lives — even when the dead one embedded beat (adversary F2). Safe to run
    anywhere at once: the candidates come from one indexed read (``status``, ``lease_expires_at``;
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
        if outcome == "requeued":
            requeued += 1
        elif outcome == "failed":
            failed += 1
    return requeued, failed


class LeaseLoop(PeriodicLoop):
    """A worker process's lease recovery when it runs no affinity loop (more than one turn slot, or
    keeping off): every ``HERMES_WORKER_HEARTBEAT_SECONDS`` (``periodic.PeriodicLoop``), ``leases_take_back``
    of at most ``LOOP_TAKE_BACK_LIMIT`` turns, named ``by`` — so that such a worker, too, takes back a dead
    worker's turns without beat (``affinity.AffinityLoop`` does it for the keeping workers)."""

    name = "hermes-leases"
    what = "lease recovery round"
    tick_at_start = False

    def __init__(self, by: str) -> None:
        self.by = by
        super().__init__()

    def tick(self) -> None:
        leases_take_back(limit=LOOP_TAKE_BACK_LIMIT, by=self.by)


_lease_loop: tuple[int, LeaseLoop] | None = None
_lease_loop_lock = threading.Lock()


def lease_loop_start(*, by: str) -> LeaseLoop:
    """Start this process's ``LeaseLoop`` once (after any fork: a loop of the parent's is not this
    process's); returns it."""
    global _lease_loop
    with _lease_loop_lock:
        if _lease_loop is None or _lease_loop[0] != os.getpid():
            loop = LeaseLoop(by)
            loop.start()
            _lease_loop = (os.getpid(), loop)
        return _lease_loop[1]


def lease_loop_stop() -> None:
    """Worker process shutdown: stop this process's ``LeaseLoop``, if it runs one."""
    global _lease_loop
    with _lease_loop_lock:
        loop, _lease_loop = _lease_loop, None
    if loop is not None and loop[0] == os.getpid():
        loop[1].stop()


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

def workers_sweep() -> list[str]:
    """Remove workers whose heartbeat is older than ``HERMES_WORKER_STALE_SECONDS``: delete their
    sessions' ``WarmThread`` rows, send those sessions' queued head turns again (shared queue), delete
    their queue from the broker, delete their row. Returns the queues removed."""
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
                dispatch.turn_dispatch_on_commit(turn_id)
            TurnWorker.objects.filter(queue=queue, heartbeat_at__lt=stale_before).delete()
        purged = worker_queues.queue_delete(queue)
        logger.warning("sweep: worker queue %s has had no heartbeat since before %s: removed (%s warm sessions, "
                       "%s queued turns sent again, %s messages dropped from its queue)",
                       queue, stale_before, len(sessions), len(heads), purged)
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

