"""Celery's time limits for a turn that runs outside a Celery task (the wake listener's thread, ``wake.py``).

``run_turn`` has a soft limit (``SoftTimeLimitExceeded`` raised in the task, a backstop behind
``CODEX_TURN_TIMEOUT``: the turn ends failed with a reason, ``execution._run_with_retries``) and a hard one
(Celery kills the pool process; the pool starts another and the turn's lease brings the turn back). Celery
enforces both only for its own tasks — by a signal to the pool process's main thread — so a woken turn
gets the same two here: ``thread_time_limits`` raises ``SoftTimeLimitExceeded`` in the turn's thread and,
should that not end it, kills this process as Celery's hard limit would — one watcher thread per process.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

from ..services.due_threads import DueThread

logger = logging.getLogger(__name__)


def turn_time_limits() -> tuple[int, int]:
    """``(soft, hard)`` seconds of a turn: ``CODEX_TURN_TIMEOUT`` + 60 and + 120 (``tasks.run_turn``'s
    ``soft_time_limit`` and ``time_limit``)."""
    return math.ceil(settings.CODEX_TURN_TIMEOUT + 60), math.ceil(settings.CODEX_TURN_TIMEOUT + 120)


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """``PyThreadState_SetAsyncExc``: raise ``exc`` in thread ``ident`` at its next Python instruction
    (every wait on a turn's path has a timeout, so it gets there); ``None`` clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


@dataclass
class _Block:
    """One ``thread_time_limits`` block: the thread, its two deadlines (monotonic), what it does."""

    ident: int
    soft_at: float
    hard_at: float
    what: str
    soft: float
    hard: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    soft_sent: bool = False

    def next_at(self) -> float:
        return self.hard_at if self.soft_sent else self.soft_at


class _Watcher(DueThread):
    """The one thread per process (``hermes-time-limits``) that watches every open block's deadlines. A
    thread per block was started and joined on every woken turn's way to codex (~0.2 ms of its ~5 ms from
    the wake to ``turn/start`` on 2 cores, ``make bench-warm``)."""

    thread_name = "hermes-time-limits"

    def __init__(self) -> None:
        super().__init__()
        self._blocks: list[_Block] = []

    def add(self, block: _Block) -> None:
        with self._cond:
            if self._ensure_started():
                self._blocks = []  # a forked child's: the parent's blocks are not its threads
            self._blocks.append(block)
            self._cond.notify()

    def remove(self, block: _Block) -> None:
        with self._cond:
            if block in self._blocks:
                self._blocks.remove(block)

    def _take_due(self, now: float) -> list[_Block]:
        return [b for b in self._blocks if b.next_at() <= now]

    def _next_at(self) -> float | None:
        return min((b.next_at() for b in self._blocks), default=None)

    def _run_due(self, block: _Block) -> None:
        self._fire(block)

    def _fire(self, block: _Block) -> None:
        with block.lock:
            if block.done:
                return
            if not block.soft_sent:
                block.soft_sent = True
                logger.warning("%s: past the soft time limit (%.0f s); raising SoftTimeLimitExceeded", block.what,
                               block.soft)
                _raise_in(block.ident, SoftTimeLimitExceeded)
                return
        self.remove(block)  # once: the kill ends the process
        logger.error("%s: past the hard time limit (%.0f s); killing this worker process, as Celery's hard "
                     "limit would (the pool starts another; the turn's lease brings the turn back)", block.what,
                     block.hard)
        os.kill(os.getpid(), signal.SIGKILL)


_WATCHER = _Watcher()


@contextlib.contextmanager
def thread_time_limits(*, soft: float, hard: float, what: str) -> Iterator[None]:
    """For the block, in this thread: after ``soft`` seconds ``SoftTimeLimitExceeded`` is raised in it;
    after ``hard`` seconds this process is killed (SIGKILL, logged first: ``what`` names the work). The
    process's one watcher thread (``_Watcher``) keeps the deadlines; one raised as the block ends is
    cleared, never leaks out after it."""
    now = time.monotonic()
    block = _Block(ident=threading.get_ident(), soft_at=now + soft, hard_at=now + max(hard, soft), what=what,
                   soft=soft, hard=hard)
    _WATCHER.add(block)
    try:
        yield
    finally:
        with block.lock:
            block.done = True
            _raise_in(block.ident, None)
        _WATCHER.remove(block)
