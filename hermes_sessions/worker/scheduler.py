"""The one scheduler thread of a worker process: every periodic and every due job of the process runs on it.

Jobs (``Scheduler.after``, ``Scheduler.at``, ``Scheduler.every``) sit in one heap of ``(due, seq, job)``
— ``due`` in ``time.monotonic()`` seconds — under one ``threading.Condition``; the thread
(``hermes-scheduler``) sleeps until the earliest is due, runs it, and goes back to the heap. What runs
here (docs/architecture.md §7): the affinity heartbeat and the sweep's round (``affinity.py``,
``recovery.py``), each running turn's lease renewal (``heartbeats.py``), the soft and hard time limits of
woken turns (``time_limits.py``), the early ``turn/start``'s pause (``warm/early_start.py``) and the
spare app-servers' starts, checks and reaps (``warm/spares.py``).

**The rule: no job blocks more than a few milliseconds; a job that cannot (``slow=True``) runs only when
no other job is due within ``SLOW_BUDGET_SECONDS``.** The early-start pause must fire
``early_start.PAUSE_AFTER_SECONDS`` (20 ms) after ``turn/start``, before codex's first model request
(~45 ms after it at the earliest); any job running then delays it. So a job does one short database round
(the sweep, a heartbeat: ms-scale), sends a signal, or starts a process without waiting for it. The
sweep's round (with the affinity heartbeat) is marked slow too, so that it never starts when a pause is
about to fire: a few statements, but on a slow database it is what could take longest. The slowest
work is a spare's start, cut into two slow steps that wait for nothing codex does: the spawn (fork +
exec, ~5–35 ms in a large process on a loaded host) and the launch (the client's reader threads and
``initialize`` sent, ~5–15 ms); the answer is read by the codex client's own reader thread and counted by
a later check (``warm/spares.py``); a spare is retired by SIGKILL and reaped by a later job. A slow step
due while a pause is armed waits until after the pause; only a step that began before the pause was armed
can delay it, by at most that step's length minus the 20 ms. Measured: a job longer than
``SLOW_JOB_SECONDS`` (``SLOW_STEP_SECONDS`` for a slow one) is logged as a warning with its name
(``slow_jobs`` counts them). ``tests/services/test_scheduler.py`` pins the rule: a slow job due while a
pause is due within the budget runs after it (``test_a_slow_job_due_waits_for_a_job_due_within_the_budget``),
and a spare start waits for nothing codex does (``…never_answers_holds_the_scheduler_for_no_pause``).

A job that raises is logged and dropped (a periodic one is scheduled again: a database blip must not
end the heartbeat). The thread's database connection is its own (Django's are per thread); it is closed
once the heap holds no job due within ``IDLE_CLOSE_SECONDS`` and after a job that raised. The thread is
marked long-lived (``hermes_long_lived``): app-servers it spawns get ``PR_SET_PDEATHSIG`` from it
(``wake.in_long_lived_thread``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import close_old_connections, connection

logger = logging.getLogger(__name__)

THREAD_NAME = "hermes-scheduler"
SLOW_JOB_SECONDS = 0.02  # a job running longer than the early-start pause's own delay breaks the rule: logged
SLOW_STEP_SECONDS = 0.1  # the same for a job marked slow
SLOW_BUDGET_SECONDS = 0.04  # a slow job waits while another is due within this (the pause: 20 ms)
IDLE_CLOSE_SECONDS = 1.0  # no job due sooner than this: the thread closes its database connection


@dataclass(eq=False)
class Job:
    """One scheduled call: ``fn()`` at ``due`` (monotonic seconds), and every ``interval`` seconds after
    it ran when ``interval`` is set (``interval`` may be a callable, read after each run). ``cancel``
    keeps it from running (again); a run already under way finishes."""

    fn: Callable[[], object]
    name: str
    due: float
    interval: float | Callable[[], float] | None = None
    slow: bool = False  # may block tens of ms: runs only when nothing else is due within SLOW_BUDGET_SECONDS
    cancelled: bool = field(default=False)

    def cancel(self) -> None:
        self.cancelled = True

    def next_interval(self) -> float | None:
        interval = self.interval
        return float(interval()) if callable(interval) else interval


class Scheduler:
    """The heap and its one thread (module docstring). ``start`` is implicit: the first job scheduled
    starts the thread; ``stop`` ends it (jobs left are dropped)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running: Job | None = None  # the job under way, if any
        self.slow_jobs = 0  # jobs that ran longer than SLOW_JOB_SECONDS (tests, the rule above)

    # ------------------------------------------------------------------ scheduling

    def at(self, due: float, fn: Callable[[], object], *, name: str = "", slow: bool = False) -> Job:
        """Run ``fn`` once at ``due`` (``time.monotonic()`` seconds); ``slow``: see the module's rule."""
        return self._push(Job(fn=fn, name=name or getattr(fn, "__qualname__", repr(fn)), due=due, slow=slow))

    def after(self, seconds: float, fn: Callable[[], object], *, name: str = "", slow: bool = False) -> Job:
        """Run ``fn`` once, ``seconds`` from now."""
        return self.at(time.monotonic() + max(seconds, 0.0), fn, name=name, slow=slow)

    def every(self, interval: float | Callable[[], float], fn: Callable[[], object], *, name: str = "",
              first_after: float = 0.0, slow: bool = False) -> Job:
        """Run ``fn`` ``first_after`` seconds from now, then ``interval`` seconds after each run ends."""
        job = Job(fn=fn, name=name or getattr(fn, "__qualname__", repr(fn)), due=time.monotonic() + first_after,
                  interval=interval, slow=slow)
        return self._push(job)

    def _push(self, job: Job) -> Job:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.hermes_long_lived = True  # type: ignore[attr-defined]
                self._thread.start()
            heapq.heappush(self._heap, (job.due, next(self._seq), job))
            self._cond.notify()
        return job

    def cancel(self, job: Job | None, *, wait: float = 0.0) -> None:
        """Cancel ``job`` (``None``: nothing) and, when it is under way, wait for its run to end (``wait``
        seconds at most; not from the scheduler's own thread): e.g. a heartbeat must not write its row
        again after the worker removed it."""
        if job is None:
            return
        job.cancel()
        if wait <= 0 or self.in_thread():
            return
        with self._cond:
            self._cond.wait_for(lambda: self._running is not job, timeout=wait)

    def pending(self) -> int:
        """Jobs in the heap not cancelled (tests)."""
        with self._cond:
            return sum(1 for _, _, j in self._heap if not j.cancelled)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_thread(self) -> bool:
        """Whether the caller runs on this scheduler's thread (a job)."""
        return self._thread is threading.current_thread()

    def stop(self, timeout: float = 10.0) -> None:
        """Drop every job and end the thread, waiting ``timeout`` seconds at most for a job under way; a
        no-op from the thread itself (it ends after the job)."""
        with self._cond:
            self._stopping = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _next(self) -> Job | None:
        """The next due job, waiting for it; ``None`` once stopping. Closes the connection when idle."""
        with self._cond:
            while not self._stopping:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    job = heapq.heappop(self._heap)[2]
                    soon = self._other_due_before(now + SLOW_BUDGET_SECONDS) if job.slow else None
                    if soon is None:
                        return job
                    job.due = soon  # after that job: the scheduler's rule
                    heapq.heappush(self._heap, (job.due, next(self._seq), job))
                    continue
                left = self._heap[0][0] - now if self._heap else None
                if left is None or left > IDLE_CLOSE_SECONDS:
                    self._cond.release()
                    try:
                        connection.close()  # idle: hold no connection meanwhile (a test database's drop waits)
                    finally:
                        self._cond.acquire()
                    if self._stopping or (self._heap and self._heap[0][0] <= time.monotonic()):
                        continue
                self._cond.wait(left)
            return None

    def _other_due_before(self, limit: float) -> float | None:
        """The due time of the first job that is not slow and due before ``limit``; holding ``_cond``."""
        due = [d for d, _, j in self._heap if not j.slow and not j.cancelled and d < limit]
        return min(due) if due else None

    def _run(self) -> None:
        try:
            while (job := self._next()) is not None:
                self._run_one(job)
        finally:
            connection.close()

    def _run_one(self, job: Job) -> None:
        started = time.monotonic()
        with self._cond:
            self._running = job
        try:
            close_old_connections()
            job.fn()
        except Exception:  # noqa: BLE001 — one failing job must not end the thread
            logger.exception("scheduler: job %s failed", job.name)
            connection.close()
        finally:
            with self._cond:
                self._running = None
                self._cond.notify_all()
        took = time.monotonic() - started
        if took > (SLOW_STEP_SECONDS if job.slow else SLOW_JOB_SECONDS):
            logger.warning("scheduler: job %s took %.1f ms (the rule is a few ms: docs/architecture.md §7)",
                           job.name, took * 1000)
            self.slow_jobs += 1
        interval = job.next_interval() if not job.cancelled else None
        if interval is not None:
            job.due = time.monotonic() + interval
            with self._cond:
                if not self._stopping:
                    heapq.heappush(self._heap, (job.due, next(self._seq), job))
