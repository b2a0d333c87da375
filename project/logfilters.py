"""Logging filters for the worker's log (installed by ``LOGGING`` in ``project/settings.py``).

:class:`QuietSweep` drops Celery's own INFO lines about the periodic sweep task — beat's ``Scheduler:
Sending due task sweep-turns (…)`` and the worker's ``Task …sweep_turns[…] received`` / ``succeeded in
…`` — which would otherwise appear every ``HERMES_SWEEP_SECONDS`` (10 s) whether or not the sweep did
anything. The sweep logs its own line for each action it takes (``hermes_sessions/worker/recovery.py``),
so a quiet log means nothing needed recovering. Warnings and errors about it (a failing sweep) pass.
"""
from __future__ import annotations

import logging

SWEEP_TASK = "hermes_sessions.tasks.sweep_turns"


class QuietSweep(logging.Filter):
    """Drop INFO-and-below records of Celery's loggers that are about :data:`SWEEP_TASK`.

    Celery 5.7 passes the task's name as ``record.data["name"]`` on ``celery.app.trace`` (received,
    succeeded) and ``celery.worker.strategy`` (received), and as the last of ``record.args`` on
    ``celery.beat`` (``Sending due task %s (%s)``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a routine line about the sweep task; True for everything else."""
        if record.levelno > logging.INFO:
            return True
        data = getattr(record, "data", None)
        if isinstance(data, dict) and data.get("name") == SWEEP_TASK:
            return False
        args = record.args
        return not (isinstance(args, tuple) and args and args[-1] == SWEEP_TASK)
