"""Retention: deleting whole sessions whose last activity is older than a date
(``manage.py prune_sessions``).

A session goes with every row it owns — transcript, turns, bindings, notices, stored rollouts and
their chunks, and the Idempotency-Key rows that point at it — in one transaction per session, under
the session's row lock. Whole rollouts are deleted, never single chunks, so their TOAST storage is
reclaimed rather than bloated (``../shared/pitfalls.md``, rollouts as rows). A session with a queued
or running turn is refused, checked again under the lock (a turn accepted meanwhile keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet

from .. import selectors
from ..models import (
    Approval,
    CodexBinding,
    CodexRollout,
    IdempotencyKey,
    Message,
    Notice,
    RolloutChunk,
    Session,
    Turn,
    TurnEvent,
)

ACTIVE = (Turn.Status.QUEUED, Turn.Status.RUNNING)


@dataclass(frozen=True)
class PruneOutcome:
    """One session's fate: ``deleted`` (False with ``dry_run``, or when refused); ``refused`` gives
    the reason it was kept; ``rows`` counts its rows per kind (``messages``, ``turns``, ``bindings``,
    ``notices``, ``rollouts``, ``rollout_chunks``, ``turn_events``, ``idempotency_keys``) — deleted, or that would be with ``dry_run``."""

    session_id: str
    last_activity: datetime
    deleted: bool
    refused: str
    rows: dict[str, int]


def _owned_rows(session_id: str) -> dict[str, QuerySet[Any]]:
    # Children first, so each delete is a plain DELETE … WHERE (no cascade collection left to do).
    return {
        "rollout_chunks": RolloutChunk.objects.filter(rollout__session_id=session_id),
        "rollouts": CodexRollout.objects.filter(session_id=session_id),
        "notices": Notice.objects.filter(session_id=session_id),
        "bindings": CodexBinding.objects.filter(session_id=session_id),
        "messages": Message.objects.filter(session_id=session_id),
        "turn_events": TurnEvent.objects.filter(session_id=session_id),  # the live stream's rows (§8)
        "approvals": Approval.objects.filter(session_id=session_id),  # the audit trail goes with its session only
        "turns": Turn.objects.filter(session_id=session_id),
        "idempotency_keys": IdempotencyKey.objects.filter(
            Q(scope="sessions", object_id=session_id) | Q(scope=f"turns:{session_id}")
        ),
    }



def session_prune_candidates(*, before: datetime) -> list[tuple[str, datetime, int]]:
    """``(session id, last activity, queued + running turns)`` of every session last active before
    ``before`` (aware datetime), by id (``selectors.session_inactive_list``)."""
    return list(selectors.session_inactive_list(before=before))


def session_prune(*, session_id: str, before: datetime, dry_run: bool = False) -> PruneOutcome | None:
    """Delete ``session_id`` with all its rows if it is still last active before ``before`` and has
    no queued or running turn, checked under its row lock; ``dry_run`` checks and counts, deletes
    nothing. Returns ``None`` when the session is gone or became active again meanwhile."""
    with transaction.atomic():
        if Session.objects.select_for_update().filter(pk=session_id).first() is None:
            return None
        found = selectors.session_inactive_list(before=before).filter(pk=session_id).first()
        if found is None:
            return None
        _id, last_activity, active_turns = found
        owned = _owned_rows(session_id)
        if active_turns:
            return PruneOutcome(session_id=session_id, last_activity=last_activity, deleted=False,
                                refused=f"{active_turns} queued or running turn(s)", rows={})
        if dry_run:
            rows = {name: qs.count() for name, qs in owned.items()}
            return PruneOutcome(session_id=session_id, last_activity=last_activity, deleted=False, refused="", rows=rows)
        rows = {name: qs.delete()[0] for name, qs in owned.items()}
        Session.objects.filter(pk=session_id).delete()
    return PruneOutcome(session_id=session_id, last_activity=last_activity, deleted=True, refused="", rows=rows)
