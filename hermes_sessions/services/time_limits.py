"""Celery's time limits for a turn that runs outside a Celery task (the wake listener's thread, ``wake.py``).

``run_turn`` has a soft limit (``SoftTimeLimitExceeded`` raised in the task, a backstop behind
``CODEX_TURN_TIMEOUT``: the turn ends failed with a reason, ``execution._run_with_retries``) and a hard one
(Celery kills the pool process; the pool starts another and the turn's lease brings the turn back). Celery
enforces both only for its own tasks — by a signal to the pool process's main thread — so a woken turn
gets the same two here: ``thread_time_limits`` raises ``SoftTimeLimitExceeded`` in the turn's thread and,
should that not end it, kills this process as Celery's hard limit would.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import threading
from collections.abc import Iterator

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

logger = logging.getLogger(__name__)


def turn_time_limits() -> tuple[int, int]:
    """``(soft, hard)`` seconds of a turn: ``CODEX_TURN_TIMEOUT`` + 60 and + 120 (``tasks.run_turn``'s
    ``soft_time_limit`` and ``time_limit``)."""
    return math.ceil(settings.CODEX_TURN_TIMEOUT + 60), math.ceil(settings.CODEX_TURN_TIMEOUT + 120)


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """``PyThreadState_SetAsyncExc``: raise ``exc`` in thread ``ident`` at its next Python instruction
    (every wait on a turn's path has a timeout, so it gets there); ``None`` clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


@contextlib.contextmanager
def thread_time_limits(*, soft: float, hard: float, what: str) -> Iterator[None]:
    """For the block, in this thread: after ``soft`` seconds ``SoftTimeLimitExceeded`` is raised in it;
    after ``hard`` seconds this process is killed (SIGKILL, logged first: ``what`` names the work). A
    watcher thread per block; one raised as the block ends is cleared, never leaks out after it."""
    ident, lock, done = threading.get_ident(), threading.Lock(), threading.Event()

    def watch() -> None:
        if done.wait(soft):
            return
        with lock:
            if done.is_set():
                return
            logger.warning("%s: past the soft time limit (%.0f s); raising SoftTimeLimitExceeded", what, soft)
            _raise_in(ident, SoftTimeLimitExceeded)
        if done.wait(max(hard - soft, 0.0)):
            return
        logger.error("%s: past the hard time limit (%.0f s); killing this worker process, as Celery's hard "
                     "limit would (the pool starts another; the turn's lease brings the turn back)", what, hard)
        os.kill(os.getpid(), signal.SIGKILL)

    watcher = threading.Thread(target=watch, name="hermes-time-limit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            _raise_in(ident, None)
