"""The operator's log of turns: exactly one INFO line per turn end, from the ``hermes_sessions.turns``
logger, written by the service that ends the turn once its transaction has committed::

    turn 0192… ended status=failed session=sess-1 thread_action=resumed attempt=1 task=5f0c… reason="the model call failed with HTTP 500 (codex: internalServerError): We’re …"

``task`` is the Celery task id of the delivery that ended it (``wake`` when the worker ran it on its
NOTIFY wake-up, ``worker/wake.py``; ``-`` when no task did: an API cancel of a queued turn, the sweep
giving up on a lost worker's turn), so Celery's own ``Task …run_turn[<task id>]``
lines can be matched to the turn. ``reason`` is the turn's ``error`` as a JSON string (newlines escaped),
cut to :data:`REASON_CHARS` characters; ``""`` for a turn that succeeded.

The same fields ride on the record as ``extra`` (``turn_fields``), so ``HERMES_LOG_FORMAT=json`` writes
them as keys of the line's JSON object (``project/log_format.py``; ``tests/test_log_format.py``).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.db import transaction

from ..metrics.process import TurnEnd, turn_ended
from ..models import Turn

logger = logging.getLogger("hermes_sessions.turns")

REASON_CHARS = 300

# The Celery task id of the delivery running in this thread (set by ``turn_execute``): the commit
# functions it reaches (finalize, fail, requeue) log it without every signature carrying it.
_task_id: ContextVar[str] = ContextVar("hermes_turn_task_id", default="")


@contextmanager
def delivery(task_id: str | None) -> Iterator[None]:
    """Within the block, turn ends logged by this thread name Celery task ``task_id``."""
    token = _task_id.set(task_id or "")
    try:
        yield
    finally:
        _task_id.reset(token)


def turn_fields(turn: Turn, *, task_id: str = "") -> dict[str, Any]:
    """The fields of ``turn``'s end line, passed to the record as ``extra`` (``HERMES_LOG_FORMAT=json``
    writes them as keys, ``project/log_format.py``): ``turn``, ``session``, ``thread_action``, ``status``,
    ``attempt`` (int), ``task``, ``reason`` (the text, not JSON-quoted) — each as the text line shows it
    — and ``timings`` (the turn's phase durations in ms, ``Turn.timings``; JSON only)."""
    reason = " ".join((turn.error or "").split())
    if len(reason) > REASON_CHARS:
        reason = reason[: REASON_CHARS - 1] + "…"
    return {"turn": str(turn.pk), "session": turn.session_id, "thread_action": turn.thread_action or "-",
            "status": turn.status, "attempt": turn.attempt, "task": task_id or "-", "reason": reason,
            "timings": dict(turn.timings or {})}


def turn_line(fields: dict[str, Any]) -> str:
    """The log line of a turn's end from its ``turn_fields`` (see the module docstring for its shape)."""
    return (
        f"turn {fields['turn']} ended status={fields['status']} session={fields['session']} "
        f"thread_action={fields['thread_action']} attempt={fields['attempt']} task={fields['task']} "
        f"reason={json.dumps(fields['reason'], ensure_ascii=False)}"
    )


def turn_ended_on_commit(turn: Turn) -> None:
    """Log ``turn``'s end (its fields as they are now) and count it in this process's metrics
    (``metrics.process.turn_ended``) once the current transaction commits; nothing is logged or counted
    if it rolls back. Call it where a turn reaches ``succeeded``, ``failed`` or ``cancelled``."""
    fields = turn_fields(turn, task_id=_task_id.get())
    line = turn_line(fields)
    end = TurnEnd.of(turn)

    def ended() -> None:
        logger.info(line, extra=fields)
        turn_ended(end)

    transaction.on_commit(ended)
