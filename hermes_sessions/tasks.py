"""Celery tasks: thin, id-taking, calling services. Sent by name from ``services/dispatch.py``."""
import math

from celery import shared_task
from django.conf import settings

from . import services


@shared_task(
    name="hermes_sessions.tasks.run_turn",
    ignore_result=True,
    # Backstops behind the runner's own turn deadline (which interrupts codex and fails the turn).
    soft_time_limit=math.ceil(settings.CODEX_TURN_TIMEOUT + 60),
    time_limit=math.ceil(settings.CODEX_TURN_TIMEOUT + 120),
)
def run_turn(turn_id: str) -> str:
    """Run turn ``turn_id`` if it is its session's next turn (see ``services.turn_execute``).
    Returns the turn's resulting status, or ``"skipped"`` when there was nothing to do."""
    turn = services.turn_execute(turn_id=turn_id)
    return turn.status if turn is not None else "skipped"


@shared_task(name="hermes_sessions.tasks.sweep_turns", ignore_result=True)
def sweep_turns() -> dict[str, int]:
    """Periodic (Celery beat): recover turns of dead workers, re-send lost tasks, purge old keys."""
    return vars(services.turns_sweep())
