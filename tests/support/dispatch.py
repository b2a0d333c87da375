"""Holding back the Celery task sends of ``run_turn`` in tests, so a test can play the worker by hand."""
from __future__ import annotations

from typing import Any

import pytest


def hold_dispatches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record ``run_turn.apply_async`` calls instead of sending them; returns the list of turn ids that
    would have been sent (``services/dispatch.py`` looks the task up in the app registry, which holds
    this same task object)."""
    from hermes_sessions import tasks

    sent: list[str] = []

    def record(*args: Any, **kwargs: Any) -> None:
        task_args = kwargs.get("args") if "args" in kwargs else (args[0] if args else [])
        sent.append(str(task_args[0]))

    monkeypatch.setattr(tasks.run_turn, "apply_async", record)
    return sent


def claimed_with_writer(user: Any, monkeypatch: pytest.MonkeyPatch, text: str = "hi") -> tuple[Any, Any, Any, Any]:
    """A new session of ``user`` with one turn posted (dispatches held) and claimed by hand, and that
    claim's stream writer: ``(session, turn, claim, writer)``."""
    from hermes_sessions import services
    from hermes_sessions.services.events import TurnEventWriter

    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text=text, user=user)
    claim = services.turn_claim(turn_id=turn.id)
    writer = TurnEventWriter(turn_id=turn.id, session_id=session.id, token=claim.token, attempt=claim.attempt)
    return session, turn, claim, writer
