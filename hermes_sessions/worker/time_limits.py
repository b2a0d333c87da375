"""Celery's time limits for a turn that runs outside a Celery task's thread (a runner, ``runners.py``).

``run_turn`` has a soft limit (Celery raises ``SoftTimeLimitExceeded`` in the task, a backstop behind
``CODEX_TURN_TIMEOUT``: the turn ends failed with a reason, ``execution._run_with_retries``) and a hard one
(Celery kills the pool process; the pool starts another and the turn's lease brings the turn back). Celery
enforces both only for its own tasks — by a signal to the pool process's main thread — so a turn on a
runner (woken or delivered by Celery, and a parked one after its task returned) gets the same two here,
as two due jobs on the process's scheduler (``scheduler.py``):

* **soft**: the turn's ``TurnControl.out_of_time`` records the reason ``TIME_LIMIT_REASON`` and SIGKILLs
  the app-server the turn runs on (``AppServerClient.kill_nowait``: no wait on the scheduler). The turn's
  own blocked read of codex then raises ``TransportError`` and the turn ends failed with that reason, not
  retried (``execution._run_with_retries``). No exception is raised into another thread.
* **hard**: this process is killed (SIGKILL, logged first), as Celery's hard limit would.

Pinned by ``tests/services/test_wake.py`` (the time-limit tests) and
``tests/services/test_parking.py::test_the_runners_time_limit_ends_a_parked_turn``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
from collections.abc import Iterator

from django.conf import settings

from ..codex.runner import TurnControl
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

TIME_LIMIT_REASON = "the turn exceeded the worker's time limit; codex was stopped — the binding is kept"


def turn_time_limits() -> tuple[int, int]:
    """``(soft, hard)`` seconds of a turn: ``CODEX_TURN_TIMEOUT`` plus the most its approvals may wait for
    a person (``HERMES_APPROVAL_TIMEOUT_SECONDS``, ``approvals.py``), + 60 and + 120 (``tasks.run_turn``'s
    ``soft_time_limit`` and ``time_limit``)."""
    budget = settings.CODEX_TURN_TIMEOUT + settings.HERMES_APPROVAL_TIMEOUT_SECONDS
    return math.ceil(budget + 60), math.ceil(budget + 120)


class TimeLimits:
    """One ``thread_time_limits`` block: ``watch`` the turn's control; ``exceeded`` once the soft limit
    passed."""

    def __init__(self, *, soft: float, hard: float, what: str) -> None:
        self.soft, self.hard, self.what = soft, hard, what
        self.exceeded = threading.Event()
        self._controls: list[TurnControl] = []
        self._lock = threading.Lock()

    def watch(self, control: TurnControl) -> None:
        """End ``control``'s turn at the soft limit (at once, if it passed already)."""
        with self._lock:
            self._controls.append(control)
            late = self.exceeded.is_set()
        if late:
            control.out_of_time(TIME_LIMIT_REASON)

    def expire(self) -> None:
        """The soft limit passed (its job; or Celery's own soft limit of the task that handed the turn to a
        runner, ``runners.py``): the watched turns end now."""
        logger.warning("%s: past the soft time limit (%.0f s); its codex app-server is stopped", self.what, self.soft)
        with self._lock:
            self.exceeded.set()
            controls = list(self._controls)
        for control in controls:
            control.out_of_time(TIME_LIMIT_REASON)

    def _hard(self) -> None:
        logger.error("%s: past the hard time limit (%.0f s); killing this worker process, as Celery's hard "
                     "limit would (the pool starts another; the turn's lease brings the turn back)", self.what,
                     self.hard)
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def thread_time_limits(*, soft: float, hard: float, what: str,
                       scheduler: Scheduler | None = None) -> Iterator[TimeLimits]:
    """For the block: after ``soft`` seconds the turns it ``watch``es end (module docstring); after
    ``hard`` seconds this process is killed (SIGKILL, logged first: ``what`` names the work). Both are
    jobs on ``scheduler`` (default: this process's); cancelled when the block ends."""
    if scheduler is None:
        from .process import runtime

        scheduler = runtime().scheduler
    limits = TimeLimits(soft=soft, hard=max(hard, soft), what=what)
    soft_job = scheduler.after(soft, limits.expire, name=f"soft time limit of {what}")
    hard_job = scheduler.after(max(hard, soft), limits._hard, name=f"hard time limit of {what}")
    try:
        yield limits
    finally:
        soft_job.cancel()
        hard_job.cancel()
