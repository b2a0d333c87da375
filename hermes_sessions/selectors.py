"""Read queries used by the REST API and the admin — the only place that knows how sessions are
annotated for display. Everything here reads; writes belong to ``hermes_sessions.services``.

Selectors are keyword-only and return querysets (or one row, raising the model's ``DoesNotExist``).
Per-session counts are correlated subqueries rather than joins, so a list of sessions costs one
query no matter how many turns, messages or notices each has (no N+1, no join fan-out).
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, IntegerField, Max, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce, Greatest

from .models import SESSION_ID_RE, CodexBinding, Message, Notice, Session, Turn

# ``request.user`` as Django and DRF type it. Lookups go by ``user.pk``: an anonymous user (pk None)
# owns nothing, although the API's IsAuthenticated never lets one get here.
User = AbstractBaseUser | AnonymousUser

_SESSION_ID = re.compile(SESSION_ID_RE)  # anchored with \A…\Z, so a trailing newline is refused


def is_valid_session_id(value: Any) -> bool:
    """True when ``value`` is a string that is a well-formed session id (``models.SESSION_ID_RE``,
    a trailing newline is refused)."""
    return isinstance(value, str) and _SESSION_ID.match(value) is not None


def _per_session_count(queryset: QuerySet) -> Coalesce:
    """``COUNT(*)`` of ``queryset`` rows whose ``session`` is the outer row, as an int (0 when none)."""
    counted = (
        queryset.filter(session=OuterRef("pk")).order_by().values("session").annotate(n=Count("pk")).values("n")[:1]
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def _active_thread_subquery() -> Subquery:
    return Subquery(
        CodexBinding.objects.filter(session=OuterRef("pk"), status=CodexBinding.Status.ACTIVE).values("thread_id")[:1]
    )


def _annotate_sessions(queryset: QuerySet[Session]) -> QuerySet[Session]:
    """Add ``active_thread_id`` (str | None), ``turn_count``, ``unacknowledged_notice_count`` and
    ``last_activity`` (the later of ``updated_at`` and the newest turn event) to each session."""
    latest_turn_event = (
        Turn.objects.filter(session=OuterRef("pk"))
        .order_by()
        .values("session")
        .annotate(at=Max(Coalesce("finished_at", "started_at", "created_at")))
        .values("at")[:1]
    )
    return queryset.annotate(
        active_thread_id=_active_thread_subquery(),
        turn_count=_per_session_count(Turn.objects.all()),
        unacknowledged_notice_count=_per_session_count(Notice.objects.filter(acknowledged_at__isnull=True)),
        # Coalesce keeps this portable: SQLite's MAX() (Greatest) is NULL when any argument is.
        last_activity=Greatest("updated_at", Coalesce(Subquery(latest_turn_event), "updated_at")),
    )


def session_list(*, user: User) -> QuerySet[Session]:
    """The sessions ``user`` owns, newest activity first, annotated as in ``_annotate_sessions``:
    ``active_thread_id``, ``turn_count``, ``unacknowledged_notice_count``, ``last_activity``."""
    return _annotate_sessions(Session.objects.filter(owner_id=user.pk)).order_by("-updated_at", "id")


def session_admin_list() -> QuerySet[Session]:
    """Every session (staff view), with its owner joined and the same annotations as ``session_list``."""
    return _annotate_sessions(Session.objects.select_related("owner"))


def session_get(*, user: User, session_id: Any) -> Session:
    """The annotated session ``session_id`` owned by ``user``.

    Raises ``Session.DoesNotExist`` when the id is malformed (never reaches the database, so a NUL
    byte or an over-long id cannot fail the query), unknown, or owned by someone else — callers
    cannot tell these apart, by design (invariant I7).
    """
    if not is_valid_session_id(session_id):
        raise Session.DoesNotExist(f"no session {session_id!r}")
    return session_list(user=user).get(pk=session_id)


def turn_get(*, user: User, turn_id: Any) -> Turn:
    """The turn ``turn_id`` of one of ``user``'s sessions.

    Raises ``Turn.DoesNotExist`` when ``turn_id`` is not a UUID, is unknown, or belongs to another
    user's session.
    """
    try:
        pk = turn_id if isinstance(turn_id, uuid.UUID) else uuid.UUID(str(turn_id))
    except (ValueError, TypeError, AttributeError) as exc:
        raise Turn.DoesNotExist(f"no turn {turn_id!r}") from exc
    return Turn.objects.get(pk=pk, session__owner_id=user.pk)


def turn_list_newest_first(*, session: Session) -> QuerySet[Turn]:
    """The session's turns, newest first (``GET /api/sessions/{id}/turns/``; the unique
    ``(session, seq)`` index serves the order)."""
    return Turn.objects.filter(session=session).order_by("-seq")


def message_list(*, session: Session) -> QuerySet[Message]:
    """The session's transcript rows, ordered by ``seq``."""
    return Message.objects.filter(session=session).order_by("seq")


def notice_list(*, session: Session, unacknowledged_only: bool = False) -> QuerySet[Notice]:
    """The session's notices, newest first; only the unacknowledged ones when asked."""
    queryset = Notice.objects.filter(session=session)
    if unacknowledged_only:
        queryset = queryset.filter(acknowledged_at__isnull=True)
    return queryset.order_by("-created_at", "-id")


def binding_list(*, session: Session) -> QuerySet[CodexBinding]:
    """The session's codex bindings, oldest first (the active one, if any, is the newest)."""
    return CodexBinding.objects.filter(session=session).order_by("created_at", "id")


def turn_list(*, session: Session) -> QuerySet[Turn]:
    """The session's turns in the order they were accepted (``seq``)."""
    return Turn.objects.filter(session=session).order_by("seq")


def active_thread_id(*, session: Session) -> str | None:
    """The thread id of the session's active codex binding, or ``None`` when it has none.
    Uses the ``active_thread_id`` annotation when the session came from ``session_list``."""
    if hasattr(session, "active_thread_id"):
        return session.active_thread_id
    return (
        CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE)
        .values_list("thread_id", flat=True)
        .first()
    )
