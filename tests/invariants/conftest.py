"""Fixtures for the invariant tests (docs/contract.md §6, I1–I7).

These tests drive the code only through its stable surfaces: the services, ``history_seed``, the
codex client with the scripted app-server, the REST API, the models and the shared factories. The
codex runner is imported in exactly one place, ``turn_outcome`` below, so that renaming or moving
it is a one-line change here.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from hermes_sessions import services
from hermes_sessions.models import Turn


@pytest.fixture
def turn_outcome():
    """The runner's result type (what the codex driver hands to ``turn_finalize``/``turn_fail``).

    The one import of the runner in tests/invariants: after a rename, fix it here only."""
    from hermes_sessions.codex.runner import TurnOutcome

    return TurnOutcome


def expire_lease(turn: Turn) -> None:
    """Pretend the claiming worker vanished: its lease ran out a second ago."""
    Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def queue_turn(*, session, text: str, user) -> Turn:
    """``turn_enqueue`` without running the turn: in a test wrapped in a transaction the dispatch
    (sent on commit) never fires, so the turn stays queued for the test to claim by hand."""
    return services.turn_enqueue(session=session, input_text=text, user=user)


def deliver(turn_id) -> dict[str, str]:
    """Run the Celery task for ``turn_id`` in this process, as a worker receiving it would."""
    from hermes_sessions import tasks

    return tasks.run_turn(str(turn_id))
