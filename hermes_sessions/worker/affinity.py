"""Session affinity: send a session's next turn to the worker that keeps its codex thread loaded.

The database side of ``worker/warm/kept.py``. The pieces:

* **a worker's own queue**: a worker that runs one turn at a time (``-c 1`` prefork, or ``-P solo``)
  also consumes ``<HERMES_TURN_QUEUE>.<node name>`` (``project/celery.py`` adds it at start and names it
  in ``HERMES_OWN_QUEUE`` for the pool process). Only such a process keeps threads loaded: with more
  pool processes the queue could not reach the one holding the thread (Celery's prefork children
  cannot be addressed one by one; README "Warm turns").
* **its heartbeat** (``TurnWorker``): written every ``HERMES_WORKER_HEARTBEAT_SECONDS`` by a thread of
  the process that holds the threads (``AffinityLoop``), which also closes copies idle past the window
  and releases those whose session another worker took (its ``WarmThread`` row names another queue or
  is gone, or the stored generation moved on).
* **routing** (``turn_route``): a turn goes to the own queue of the worker named by its session's
  ``WarmThread`` while that row's window is open and that worker's heartbeat is fresh, *and* to the
  shared queue ``HERMES_AFFINITY_DEADLINE`` seconds later (a Celery countdown): whichever delivery
  claims first runs it, the other finds it taken and does nothing (``turn_claim``), and a queue nobody
  consumes holds only duplicates. A busy holder also hands off a turn it has not claimed by the deadline
  (``AffinityLoop``, ``overdue_turns``): the countdown copy may sit reserved behind another worker's turn.
* **the sweep** (``recovery.workers_sweep``): a worker whose heartbeat is older than
  ``HERMES_WORKER_STALE_SECONDS`` is gone (kill -9, lost host): its sessions' ``WarmThread`` rows are
  deleted, the queued head turns of those sessions are sent again (to the shared queue), its queue is
  deleted from the broker and its row removed (``../shared/pitfalls.md``, routing table).
* **lease recovery**: each loop round also takes back running turns whose lease expired
  (``recovery.leases_take_back``, shared with the sweep), so a dead worker's turns return to the queue
  while any keeping worker lives, beat or no beat.

Facts: ``docs/codex.md`` §11 (a loaded thread skips the ~1 s resume under a permission profile).
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable

from django.conf import settings
from django.db import close_old_connections, transaction

from ..models import TurnWorker, WarmThread
from ..services import routing
from ..services.routing import OWN_QUEUE_ENV
from . import wake
from .periodic import PeriodicLoop
from .warm.kept import Keeper, KeptThread

logger = logging.getLogger(__name__)











































def hand_off(*, session_id: str, turn_id: uuid.UUID, queue: str | None, redispatch: Callable[[uuid.UUID], None]) -> bool:
    """Delete the session's ``WarmThread`` row (only if it still names ``queue``; any queue when ``None``)
    and send turn ``turn_id`` again with ``redispatch`` (after the commit: to the shared queue, the row
    being gone), in one transaction; ``False`` when the row is gone or locked — another worker's loop is
    handing it off, or a finalize is rewriting it."""
    with transaction.atomic():
        rows = WarmThread.objects.select_for_update(skip_locked=True).filter(session_id=session_id)
        if queue is not None:
            rows = rows.filter(queue=queue)
        row = rows.values_list("queue", flat=True).first()
        if row is None:
            return False
        WarmThread.objects.filter(session_id=session_id).delete()
        redispatch(turn_id)
    return True






class AffinityLoop(PeriodicLoop):
    """The thread of a worker process that keeps threads loaded: every
    ``HERMES_WORKER_HEARTBEAT_SECONDS`` it renews the ``TurnWorker`` heartbeat, closes copies idle past
    the window (or whose process died) and releases copies another worker took (``taken_elsewhere``),
    deleting their ``WarmThread`` rows where they still name this worker; and hands off the turns of its
    sessions that it has not claimed within ``HERMES_AFFINITY_DEADLINE`` (``overdue_turns``: this process
    is busy with another session's turn), and those of any worker whose heartbeat stopped
    (``stalled_holder_turns``: frozen or dead) — the copy is closed, the row deleted and the turn sent again with
    ``redispatch`` (``dispatch.turn_dispatch_on_commit``, given by the caller: this module must not import
    dispatch, which imports it), now to the shared queue. The deadline's countdown copy alone is not enough:
    an idle worker may reserve it and then start a long turn before it is due (found by an adversary).
    With ``take_back_leases`` (``recovery.leases_take_back``, given by the caller like ``redispatch``:
    recovery imports this module) it also takes back the running turns whose lease expired, any worker's,
    as the sweep does: a worker killed -9 with beat embedded leaves its turns to the live workers, not to
    beat's return (adversary F2); it is called with ``by="worker <queue>"``. Own database connection."""

    name = "hermes-affinity"
    what = "affinity: heartbeat round"  # a failed round: routing has the deadline, the next round tries again

    def __init__(self, keeper: Keeper, queue: str, redispatch: Callable[[uuid.UUID], None] | None = None,
                 take_back_leases: Callable[[str], object] | None = None) -> None:
        self.keeper, self.queue, self.redispatch = keeper, queue, redispatch
        self.take_back_leases = take_back_leases
        self.beaten = False  # a heartbeat of this loop's was written
        super().__init__()

    def tick(self) -> None:
        """One round (also called by tests)."""
        gone = self.keeper.expired()
        why = routing.taken_elsewhere(queue=self.queue, held=self.keeper.held())
        for session_id, reason in why.items():
            self.keeper.release(session_id, reason=reason)
        if gone:
            routing.warm_thread_forget(queue=self.queue, session_ids=[k.session_id for k in gone])
        if self.redispatch is not None:
            for session_id, turn_id in routing.overdue_turns(queue=self.queue):
                self.keeper.release(session_id, reason=f"its turn {turn_id} waited past HERMES_AFFINITY_DEADLINE "
                                                       "for this busy worker: handed to any worker")
                hand_off(session_id=session_id, turn_id=turn_id, queue=self.queue, redispatch=self.redispatch)
            for session_id, turn_id in routing.stalled_holder_turns():
                if hand_off(session_id=session_id, turn_id=turn_id, queue=None, redispatch=self.redispatch):
                    logger.warning("affinity: turn %s of session %s waited past HERMES_AFFINITY_DEADLINE for a worker "
                                   "whose heartbeat stopped: handed to any worker", turn_id, session_id)
        swept = self.beaten and not TurnWorker.objects.filter(queue=self.queue).exists()
        refused = routing.worker_heartbeat(queue=self.queue, kept=len(self.keeper.held()), wakeable=wake.wake_listening_now())
        if refused:
            self._yield(refused)
            return
        self.beaten = True
        if swept:
            self._consume_again()
        if self.take_back_leases is not None:
            # After the heartbeat, so a failure here never delays it; each turn taken back logs its own
            # line, naming this worker.
            self.take_back_leases(f"worker {self.queue}")

    def _consume_again(self) -> None:
        """This worker's row was gone: it was swept while frozen or stalled past
        ``HERMES_WORKER_STALE_SECONDS``, which deleted its own queue and both its bindings from the broker
        (``worker_queues.queue_delete``). Turns routed to the queue would be dropped or never read, each
        waiting for its countdown copy. So the queue is declared again in both forms
        (``worker_queues.queue_declare``) — on Redis that is all it takes: the worker's consumer never
        stopped polling the list. On RabbitMQ the deletion also cancelled the consumer, so this worker's
        main process is asked (Celery's remote control) to stop and start consuming it: the cancel is
        awaited before the add is sent — two broadcasts sent back to back may arrive in either order (the
        adversary saw the add land first, a no-op, and the cancel then end the consuming for good)."""
        from celery import current_app

        from .own_queues import queue_declare, queue_is_redis

        node = self.queue[len(settings.HERMES_TURN_QUEUE) + 1:]
        logger.warning("affinity: worker %s had been swept (its heartbeat stopped for longer than "
                       "HERMES_WORKER_STALE_SECONDS); consuming its queue %s again", node, self.queue)
        try:
            queue_declare(self.queue)
            if queue_is_redis():
                return
            control = current_app.control
            if not control.cancel_consumer(self.queue, destination=[node], reply=True, timeout=5.0):
                raise RuntimeError("no answer to cancel_consumer")
            answers = control.add_consumer(self.queue, destination=[node], reply=True, timeout=5.0)
            if not answers:
                raise RuntimeError("no answer to add_consumer")
        except Exception:  # noqa: BLE001 — the broker is away: turns reach it by the countdown copy meanwhile
            logger.exception("affinity: could not have worker %s consume %s again", node, self.queue)

    def _yield(self, why: str) -> None:
        """Another live worker holds this queue's row (``worker_heartbeat``): close every copy kept here,
        stop keeping (``own_queue`` is ``""`` in this process from now on: turns still delivered here run
        cold; at its stop this worker deletes neither the queue nor the other worker's rows) and end the
        loop."""
        logger.error("affinity: %s — this process (pid %s) keeps no thread loaded from now on; give each worker "
                     "its own node name (-n, make worker WORKER_NAME=…)", why, os.getpid())
        os.environ.pop(OWN_QUEUE_ENV, None)
        self.keeper.close_all()
        self._stop.set()

_loop: tuple[int, AffinityLoop] | None = None
_loop_lock = threading.Lock()


def affinity_start(keeper: Keeper, redispatch: Callable[[uuid.UUID], None] | None = None,
                   take_back_leases: Callable[[str], object] | None = None) -> AffinityLoop | None:
    """Start this process's ``AffinityLoop`` once (after any fork); ``None`` without an own queue.
    ``redispatch``: how to send a handed-off turn again (``dispatch.turn_dispatch_on_commit``);
    ``take_back_leases``: how to take back expired leases each round (``recovery.leases_take_back``)."""
    global _loop
    queue = routing.own_queue()
    if not queue:
        return None
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = AffinityLoop(keeper, queue, redispatch, take_back_leases)
            loop.start()  # its first round writes the heartbeat row at once (on its own connection)
            _loop = (os.getpid(), loop)
        return _loop[1]


def affinity_stop(closed: list[KeptThread]) -> None:
    """Worker shutdown: stop the loop and forget this worker's rows (``closed``: the copies just closed)."""
    global _loop
    with _loop_lock:
        loop, _loop = _loop, None
    if loop is None or loop[0] != os.getpid():
        return
    loop[1].stop()
    try:
        close_old_connections()
        routing.worker_gone(queue=loop[1].queue)
    except Exception:  # noqa: BLE001 — the row goes stale and the sweep removes it
        logger.exception("affinity: could not remove worker %s's rows (%s kept threads closed)", loop[1].queue, len(closed))
