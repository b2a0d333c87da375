"""Celery tasks: thin, id-taking, calling services. Sent by name from ``services/dispatch.py``."""
import logging

from celery import Task, shared_task

from . import selectors, services, worker
from .worker.time_limits import turn_time_limits

SOFT_TIME_LIMIT, TIME_LIMIT = turn_time_limits()
#: How long a Celery delivery waits for a woken turn to free the process's turn slot before it leaves its
#: turn to the sweep (``run_turn``): a woken warm turn takes ~0.1–0.2 s; longer ones are not waited for.
DELIVERY_SLOT_WAIT_SECONDS = 0.5
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
def run_turn(self: Task, turn_id: str) -> dict[str, str]:
    """Run turn ``turn_id`` if it is its session's next turn (see ``worker.turn_execute``).

    In a process whose wake listener runs turns too (``worker/wake.py``), one unlocked read goes first (the
    listener may have run the turn already), and the delivery holds the process's turn slot while it runs
    (``worker.delivery_slot``). Should a woken turn hold the slot for longer than
    ``DELIVERY_SLOT_WAIT_SECONDS`` — Celery cannot see it and counted this process idle — the turn is left
    queued with no dispatch recorded (``services.turn_undispatched``): the sweep's next round, on any
    worker, dispatches it to the shared queue again (``"turn_status": "busy"``).

    Returns ``{"turn": <turn id>, "turn_status": <status>}`` — ``"skipped"`` when this delivery had
    nothing to do — which Celery logs as ``Task …run_turn[<task id>] succeeded in …: {'turn': …,
    'turn_status': 'failed'}``: the task ran, the turn failed. The turn's own end line
    (``hermes_sessions.turns``) names this task id."""
    if worker.wake_listening() and not selectors.turn_is_queued(turn_id=turn_id):
        return {"turn": str(turn_id), "turn_status": "skipped"}
    with worker.delivery_slot(timeout=DELIVERY_SLOT_WAIT_SECONDS) as free:
        if not free:  # busy with a woken turn that Celery cannot see: any idle worker takes this one
            logger.info("turn %s: this worker is busy with a woken turn; left to the sweep, which dispatches it "
                        "to the shared queue again", turn_id)
            services.turn_undispatched(turn_id)
            return {"turn": str(turn_id), "turn_status": "busy"}
        turn = worker.turn_execute(turn_id=turn_id, task_id=self.request.id)
    return {"turn": str(turn_id), "turn_status": turn.status if turn is not None else "skipped"}


@shared_task(name="hermes_sessions.tasks.sweep_turns", ignore_result=True)
def sweep_turns() -> dict[str, int]:
    """Periodic (Celery beat): the sweep (``worker.turns_sweep``): expired leases, unclaimed turns, dead
    workers, old idempotency keys."""
    return vars(worker.turns_sweep())
