"""Celery beat's scheduler for this project (``CELERY_BEAT_SCHEDULER``).

Celery's own persistent scheduler, plus: the schedule file's folder (under ``HERMES_VAR_DIR`` by
default) is made when beat starts, since importing settings creates no directory.
"""
from __future__ import annotations

from pathlib import Path

from celery import beat


class PersistentScheduler(beat.PersistentScheduler):
    schedule_filename: str  # set by Celery's __init__; not declared in celery-types' stub

    def setup_schedule(self) -> None:
        Path(self.schedule_filename).parent.mkdir(parents=True, exist_ok=True)
        super().setup_schedule()
