"""Celery tasks: thin, id-taking, calling services. Sent by name from ``services/dispatch.py``."""
import logging
import os
import uuid

from celery import Task, shared_task
from django.conf import settings

from . import selectors, services, worker

SOFT_TIME_LIMIT, TIME_LIMIT = worker.turn_time_limits()
logger = logging.getLogger(__name__)


@shared_task(
    bind=True,
    name="hermes_sessions.tasks.run_turn",
    ignore_result=True,
    # Backstops behind the runner's own turn deadline (which interrupts codex and fails the turn). The
    # runner thread the turn executes on has the same two outside Celery (worker/time_limits.py), which
    # also bound it once it parked and this task returned (worker/runners.py).
    soft_time_limit=SOFT_TIME_LIMIT,
    time_limit=TIME_LIMIT,
)
def run_turn(self: Task, turn_id: str) -> dict[str, str]:
    """Run turn ``turn_id`` if it is its session's next turn (see ``worker.turn_execute``).

    In a process whose wake listener runs turns too (``worker/wake.py``), one unlocked read goes first (the
    listener may have run the turn already), and the delivery holds one of the process's
    ``HERMES_WORKER_TURNS`` permits while it runs (``worker.delivery_slot``). Should woken turns hold every
    permit for longer than ``HERMES_AFFINITY_DEADLINE`` — Celery cannot see them and counted this process
    idle — the turn is left
    queued with no dispatch recorded (``services.turn_undispatched``): the sweep's next round, on any
    worker, dispatches it to the shared queue again (``"turn_status": "busy"``).

    The turn runs on one of the process's runner threads (``worker.turn_run``): should it wait for a
    person, it parks and this task returns ``"turn_status": "parked"``, its pool slot free; the runner
    writes the turn's end (``worker/runners.py``).

    Returns ``{"turn": <turn id>, "turn_status": <status>}`` — ``"skipped"`` when this delivery had
    nothing to do — which Celery logs as ``Task …run_turn[<task id>] succeeded in …: {'turn': …,
    'turn_status': 'failed'}``: the task ran, the turn failed. The turn's own end line
    (``hermes_sessions.turns``) names this task id."""
    if worker.wake_listening() and not selectors.turn_is_queued(turn_id=turn_id):
        return {"turn": str(turn_id), "turn_status": "skipped"}
    # Waiting up to the deadline lets a short woken turn (most are < 1 s) end first: refusing after 0.5 s cost
    # a third of one worker's throughput (make bench, 50 sessions on 1 worker), each refused turn waiting for
    # the sweep's next round while the slot sat idle.
    with worker.delivery_slot(timeout=settings.HERMES_AFFINITY_DEADLINE) as free:
        if not free:  # every permit busy with woken turns that Celery cannot see: any idle worker takes this one
            logger.info("turn %s: this worker is busy with a woken turn; left to the sweep, which dispatches it "
                        "to the shared queue again", turn_id)
            services.turn_undispatched(turn_id)
            return {"turn": str(turn_id), "turn_status": "busy"}
        turn = worker.turn_run(turn_id=turn_id, task_id=self.request.id)
    return {"turn": str(turn_id), "turn_status": turn.status if turn is not None else "skipped"}


@shared_task(name="hermes_sessions.tasks.sweep_turns", ignore_result=True)
def sweep_turns() -> dict[str, int]:
    """Periodic (Celery beat): the sweep (``worker.turns_sweep``): expired leases, unclaimed turns, dead
    workers, old idempotency keys."""
    return vars(worker.turns_sweep())


# Backstops behind each attempt's own deadline (HERMES_WEBHOOK_TIMEOUT_SECONDS for the whole exchange):
# a batch never holds its worker longer than its claim's lease.
_WEBHOOK_LIMIT = int(services.webhooks.claim_lease_seconds(int(settings.HERMES_WEBHOOK_BATCH)))


@shared_task(name="hermes_sessions.tasks.deliver_webhooks", ignore_result=True,
             soft_time_limit=_WEBHOOK_LIMIT, time_limit=_WEBHOOK_LIMIT + 30)
def deliver_webhooks(delivery_ids: list[int], token: str) -> dict[str, int]:
    """One attempt of each webhook delivery that claim ``token`` holds (``worker.webhooks_deliver``; the
    sweep's round claims them and sends this task to ``HERMES_WEBHOOK_QUEUE``)."""
    return worker.webhooks_deliver(delivery_ids=[int(i) for i in delivery_ids], token=uuid.UUID(str(token)))


@shared_task(name="hermes_sessions.tasks.log_worker_threads", ignore_result=True)
def log_worker_threads() -> list[str]:
    """Log the names of the threads of the worker process that runs it (``worker.thread_names``), one
    line: ``worker process <pid> threads: <name>, …``. For operators and
    ``tests/e2e/test_worker_threads.py`` (docs/architecture.md §7)."""
    names = worker.thread_names()
    logger.info("worker process %s threads: %s", os.getpid(), ", ".join(names))
    return names
