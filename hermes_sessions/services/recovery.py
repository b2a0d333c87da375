"""The periodic sweep (Celery beat, ``tasks.sweep_turns``): nothing stays stuck.

* A ``running`` turn whose lease expired (its worker died: kill -9, OOM, lost host) is taken back:
  queued again and dispatched, up to ``HERMES_MAX_ATTEMPTS`` claims in all, else ``failed`` with the
  reason. The old worker, should it still be alive, can no longer commit (its claim token is gone).
  The re-run resumes the thread and adopts the turn if codex had already completed it.
* A ``queued`` turn that is its session's next turn and was last sent more than
  ``HERMES_REDISPATCH_SECONDS`` ago is sent again (a task lost with a broker restart).
* ``Idempotency-Key`` rows older than ``HERMES_IDEMPOTENCY_TTL`` are deleted.
* A worker that kept threads loaded and whose heartbeat is older than ``HERMES_WORKER_STALE_SECONDS``
  is removed: its routing rows, its own queue on the broker, and its sessions' queued turns are sent
  again to the shared queue (``workers_sweep``).

Bound: a dead worker's turn is re-run within ``HERMES_LEASE_SECONDS`` + ``HERMES_SWEEP_SECONDS``.

Logs: nothing when it finds nothing to do; otherwise one line per action (a turn taken back, a turn
sent again, old keys deleted; a turn it fails is logged as that turn's end, ``turn_log.py``). Celery's own
per-run lines for this task are dropped by ``project/logfilters.py``.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.db.models.functions import Coalesce
from django.utils import timezone

from ..models import IdempotencyKey, Turn, TurnWorker, WarmThread
from . import affinity, dispatch, events, worker_queues
from .locks import lock_session_and_turn
from .turn_log import turn_ended_on_commit

logger = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: int = 0
    failed: int = 0
    redispatched: int = 0
    keys_deleted: int = 0
    workers_removed: int = 0


def turns_sweep() -> SweepReport:
    """Take back expired claims, re-dispatch stale queued turns, purge old idempotency keys."""
    report = SweepReport()
    now = timezone.now()
    expired = Turn.objects.filter(status=Turn.Status.RUNNING, lease_expires_at__lt=now).values_list("pk", flat=True)
    for turn_id in list(expired[:500]):
        outcome = _take_back(turn_id)
        if outcome == "requeued":
            report.requeued += 1
        elif outcome == "failed":
            report.failed += 1

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


def _take_back(turn_id: uuid.UUID) -> str:
    """Requeue (or, past ``HERMES_MAX_ATTEMPTS``, fail) a running turn whose lease expired; returns
    ``"requeued"``, ``"failed"`` or ``""`` (renewed or finished meanwhile). A durable transaction."""
    with transaction.atomic(durable=True):
        locked = lock_session_and_turn(turn_id)
        if locked is None:
            return ""
        session, turn = locked
        if turn.status != Turn.Status.RUNNING or turn.lease_expires_at is None or turn.lease_expires_at >= timezone.now():
            return ""  # renewed or finished meanwhile
        lost_at = turn.lease_expires_at
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
        logger.warning("sweep: turn %s: worker lost (lease expired %s); queued again (attempt %s next)", turn.pk, lost_at, turn.attempt + 1)
        return "requeued"


# --- dead workers (session affinity, services/affinity.py) ---------------------------------------

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
            affinity.warm_thread_forget(queue=queue)
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

