"""Celery tasks: thin, id-taking, calling services."""
from celery import shared_task

from . import services


@shared_task(name="hermes_sessions.tasks.run_turn", ignore_result=True)
def run_turn(turn_id: str) -> str:
    """Run turn ``turn_id`` if it is its session's next turn (see ``services.turn_execute``).
    Returns the turn's resulting status, or ``"skipped"`` when there was nothing to do."""
    turn = services.turn_execute(turn_id=turn_id)
    return turn.status if turn is not None else "skipped"
