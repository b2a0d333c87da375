"""What a worker reports for the readiness checks (``WorkerHealth``, read by ``hermes_sessions/health.py``):
its heartbeat and the result of codex's sandbox check on its host. The only writer of ``WorkerHealth``.

Each write is one statement (``INSERT … ON CONFLICT DO UPDATE`` or ``DELETE``), no transaction held: a
worker frozen between two writes holds no row lock, and two pool processes of one worker beat the same
row without waiting on each other.
"""
from __future__ import annotations

import socket
from datetime import timedelta

from django.utils import timezone

from ..models import WorkerHealth

FORGET_AFTER = timedelta(days=1)  # a dead worker's row is kept this long (its last heartbeat is a clue)
REASON_CHARS = 500


def worker_health_beat(*, node: str) -> None:
    """Renew worker ``node``'s heartbeat (``heartbeat_at = now``, the row made if missing, its sandbox
    result left as it is)."""
    WorkerHealth.objects.bulk_create(
        [WorkerHealth(node=node[:255], host=socket.gethostname()[:255], heartbeat_at=timezone.now())],
        update_conflicts=True, unique_fields=["node"], update_fields=["host", "heartbeat_at"])


def worker_sandbox_record(*, node: str, ok: bool, reason: str) -> None:
    """Record the result of codex's sandbox check of worker ``node`` (``ok``; ``reason``: why it failed,
    or ``"ok"``, cut to ``REASON_CHARS``), renewing its heartbeat; and delete the rows of workers not
    heard of for ``FORGET_AFTER`` (called once per worker start: the table stays as small as the fleet)."""
    now = timezone.now()
    WorkerHealth.objects.bulk_create(
        [WorkerHealth(node=node[:255], host=socket.gethostname()[:255], heartbeat_at=now, sandbox_ok=ok,
                      sandbox_reason=reason[:REASON_CHARS], sandbox_checked_at=now)],
        update_conflicts=True, unique_fields=["node"],
        update_fields=["host", "heartbeat_at", "sandbox_ok", "sandbox_reason", "sandbox_checked_at"])
    WorkerHealth.objects.filter(heartbeat_at__lt=now - FORGET_AFTER).delete()


def worker_health_forget(*, node: str) -> None:
    """Worker ``node`` stops cleanly: delete its row (the readiness checks stop counting it at once,
    instead of after ``HERMES_WORKER_STALE_SECONDS``)."""
    WorkerHealth.objects.filter(node=node).delete()
