"""The one entry point of a worker process's runtime: ``start()`` and ``stop()``, and its state (``Runtime``).

``project/celery.py`` calls ``start()`` when a pool process starts (``worker_process_init``) and ``stop()``
when it ends (``worker_process_shutdown``; ``worker_shutdown`` for ``-P solo``). The threads of ours a
worker process runs (docs/architecture.md §7): the scheduler (``scheduler.Scheduler``, every periodic
and due job), the runners (``runners.Runners``: every turn executes on one — up to ``HERMES_WORKER_TURNS``
at once in a process with a route, plus each turn parked to wait for a person) and, in a process with a
route, the wake listener (``wake.WakeListener``, which hands woken turns to the runners without waiting for
them). The codex client's pipe readers (``codex-app-server-<pid>-<role>``) live only as long as
their app-server. ``tests/e2e/test_worker_threads.py`` counts them in a real worker.

``runtime()`` is this process's state, made again after a fork (a forked child has its parent's
objects but not its threads): the only place the worker package compares process ids.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .scheduler import Job, Scheduler

if TYPE_CHECKING:
    from .affinity import AffinityLoop
    from .health_beat import HealthBeat
    from .heartbeats import TurnHeartbeats
    from .recovery import SweepLoop
    from .runners import Runners, SessionRuns
    from .wake import TurnSlots, WakeListener
    from .warm.kept import Keeper
    from .warm.spares import SparePool

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Runtime:
    """What one worker process runs besides Celery: made on first use (``runtime()``), one per process.
    ``lock`` guards the optional parts while they are made or taken down."""

    pid: int
    scheduler: Scheduler = field(default_factory=Scheduler)
    heartbeats: TurnHeartbeats | None = None
    keeper: Keeper | None = None
    spares: SparePool | None = None
    listener: WakeListener | None = None
    runners: Runners | None = None  # where turns execute (runners.py); None outside a worker process
    slots: TurnSlots | None = None  # the HERMES_WORKER_TURNS permits (wake.py), made on first use
    sessions: SessionRuns | None = None  # the sessions whose turns run here now (runners.py), made on first use
    affinity: AffinityLoop | None = None
    sweep: SweepLoop | None = None
    health: HealthBeat | None = None
    metric_reports: Job | None = None  # the metric report's job (metric_reports.py)
    lock: threading.RLock = field(default_factory=threading.RLock)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's ``Runtime`` (a new one after a fork: the parent's threads are not this process's)."""
    global _runtime
    current = _runtime
    if current is not None and current.pid == os.getpid():
        return current
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime(pid=os.getpid())
        return _runtime


def start() -> None:
    """A pool process starts: its first runner thread (``runners.py``), its worker's health heartbeat (``health_beat.py``), spares start filling
    (``HERMES_WARM_POOL`` > 0), its metric report runs every ``HERMES_METRICS_REPORT_SECONDS``
    (``metric_reports.py``), and a process with a route
    starts its affinity heartbeat and wake listener (``execution.start_affinity``), which also runs the
    sweep's round; any other (more pool processes, or keeping off) runs the sweep's round alone
    (``recovery.sweep_loop_start``): recovery never depends on beat alone."""
    from .execution import start_affinity
    from .health_beat import health_beat_start
    from .metric_reports import metric_reports_start
    from .recovery import sweep_loop_start
    from .runners import runners_start
    from .warm.kept import keeper_make
    from .warm.spares import spare_pool

    runners_start()
    health_beat_start()
    spare_pool()
    metric_reports_start()
    k = keeper_make()
    if k is None or start_affinity(k) is None:  # None: no route
        sweep_loop_start(by=f"worker process {os.getpid()}")


def stop(*, turn_timeout: float) -> None:
    """A pool process ends (warm shutdown, max-tasks-per-child): the wake listener first, waiting
    ``turn_timeout`` seconds at most for every permit (``wake.wake_stop``: the woken turns end on their
    app-servers); then the runners: parked
    turns that wait for a person are given back to the queue at once, others waited for (``turn_timeout``
    seconds at most, ``runners.runners_stop``); then the spares, the
    kept app-servers and this worker's routing rows; the last metric report; then the scheduler. A killed process takes its
    app-servers along by ``PR_SET_PDEATHSIG`` (its rows go stale and the sweep removes them)."""
    from .affinity import affinity_stop
    from .health_beat import health_beat_stop
    from .metric_reports import metric_reports_stop
    from .recovery import sweep_loop_stop
    from .runners import runners_stop
    from .wake import wake_stop
    from .warm.kept import close_keeper
    from .warm.spares import close_spare_pool

    wake_stop(turn_timeout=turn_timeout)
    runners_stop(turn_timeout=turn_timeout)
    close_spare_pool()
    affinity_stop(close_keeper())
    sweep_loop_stop()
    health_beat_stop()
    metric_reports_stop()
    runtime().scheduler.stop()


def thread_names() -> list[str]:
    """The names of this process's threads (``threading.enumerate()``), sorted."""
    return sorted(t.name for t in threading.enumerate())
