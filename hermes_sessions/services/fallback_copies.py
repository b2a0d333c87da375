"""The shared queue's fallback copy of a woken turn, sent by a thread of the sending process when it is due.

A turn routed to the worker that holds its thread is woken by NOTIFY (``wake.py``); should that worker not
claim it, the fallback copy — ``run_turn(turn_id, fallback=True)`` on the shared queue,
``HERMES_AFFINITY_DEADLINE`` seconds after the commit — gives it to any worker. It used to be sent at the
commit with a Celery countdown. Building and publishing a Celery message is ~3 ms of the API process's
CPU (kombu, the broker round trip; ``py-spy`` on ``make bench-warm``), and at the commit it ran on the
2-core host exactly while the woken worker claimed the turn and codex started it: the ``POST`` took
14 ms instead of 10, and the claim's round trips waited for the CPU. Sent when due instead, the copy
costs the same once, off the turn's way; a worker finds the turn claimed long before and skips it with one
read (``tasks.run_turn``).

What this gives up: a copy exists only in this process's memory until it is due. If the process dies
first (kill -9) *and* the woken worker does not claim the turn, the turn waits for the affinity loops of
the other workers (``routing.stalled_holder_turns``: seconds) or the sweep (``HERMES_REDISPATCH_SECONDS``)
instead of the deadline — two faults at once; nothing is lost, the turn row is committed. A process that
exits normally (``atexit``) or is stopped by SIGTERM (``flush_on_sigterm``: gunicorn's graceful stop of a
uvicorn worker ends in the default SIGTERM action, which skips ``atexit`` — found by an adversary) sends
what it still holds at once.

``send_later`` is thread-safe; the sender thread starts on first use in each process (after a fork, too).
"""
from __future__ import annotations

import atexit
import heapq
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType

from django.db import connection

from .due_threads import DueThread

logger = logging.getLogger(__name__)


Send = Callable[[uuid.UUID], None]


class FallbackSender(DueThread):
    """Calls each turn's ``send(turn_id)`` given to ``send_later`` once its delay has passed, on this
    process's thread (``hermes-fallback-copies``), and closes that thread's database connection (a send
    reads whether its turn is still queued; an in-process task — ``CELERY_TASK_ALWAYS_EAGER`` — runs on it)
    once no copy is pending: a conversation's copies, one per turn, reuse one connection. Anything a send
    raises is logged and that copy dropped (the sweep re-sends a turn nobody ran)."""

    thread_name = "hermes-fallback-copies"

    def __init__(self) -> None:
        super().__init__()
        self._due: list[tuple[float, int, uuid.UUID, Send]] = []  # a heap: (monotonic due, order, turn, send)
        self._order = 0

    def send_later(self, turn_id: uuid.UUID, *, delay: float, send: Send) -> None:
        """Send ``turn_id``'s copy with ``send`` ``delay`` seconds from now (monotonic)."""
        with self._cond:
            if self._ensure_started():
                self._due = []  # a forked child keeps nothing of its parent's (the parent sends those)
            self._order += 1
            heapq.heappush(self._due, (time.monotonic() + delay, self._order, turn_id, send))
            self._cond.notify()

    def pending(self) -> list[uuid.UUID]:
        """The turns whose copies are not sent yet, in due order (for tests and ``flush``)."""
        with self._cond:
            return [entry[2] for entry in sorted(self._due, key=lambda e: (e[0], e[1]))]

    def flush(self) -> int:
        """Send every held copy now, due or not (at exit, and in tests); how many were sent."""
        with self._cond:
            held, self._due = sorted(self._due, key=lambda e: (e[0], e[1])), []
        try:
            for entry in held:
                self._run_due(entry)
        finally:
            connection.close()
        return len(held)

    def drop(self) -> int:
        """Forget every held copy without sending it (tests); how many there were."""
        with self._cond:
            held, self._due = len(self._due), []
        return held

    def _take_due(self, now: float) -> list[tuple[float, int, uuid.UUID, Send]]:
        due = []
        while self._due and self._due[0][0] <= now:
            due.append(heapq.heappop(self._due))
        return due

    def _next_at(self) -> float | None:
        return self._due[0][0] if self._due else None

    def _run_due(self, entry: tuple[float, int, uuid.UUID, Send]) -> None:
        _, _, turn_id, send = entry
        try:
            send(turn_id)
        except Exception:  # noqa: BLE001 — the sweep re-sends a turn nobody ran
            logger.exception("turn %s: its fallback copy could not be sent; the sweep re-sends the turn if "
                             "nobody ran it", turn_id)
            connection.close()  # the next send opens a fresh one

    def _quiet(self) -> None:
        connection.close()  # not kept open while no copy is pending (a test database's drop waited for it)


SENDER = FallbackSender()
atexit.register(SENDER.flush)


def flush_on_sigterm() -> None:
    """Send the held copies when this process gets SIGTERM, then do what SIGTERM did before (the handler
    it replaces, or the default action: the process ends with SIGTERM, as before). Called where an API
    process loads its application (``project/asgi.py``, ``project/wsgi.py``) — after gunicorn's worker set
    its signals and before uvicorn captures them: uvicorn's server hands a captured SIGTERM back to this
    handler once it has shut down. The copies go from a thread of their own, at most 5 s, so a broker
    connection the interrupted main thread holds cannot deadlock it. Main thread only; once per process."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "hermes_flushes", False):
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        sender = threading.Thread(target=SENDER.flush, name="hermes-fallback-flush", daemon=True)
        sender.start()
        sender.join(5)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    on_sigterm.hermes_flushes = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, on_sigterm)


def fallback_copy_later(turn_id: uuid.UUID, *, delay: float, send: Send) -> None:
    """Send ``turn_id``'s fallback copy ``delay`` seconds from now, from this process, with ``send``
    (``dispatch.send_fallback_copy``: the shared queue; given by the caller, as dispatch imports this module)
    (``FallbackSender``; the module docstring says what that gives up)."""
    SENDER.send_later(turn_id, delay=delay, send=send)
