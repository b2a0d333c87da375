"""Session affinity: a session's next turn runs on the worker process that keeps its codex thread loaded.

The database side of ``worker/warm/kept.py``. The pieces:

* **a worker's route**: a worker with one pool process (``-c 1`` prefork, or ``-P solo``; it runs
  ``HERMES_WORKER_TURNS`` turns of different sessions at once, ``wake.TurnSlots``) is named
  ``<HERMES_TURN_QUEUE>.<node name>`` (``project/celery.py`` names it in ``HERMES_OWN_ROUTE`` for the pool
  process). Only such a process keeps threads loaded: with more pool processes a turn could not be
  brought to the one holding the thread.
* **its heartbeat** (``TurnWorker``): written every ``HERMES_WORKER_HEARTBEAT_SECONDS`` by a job on the
  scheduler of the process that holds the threads (``AffinityLoop``, ``scheduler.py``), which also closes copies idle past the window
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
import time

from django.conf import settings
from django.db import close_old_connections

from ..services import routing
from ..services.routing import OWN_ROUTE_ENV
from . import wake
from .process import runtime
from .recovery import sweep_loop_start, sweep_round, sweep_round_seconds
from .scheduler import Job, Scheduler
from .warm.kept import Keeper, KeptThread

logger = logging.getLogger(__name__)


class AffinityLoop:
    """The periodic job of a worker process that keeps threads loaded, on its scheduler: every
    ``HERMES_WORKER_HEARTBEAT_SECONDS`` it renews the ``TurnWorker`` heartbeat (with ``wakeable``: whether
    its wake listener listens), closes copies idle past the window (or whose process died) and releases
    copies another worker took (``routing.taken_elsewhere``), deleting their ``WarmThread`` rows where
    they still name this worker; and every ``recovery.sweep_round_seconds()`` it runs the sweep's round
    (``recovery.sweep_round``: expired leases, unclaimed turns, dead workers), named
    ``"worker <route>"``. A round is a few database statements (the scheduler's rule); closing a copy
    idle past the window is its one slower step (~30 ms, at most once per copy)."""

    def __init__(self, keeper: Keeper, queue: str) -> None:
        self.keeper, self.queue = keeper, queue
        self._beat_due = 0.0  # monotonic: the first round beats
        self.job: Job | None = None
        self.yielded = False  # this process gave up its route (``_yield``): no more rounds

    def start(self, scheduler: Scheduler) -> None:
        """Run a round now (its first writes the heartbeat row at once), then every round."""
        self.job = scheduler.every(sweep_round_seconds, self.tick, name="affinity: heartbeat round", slow=True)

    def tick(self) -> None:
        """One round (also called by tests)."""
        if self.yielded:
            return
        now = time.monotonic()
        if now >= self._beat_due:
            self._beat_due = now + float(settings.HERMES_WORKER_HEARTBEAT_SECONDS)
            if not self.beat():
                return
        sweep_round(by=f"worker {self.queue}")

    def beat(self) -> bool:
        """The heartbeat part of a round; ``False`` when this process yielded its route (``_yield``)."""
        gone = self.keeper.expired()
        why = routing.taken_elsewhere(queue=self.queue, kept=self.keeper.kept_threads())
        for session_id, reason in why.items():
            self.keeper.release(session_id, reason=reason)
        if gone:
            routing.warm_thread_forget(queue=self.queue, session_ids=[k.session_id for k in gone])
        refused = routing.worker_heartbeat(queue=self.queue, kept=len(self.keeper.kept_threads()),
                                           wakeable=wake.wake_listening_now())
        if refused:
            self._yield(refused)
            return False
        return True

    def _yield(self, why: str) -> None:
        """Another live worker holds this route's row (``worker_heartbeat``): close every copy kept here,
        stop keeping (``own_route`` is ``""`` in this process from now on: turns delivered here run cold;
        at its stop this worker leaves the other worker's rows alone) and end the job; this process runs
        a ``recovery.SweepLoop`` from then on."""
        logger.error("affinity: %s — this process (pid %s) keeps no thread loaded from now on; give each worker "
                     "its own node name (-n, make worker WORKER_NAME=…)", why, os.getpid())
        os.environ.pop(OWN_ROUTE_ENV, None)
        self.keeper.close_all()
        self.yielded = True
        if self.job is not None:
            self.job.cancel()
        sweep_loop_start(by=f"worker process {os.getpid()}")


def affinity_start(keeper: Keeper) -> AffinityLoop | None:
    """Start this process's ``AffinityLoop`` once (``process.runtime().affinity``); ``None`` without a
    route."""
    queue = routing.own_route()
    if not queue:
        return None
    rt = runtime()
    with rt.lock:
        if rt.affinity is None:
            rt.affinity = AffinityLoop(keeper, queue)
            rt.affinity.start(rt.scheduler)
        return rt.affinity


def affinity_stop(closed: list[KeptThread]) -> None:
    """Worker shutdown: stop the loop (a round under way ends first) and forget this worker's rows
    (``closed``: the copies just closed)."""
    rt = runtime()
    with rt.lock:
        loop, rt.affinity = rt.affinity, None
    if loop is None:
        return
    rt.scheduler.cancel(loop.job, wait=10.0)
    try:
        close_old_connections()
        routing.worker_gone(queue=loop.queue)
    except Exception:  # noqa: BLE001 — the row goes stale and the sweep removes it
        logger.exception("affinity: could not remove worker %s's rows (%s kept threads closed)", loop.queue, len(closed))
