"""Session affinity: a session's next turn runs on the worker process that keeps its codex thread loaded.

The database side of ``worker/warm/kept.py``. The pieces:

* **a worker's route**: a worker that runs one turn at a time (``-c 1`` prefork, or ``-P solo``) is named
  ``<HERMES_TURN_QUEUE>.<node name>`` (``project/celery.py`` names it in ``HERMES_OWN_ROUTE`` for the pool
  process). Only such a process keeps threads loaded: with more pool processes a turn could not be
  brought to the one holding the thread.
* **its heartbeat** (``TurnWorker``): written every ``HERMES_WORKER_HEARTBEAT_SECONDS`` by a thread of
  the process that holds the threads (``AffinityLoop``), which also closes copies idle past the window
  and releases those whose session another worker took (its ``WarmThread`` row names another route or
  is gone, or the stored generation moved on), and says whether its wake listener listens.
* **the wake** (``wake.py``): the enqueue of a turn whose session's ``WarmThread`` names a worker with a
  fresh heartbeat and a listening listener sends ``NOTIFY`` to that worker in its transaction; no Celery
  message. Whatever that worker does not claim within ``HERMES_AFFINITY_DEADLINE`` — busy, frozen, dead,
  the wake lost — the sweep (``recovery.turns_dispatch_unclaimed``, every worker's round) dispatches
  to the shared queue, and the turn runs cold on any worker.
* **the sweep** (``recovery.workers_sweep``): a worker whose heartbeat is older than
  ``HERMES_WORKER_STALE_SECONDS`` is gone (kill -9, lost host): its sessions' ``WarmThread`` rows are
  deleted, the queued head turns of those sessions are dispatched and its row removed.

Facts: ``docs/codex.md`` §11 (a loaded thread skips the ~1 s resume under a permission profile).
"""
from __future__ import annotations

import logging
import os
import threading
import time

from django.conf import settings
from django.db import close_old_connections

from ..services import routing
from ..services.routing import OWN_ROUTE_ENV
from . import wake
from .periodic import PeriodicLoop
from .recovery import sweep_loop_start, sweep_round, sweep_round_seconds
from .warm.kept import Keeper, KeptThread

logger = logging.getLogger(__name__)


class AffinityLoop(PeriodicLoop):
    """The loop thread of a worker process that keeps threads loaded: every
    ``HERMES_WORKER_HEARTBEAT_SECONDS`` it renews the ``TurnWorker`` heartbeat (with ``wakeable``: whether
    its wake listener listens), closes copies idle past the window (or whose process died) and releases
    copies another worker took (``routing.taken_elsewhere``), deleting their ``WarmThread`` rows where
    they still name this worker; and every ``recovery.sweep_round_seconds()`` it runs the sweep's round
    (``recovery.sweep_round``: expired leases, unclaimed turns, dead workers), named
    ``"worker <route>"``. Own database connection."""

    name = "hermes-affinity"
    what = "affinity: heartbeat round"  # a failed round: the next round tries again

    def __init__(self, keeper: Keeper, queue: str) -> None:
        self.keeper, self.queue = keeper, queue
        self._beat_due = 0.0  # monotonic: the first round beats
        super().__init__()

    def interval(self) -> float:
        return sweep_round_seconds()

    def tick(self) -> None:
        """One round (also called by tests)."""
        now = time.monotonic()
        if now >= self._beat_due:
            self._beat_due = now + float(settings.HERMES_WORKER_HEARTBEAT_SECONDS)
            if not self.beat():
                return
        sweep_round(by=f"worker {self.queue}")

    def beat(self) -> bool:
        """The heartbeat part of a round; ``False`` when this process yielded its route (``_yield``)."""
        gone = self.keeper.expired()
        why = routing.taken_elsewhere(queue=self.queue, held=self.keeper.held())
        for session_id, reason in why.items():
            self.keeper.release(session_id, reason=reason)
        if gone:
            routing.warm_thread_forget(queue=self.queue, session_ids=[k.session_id for k in gone])
        refused = routing.worker_heartbeat(queue=self.queue, kept=len(self.keeper.held()), wakeable=wake.wake_listening_now())
        if refused:
            self._yield(refused)
            return False
        return True

    def _yield(self, why: str) -> None:
        """Another live worker holds this route's row (``worker_heartbeat``): close every copy kept here,
        stop keeping (``own_route`` is ``""`` in this process from now on: turns delivered here run cold;
        at its stop this worker leaves the other worker's rows alone) and end the loop; this process runs
        a ``recovery.SweepLoop`` from then on."""
        logger.error("affinity: %s — this process (pid %s) keeps no thread loaded from now on; give each worker "
                     "its own node name (-n, make worker WORKER_NAME=…)", why, os.getpid())
        os.environ.pop(OWN_ROUTE_ENV, None)
        self.keeper.close_all()
        self._stop.set()
        sweep_loop_start(by=f"worker process {os.getpid()}")


_loop: tuple[int, AffinityLoop] | None = None
_loop_lock = threading.Lock()


def affinity_start(keeper: Keeper) -> AffinityLoop | None:
    """Start this process's ``AffinityLoop`` once (after any fork); ``None`` without a route."""
    global _loop
    queue = routing.own_route()
    if not queue:
        return None
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = AffinityLoop(keeper, queue)
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
