"""Celery tasks: thin, id-taking, calling services. Sent by name from ``services/dispatch.py``."""
import logging

from celery import Task, shared_task
from django.conf import settings

from . import selectors, services, worker
from .worker.time_limits import turn_time_limits

SOFT_TIME_LIMIT, TIME_LIMIT = turn_time_limits()
logger = logging.getLogger(__name__)


@shared_task(
    bind=True,
    name="hermes_sessions.tasks.run_turn",
    ignore_result=True,
    # Backstops behind the runner's own turn deadline (which interrupts codex and fails the turn).
    # A woken turn gets the same two outside Celery (worker/time_limits.py).
    soft_time_limit=SOFT_TIME_LIMIT,
    time_limit=TIME_LIMIT,
)
def run_turn(self: Task, turn_id: str, fallback: bool = False) -> dict[str, str]:
    """Run turn ``turn_id`` if it is its session's next turn (see ``worker.turn_execute``).

    ``fallback``: the shared queue's copy sent ``HERMES_AFFINITY_DEADLINE`` after a turn routed to the
    worker holding its thread (``services/dispatch.py``). Almost always that worker ran the turn long
    before; one unlocked read then says so, instead of the claim's locks and commit. The same read goes
    first in a process whose wake listener may have run the turn already; there the delivery holds the
    process's turn slot while it runs (``worker.delivery_slot``), or — the slot still taken by a woken
    turn after ``HERMES_AFFINITY_DEADLINE`` — passes the turn on to the shared queue (``"passed_on"``).

    Returns ``{"turn": <turn id>, "turn_status": <status>}`` — ``"skipped"`` when this delivery had
    nothing to do, ``"passed_on"`` when it sent the turn to the shared queue again — which Celery logs as ``Task …run_turn[<task id>] succeeded in …: {'turn': …,
    'turn_status': 'failed'}``: the task ran, the turn failed. The turn's own end line
    (``hermes_sessions.turns``) names this task id."""
    # A process with a wake listener (worker/wake.py) has usually run the turn by the time its message
    # arrives: the same read, instead of waiting for the slot and then the claim's locks.
    if (fallback or worker.wake_listening()) and not selectors.turn_is_queued(turn_id=turn_id):
        return {"turn": str(turn_id), "turn_status": "skipped"}
    with worker.delivery_slot(timeout=settings.HERMES_AFFINITY_DEADLINE) as free:
        if not free:  # busy with a woken turn that Celery cannot see: any idle worker takes this one
            logger.info("turn %s: this worker is busy with a woken turn past HERMES_AFFINITY_DEADLINE; passed on "
                        "to the shared queue", turn_id)
            services.turn_pass_on(turn_id)
            return {"turn": str(turn_id), "turn_status": "passed_on"}
        turn = worker.turn_execute(turn_id=turn_id, task_id=self.request.id)
    return {"turn": str(turn_id), "turn_status": turn.status if turn is not None else "skipped"}


@shared_task(name="hermes_sessions.tasks.sweep_turns", ignore_result=True)
def sweep_turns() -> dict[str, int]:
    """Periodic (Celery beat): recover turns of dead workers, re-send lost tasks, purge old keys."""
    return vars(worker.turns_sweep())
