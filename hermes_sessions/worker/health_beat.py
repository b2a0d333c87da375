"""The worker's report for the readiness checks (``hermes_sessions/health.py``): a job on each pool
process's scheduler renews its worker's ``WorkerHealth`` heartbeat every
``HERMES_WORKER_HEARTBEAT_SECONDS`` (one upsert, ms-scale; marked slow, as the sweep's round, so it never
starts when an early ``turn/start``'s pause is about to fire: ``scheduler.py``) and, when this process
ran codex's sandbox check itself (the first turn checks again, cached per process), records that
result. Every worker beats, whatever its concurrency; the ``TurnWorker`` heartbeat of ``affinity.py``
is only that of workers that keep threads.

The worker's node name (``hermes-1@host``) is named for its pool processes in ``HERMES_WORKER_NODE``
by ``project/celery.py`` before the pool forks; without it (not a Celery worker) nothing beats.
"""
from __future__ import annotations

import logging
import os

from django.conf import settings

from ..codex import sandbox_check
from ..services.worker_health import worker_health_beat, worker_sandbox_record
from .process import runtime
from .scheduler import Job

logger = logging.getLogger(__name__)

NODE_ENV = "HERMES_WORKER_NODE"


def worker_node() -> str:
    """This worker's Celery node name, or ``""`` outside a worker."""
    return os.environ.get(NODE_ENV, "")


class HealthBeat:
    """The job: ``beat()`` each ``HERMES_WORKER_HEARTBEAT_SECONDS`` (first at once)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.recorded: sandbox_check.CheckResult | None = None  # the sandbox result this process last wrote
        self.job: Job | None = None

    def beat(self) -> None:
        result = sandbox_check.last_result()
        if result is not None and result != self.recorded:
            worker_sandbox_record(node=self.node, ok=result.ok, reason=result.reason)
            self.recorded = result
        else:
            worker_health_beat(node=self.node)


def health_beat_start() -> HealthBeat | None:
    """Start this process's beat once; ``None`` outside a Celery worker."""
    node = worker_node()
    if not node:
        return None
    rt = runtime()
    with rt.lock:
        beat = rt.health
        if beat is None:
            beat = rt.health = HealthBeat(node)
            beat.job = rt.scheduler.every(lambda: float(settings.HERMES_WORKER_HEARTBEAT_SECONDS), beat.beat,
                                          name="health: worker heartbeat", slow=True)
        return beat


def health_beat_stop() -> None:
    """Stop this process's beat (a beat under way ends first); the row is the main process's to delete."""
    rt = runtime()
    with rt.lock:
        beat, rt.health = rt.health, None
    if beat is not None:
        rt.scheduler.cancel(beat.job, wait=5.0)
