"""The Celery application. Workers start with ``celery -A project worker -Q <HERMES_TURN_QUEUE>,celery`` (``make worker``)."""
import logging
import os

from celery import Celery
from celery.signals import after_setup_logger, worker_process_init, worker_process_shutdown, worker_ready

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


@worker_process_init.connect
def _fill_spares(**_: object) -> None:
    """With ``HERMES_WARM_POOL`` > 0, each pool process starts filling its spare app-servers as soon as
    it is forked, not at its first turn (``hermes_sessions/codex/warm.py``)."""
    from hermes_sessions.codex.warm import spare_pool

    spare_pool()


@worker_process_shutdown.connect
def _close_spares(**_: object) -> None:
    """A pool process that exits (warm shutdown, max-tasks-per-child) closes its spares; a killed one
    takes them along by ``PR_SET_PDEATHSIG``."""
    from hermes_sessions.codex.warm import close_spare_pool

    close_spare_pool()


@after_setup_logger.connect
def _print_each_line_once(**_: object) -> None:
    """In a worker (and beat) Celery's handler on the root logger prints every record with its format;
    the console handler ``LOGGING`` gives ``hermes_sessions`` (for gunicorn and runserver, where the root
    has none) would print each of its lines a second time, so it is removed here."""
    logging.getLogger("hermes_sessions").handlers.clear()
