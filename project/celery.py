"""The Celery application. Workers start with ``celery -A project worker -Q turns,celery``."""
import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("hermes_sessions")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _check_codex_sandbox(**_: object) -> None:
    """Log at start whether codex's sandbox works here; turns check it again (cached) and are refused
    with the reason when it does not (hermes_sessions/codex/sandbox_check.py)."""
    from hermes_sessions.codex.sandbox_check import check_at_worker_start

    check_at_worker_start()
