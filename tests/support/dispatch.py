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
