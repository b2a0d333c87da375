"""``DueThread``: one daemon thread per process that runs work when it falls due — the base of the
turns' time-limit watcher (``time_limits``) and their lease heartbeats (``heartbeats``), each of which
replaced a thread per turn."""
from __future__ import annotations

import os
import threading
import time
from typing import Any


class DueThread:
    """Subclasses keep their work under ``self._cond`` and say, holding it, what is due now
    (``_take_due``: taken out or rescheduled) and when the next is (``_next_at``: monotonic, ``None``:
    nothing); ``_run_due`` runs one item outside the lock and must not raise. ``_quiet`` runs (outside the
    lock) once the thread has nothing left to do, before it waits for new work. A registration calls
    ``_ensure_started`` and ``self._cond.notify()`` holding the lock."""

    thread_name = "hermes-due"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pid = 0

    def _ensure_started(self) -> bool:
        """Start this process's thread on first use and again after a fork (the child has the parent's
        state but not its thread); True when it started now — the caller then drops what it inherited.
        Call holding ``self._cond``."""
        if self._pid == os.getpid():
            return False
        self._pid = os.getpid()
        threading.Thread(target=self._run, name=self.thread_name, daemon=True).start()
        return True

    def _take_due(self, now: float) -> list[Any]:
        raise NotImplementedError

    def _next_at(self) -> float | None:
        raise NotImplementedError

    def _run_due(self, item: Any) -> None:
        raise NotImplementedError

    def _quiet(self) -> None:
        """Nothing left to do (e.g. close a database connection); default: nothing."""

    def _run(self) -> None:
        quiet = True  # nothing has run since the last _quiet
        while True:
            with self._cond:
                due = self._take_due(time.monotonic())
                nxt = None if due else self._next_at()
                if not due and (nxt is not None or quiet):
                    self._cond.wait(None if nxt is None else max(0.0, nxt - time.monotonic()))
                    continue
            if not due:
                self._quiet()
                quiet = True
                continue
            quiet = False
            for item in due:
                self._run_due(item)
