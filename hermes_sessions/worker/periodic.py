"""A worker process's background loops: a daemon thread that runs one round every ``interval()`` seconds
on a database connection of its own (``affinity.AffinityLoop``, ``recovery.SweepLoop``)."""
from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections, connection

logger = logging.getLogger(__name__)


class PeriodicLoop:
    """Calls ``tick`` every ``interval()`` seconds on a daemon thread named ``name`` — at once
    first when ``tick_at_start``, else after one interval. A round that raises is logged (``what``) and its
    connection closed; the next round tries again: a database blip must not end the loop. The thread's
    database connection is its own (Django's are per thread) and closed when the loop ends."""

    name = "hermes-loop"
    what = "background round"
    tick_at_start = True

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def interval(self) -> float:
        """Seconds between two rounds (default ``HERMES_WORKER_HEARTBEAT_SECONDS``)."""
        return float(settings.HERMES_WORKER_HEARTBEAT_SECONDS)

    def tick(self) -> None:
        """One round."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end and wait for it (10 s at most); a no-op from its own thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            if not self.tick_at_start:
                self._stop.wait(self.interval())
            while not self._stop.is_set():
                try:
                    close_old_connections()
                    self.tick()
                except Exception:  # noqa: BLE001 — a database blip must not end the loop
                    logger.exception("%s failed", self.what)
                    connection.close()
                self._stop.wait(self.interval())
        finally:
            connection.close()
