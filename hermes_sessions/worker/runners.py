"""The runner threads of a worker process: where its turns execute, so that several turns run at once and
a turn waiting for a person can **park** — free its permit while it keeps its app-server (docs/contract.md §10).

A delivery holds one of the worker's permits — its Celery pool slot and a ``wake.TurnSlots`` permit
(``HERMES_WORKER_TURNS`` per process with a route) — and hands its turn to a runner: one
``SimpleQueue.put``, on a thread that ran turns before (a runner is started only when none is idle; none
ever ends before the process). Celery's delivery (``tasks.run_turn`` on its task thread) waits until the
turn ends **or parks** (``Runners.run``: one ``Event.wait``), then lets its permit go and the task returns
(its pool slot takes the next message). The wake listener does not wait (``Runners.submit``): the runner
gives the woken turn's permit back (``on_released``) when the turn ends or parks, and the listener goes on
to its next wake at once.

A turn parks (``TurnRun.park``, called by the approval desk once a request waited ``approvals.PARK_AFTER``
for a person) unless ``HERMES_MAX_PARKED_TURNS`` of this process's turns are parked already or the
process is stopping; beyond the bound a waiting turn keeps its permit. A parked turn goes on on its runner:
its lease is renewed by the scheduler's heartbeat job, its time limits are the scheduler's
(``time_limits.thread_time_limits``, opened by the runner for every turn), and once the decision comes it
finishes outside the permits: its app-server is closed at its end, never kept (``execution._Handover.park``),
so what the keeper holds was left by turns within the permits.

``SessionRuns``: the sessions whose turns execute here now, from the claim to the end of the run (the
finalize's commit, then the hand-over of its app-server to the keeper). The finalize makes the session's
next turn claimable before its app-server is kept; that next turn, on another runner, waits for the end
of the run before it looks for the kept thread (``execution.turn_execute``), so it finds it — and never
restores the session's home under an app-server that is still running on it.

Runner threads are marked long-lived (``hermes_long_lived``): an app-server one spawns — a kept one too —
lives as long as the process (``PR_SET_PDEATHSIG`` follows the spawning thread, ``wake.in_long_lived_thread``).
At the process's stop (``runners_stop``) a parked turn still waiting for a person is given back at once
(``turns.turn_requeue``, then its app-server is killed): its re-run asks codex again and carries the
pending approval over (A8), nobody is asked twice; a turn that runs on is waited for.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import close_old_connections, connection

from ..services.turns import turn_requeue
from .process import runtime

if TYPE_CHECKING:
    from ..codex.runner import TurnControl
    from .time_limits import TimeLimits

logger = logging.getLogger(__name__)

THREAD_PREFIX = "hermes-runner-"
GIVEN_BACK_REASON = ("the worker stopped while the turn waited for a person; its re-run asks codex again and "
                     "carries the pending approval over")


@dataclass(frozen=True)
class Parked:
    """What a delivery gets for a turn that parked: the runner writes its end (``status`` for the task's result)."""

    turn_id: object
    status: str = "parked"


class TurnRun:
    """One turn handed to a runner: ``work(run)`` runs on the runner thread; ``released`` is set once it
    ended or parked, and ``on_released`` (the delivery's permit) called then, once; ``result`` / ``error``
    what it returned or raised. ``detached``: no delivery waits for it (a woken turn): an error is logged
    here."""

    def __init__(self, pool: Runners, work: Callable[[TurnRun], Any], turn_id: object, *,
                 on_released: Callable[[], None] | None = None, detached: bool = False) -> None:
        self.pool, self.work, self.turn_id = pool, work, turn_id
        self.released = threading.Event()
        self.on_released, self.detached = on_released, detached
        self._release_lock = threading.Lock()
        self.parked = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.limits: TimeLimits | None = None  # the runner's time limits of the turn, once opened
        self.claim: tuple[uuid.UUID, TurnControl] | None = None  # (claim token, control) once parked

    def park(self, *, token: uuid.UUID, control: TurnControl) -> bool:
        """Free the delivery's permit (a waiting delivery gets ``Parked``); ``False`` — nothing changed — past
        ``HERMES_MAX_PARKED_TURNS``, while the process stops, or when it parked already. Never blocks."""
        pool = self.pool
        with pool.lock:
            if self.parked or pool.stopping or len(pool.parked) >= settings.HERMES_MAX_PARKED_TURNS:
                return False
            self.parked, self.claim = True, (token, control)
            pool.parked.add(self)
        logger.info("turn %s waits for a person: parked, its worker slot is free (%d parked here)", self.turn_id,
                    len(pool.parked))
        self.release()
        return True

    def release(self) -> None:
        """The turn ended or parked: set ``released`` and call ``on_released``, the first time only."""
        with self._release_lock:
            if self.released.is_set():
                return
            self.released.set()
        if self.on_released is not None:
            try:
                self.on_released()
            except Exception:  # noqa: BLE001 — a permit that cannot be given back must not end the runner
                logger.exception("turn %s: its release failed", self.turn_id)

    def wait(self) -> Any:
        """Until the run ended or parked: its value (``Parked`` once it parked), or re-raises what it
        raised. Celery's soft time limit reaching this thread (the task's backstop) ends the turn by its
        runner's own limits and waits on."""
        while True:
            try:
                self.released.wait()
                break
            except SoftTimeLimitExceeded:
                logger.warning("turn %s: the task's soft time limit passed; its codex is stopped", self.turn_id)
                if self.limits is not None:
                    self.limits.expire()
        if self.parked:
            return Parked(self.turn_id)
        if self.error is not None:
            raise self.error
        return self.result


class Runners:
    """This process's runner threads (module docstring). ``parked``: its parked runs; ``running``: every
    run handed over and not ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parked: set[TurnRun] = set()
        self.running: set[TurnRun] = set()
        self.stopping = False
        self._work: queue.SimpleQueue[TurnRun | None] = queue.SimpleQueue()
        self._idle = 0
        self._threads: list[threading.Thread] = []

    def run(self, work: Callable[[TurnRun], Any], *, turn_id: object) -> Any:
        """Run ``work(run)`` on a runner and wait until it returns (its value, or re-raises what it
        raised) or the run parks (``Parked``) — ``TurnRun.wait``."""
        return self.submit(work, turn_id=turn_id).wait()

    def submit(self, work: Callable[[TurnRun], Any], *, turn_id: object,
               on_released: Callable[[], None] | None = None, detached: bool = False) -> TurnRun:
        """Hand ``work(run)`` to a runner (an idle one, else a new one) and return at once; ``on_released``
        is called on the runner when the run ends or parks. ``detached``: nobody ``wait``s for it (its
        error is logged). Never blocks."""
        run = TurnRun(self, work, turn_id, on_released=on_released, detached=detached)
        with self.lock:
            self.running.add(run)
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            self._start_thread()
        self._work.put(run)
        return run

    def idle_threads(self) -> int:
        with self.lock:
            return self._idle

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._loop, name=f"{THREAD_PREFIX}{len(self._threads) + 1}", daemon=True)
        thread.hermes_long_lived = True  # type: ignore[attr-defined]
        self._threads.append(thread)
        thread.start()

    def _loop(self) -> None:
        try:
            while (run := self._work.get()) is not None:
                self._execute(run)
        finally:
            connection.close()  # this thread's own

    def _execute(self, run: TurnRun) -> None:
        close_old_connections()  # as Celery does around a task (project/celery.py)
        try:
            run.result = run.work(run)
        except BaseException as exc:  # noqa: BLE001 — the delivery re-raises it (or, parked or detached, it is logged)
            run.error = exc
            if run.parked or run.detached:
                logger.error("%sturn %s ended with an error", "parked " if run.parked else "", run.turn_id,
                             exc_info=exc)
        finally:
            close_old_connections()
            with self.lock:
                self.running.discard(run)
                self.parked.discard(run)
                self._idle += 1  # before the release: the delivery's next turn finds this thread idle
            run.release()

    def start(self, threads: int = 1) -> None:
        """Start ``threads`` idle runners now (a worker process's first turn starts no thread)."""
        for _ in range(threads):
            with self.lock:
                self._idle += 1
            self._start_thread()

    def stop(self, *, timeout: float) -> None:
        """No more parking; give back each parked run that waits for a person (now, and any that comes to
        wait again) until every run ended or ``timeout`` seconds passed; then end the runner threads."""
        with self.lock:
            self.stopping = True
        deadline = time.monotonic() + timeout
        given: set[TurnRun] = set()
        while True:
            with self.lock:
                running = list(self.running)
                waiting = [r for r in self.parked if r not in given and r.claim and r.claim[1].waiting_for_person()]
            if not running:
                break
            for run in waiting:
                given.add(run)
                _give_back(run)
            if time.monotonic() >= deadline:
                logger.warning("%d turn(s) still run on this worker's runners at its stop; their leases bring "
                               "them back", len(running))
                break
            time.sleep(0.05)
        for _ in self._threads:
            self._work.put(None)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)


def _give_back(run: TurnRun) -> None:
    """Put a parked run's turn back in the queue, then kill its app-server: the desk's wait sees the claim
    gone and answers nothing that runs; the row stays pending for the re-run (A8)."""
    assert run.claim is not None
    token, control = run.claim
    try:
        turn_requeue(turn_id=uuid.UUID(str(run.turn_id)), token=token, reason=GIVEN_BACK_REASON)
    except Exception:  # noqa: BLE001 — its lease brings it back all the same
        logger.exception("turn %s: could not be given back at the worker's stop; its lease brings it back", run.turn_id)
    control.give_up()
    logger.info("turn %s: parked at the worker's stop; given back to the queue", run.turn_id)


def runners_start() -> Runners:
    """This process's ``Runners`` (``process.runtime().runners``), made once with one idle runner."""
    rt = runtime()
    with rt.lock:
        if rt.runners is None:
            rt.runners = Runners()
            rt.runners.start()
        return rt.runners


class SessionRuns:
    """The sessions whose turns execute in this process now (module docstring): ``running(session_id)``
    around a claimed run, ``wait_idle(session_id, timeout=)`` before looking for its kept thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: dict[str, int] = {}

    @contextlib.contextmanager
    def running(self, session_id: str) -> Iterator[None]:
        with self._cond:
            self._running[session_id] = self._running.get(session_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._running.pop(session_id) - 1
                if left:
                    self._running[session_id] = left
                self._cond.notify_all()

    def wait_idle(self, session_id: str, *, timeout: float) -> float:
        """Wait until no run of ``session_id`` executes here (``timeout`` seconds at most); the seconds
        waited (0.0 at once when none does)."""
        t0 = time.monotonic()
        with self._cond:
            if session_id not in self._running:
                return 0.0
            self._cond.wait_for(lambda: session_id not in self._running, timeout=timeout)
        return time.monotonic() - t0


def session_runs() -> SessionRuns:
    """This process's ``SessionRuns`` (``process.runtime().sessions``), made on first use."""
    rt = runtime()
    runs = rt.sessions
    if runs is None:
        with rt.lock:
            if rt.sessions is None:
                rt.sessions = SessionRuns()
            runs = rt.sessions
    return runs


def runner_pool() -> Runners | None:
    """This process's runners; ``None`` outside a worker process (an eager task, a test): turns run on
    the caller's thread and never park."""
    return runtime().runners


def parked_count() -> int:
    """Turns parked in this process now (the metric report's ``hermes_worker_parked_turns``)."""
    pool = runner_pool()
    if pool is None:
        return 0
    with pool.lock:
        return len(pool.parked)


def runners_stop(*, turn_timeout: float) -> None:
    """Worker shutdown: ``Runners.stop`` (parked turns given back, others waited for ``turn_timeout`` s)."""
    rt = runtime()
    with rt.lock:
        pool, rt.runners = rt.runners, None
    if pool is not None:
        pool.stop(timeout=turn_timeout)
