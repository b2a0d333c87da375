"""Read queries used by the REST API and the admin — the only place that knows how sessions are
annotated for display. Everything here reads; writes belong to ``hermes_sessions.services``.

Selectors are keyword-only and return querysets (or one row, raising the model's ``DoesNotExist``).
Per-session counts are correlated subqueries rather than joins, so a list of sessions costs one
query no matter how many turns, messages or notices each has (no N+1, no join fan-out).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.contrib.postgres.search import SearchQuery, SearchVectorExact
from django.db import DatabaseError, connection, transaction
from django.db.models import Count, Exists, IntegerField, Max, OuterRef, QuerySet, Subquery, Sum, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, Greatest

from .models import (
    MESSAGE_SEARCH_CONFIG,
    SESSION_ID_RE,
    Approval,
    CodexBinding,
    CodexRollout,
    Message,
    MessageSearchVector,
    MetricReport,
    Notice,
    RolloutChunk,
    Session,
    Turn,
    TurnEvent,
    WebhookDelivery,
    WebhookEndpoint,
)
from .sql import query

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


def last_activity_expression() -> Greatest:
    """A session's last activity (datetime): the later of ``updated_at`` and its newest turn event
    (finished, else started, else created). The admin list, ``session_list`` and the operator
    commands (``export_sessions --since``, ``prune_sessions --before``) all use this one definition."""
    latest_turn_event = (
        Turn.objects.filter(session=OuterRef("pk"))
        .order_by()
        .values("session")
        .annotate(at=Max(Coalesce("finished_at", "started_at", "created_at")))
        .values("at")[:1]
    )
    # PostgreSQL's GREATEST ignores the NULL of a session without turns.
    return Greatest("updated_at", Subquery(latest_turn_event))


def _annotate_sessions(queryset: QuerySet[Session]) -> QuerySet[Session]:
    """Add ``active_thread_id`` (str | None), ``turn_count``, ``unacknowledged_notice_count`` and
    ``last_activity`` (``last_activity_expression``) to each session."""
    return queryset.annotate(
        active_thread_id=_active_thread_subquery(),
        turn_count=_per_session_count(Turn.objects.all()),
        unacknowledged_notice_count=_per_session_count(Notice.objects.filter(acknowledged_at__isnull=True)),
        last_activity=last_activity_expression(),
    )


def session_list(*, user: User) -> QuerySet[Session]:
    """The sessions ``user`` owns, newest activity first, annotated as in ``_annotate_sessions``:
    ``active_thread_id``, ``turn_count``, ``unacknowledged_notice_count``, ``last_activity``."""
    return _annotate_sessions(Session.objects.filter(owner_id=user.pk)).order_by("-updated_at", "id")


def session_admin_list() -> QuerySet[Session]:
    """Every session (staff view), with its owner joined and the same annotations as ``session_list``."""
    return _annotate_sessions(Session.objects.select_related("owner"))


def session_get(*, user: User, session_id: Any) -> Session:
    """The annotated session ``session_id`` owned by ``user`` (``session_list``'s annotations), for
    what shows a session. Raises ``Session.DoesNotExist`` as ``session_owned`` does (I7)."""
    if not is_valid_session_id(session_id):
        raise Session.DoesNotExist(f"no session {session_id!r}")
    return session_list(user=user).get(pk=session_id)


def session_owned(*, user: User, session_id: Any) -> Session:
    """The session row ``session_id`` owned by ``user``, without ``session_list``'s annotations: for
    what only needs the row (a session's turns, transcript, notices, a new turn). One primary-key
    lookup; the annotations' subqueries (counts, last activity, active thread) cost more than the rest
    of such a request's reads.

    Raises ``Session.DoesNotExist`` when the id is malformed (never reaches the database, so a NUL
    byte or an over-long id cannot fail the query), unknown, or owned by someone else — callers
    cannot tell these apart, by design (invariant I7).
    """
    if not is_valid_session_id(session_id):
        raise Session.DoesNotExist(f"no session {session_id!r}")
    return Session.objects.get(pk=session_id, owner_id=user.pk)


def session_is_owned(*, user: User, session_id: Any) -> bool:
    """Whether ``session_owned`` would find the session (one ``EXISTS``; a malformed id: ``False``)."""
    return is_valid_session_id(session_id) and Session.objects.filter(pk=session_id, owner_id=user.pk).exists()


def turn_get(*, user: User, turn_id: Any) -> Turn:
    """The turn ``turn_id`` of one of ``user``'s sessions.

    Raises ``Turn.DoesNotExist`` when ``turn_id`` is not a UUID, is unknown, or belongs to another
    user's session.
    """
    try:
        pk = turn_id if isinstance(turn_id, uuid.UUID) else uuid.UUID(str(turn_id))
    except (ValueError, TypeError, AttributeError) as exc:
        raise Turn.DoesNotExist(f"no turn {turn_id!r}") from exc
    return with_waiting(Turn.objects.filter(session__owner_id=user.pk)).get(pk=pk)


def with_waiting(turns: QuerySet[Turn]) -> QuerySet[Turn]:
    """``turns`` annotated ``waiting_for_approval``: a pending approval of the turn exists — asked by its
    current claim, or by an earlier one whose worker was lost, which the re-run carries over (one
    ``EXISTS`` on the ``approval_turn_status`` index per turn)."""
    pending = Approval.objects.filter(turn_ref=OuterRef("pk"), status=Approval.Status.PENDING)
    return turns.annotate(waiting_for_approval=Exists(pending))


def approval_list(*, session: Session, status: str | None = None) -> QuerySet[Approval]:
    """The session's approvals, newest first; only those in ``status`` when given (one of
    ``Approval.Status``; the caller checks it)."""
    queryset = Approval.objects.filter(session=session)
    if status:
        queryset = queryset.filter(status=status)
    return queryset.select_related("decided_by").order_by("-created_at", "-id")


def approval_get(*, user: User, approval_id: Any) -> Approval:
    """The approval ``approval_id`` of one of ``user``'s sessions. Raises ``Approval.DoesNotExist`` when
    ``approval_id`` is not a UUID, is unknown, or belongs to another user's session (I7)."""
    try:
        pk = approval_id if isinstance(approval_id, uuid.UUID) else uuid.UUID(str(approval_id))
    except (ValueError, TypeError, AttributeError) as exc:
        raise Approval.DoesNotExist(f"no approval {approval_id!r}") from exc
    return Approval.objects.select_related("decided_by").get(pk=pk, session__owner_id=user.pk)


def webhook_endpoint_list(*, user: User) -> QuerySet[WebhookEndpoint]:
    """``user``'s webhook endpoints, newest first."""
    return WebhookEndpoint.objects.filter(owner_id=user.pk).order_by("-created_at", "-id")


def webhook_endpoint_get(*, user: User, endpoint_id: Any) -> WebhookEndpoint:
    """The webhook endpoint ``endpoint_id`` of ``user``. Raises ``WebhookEndpoint.DoesNotExist`` when the
    id is not a positive integer, is unknown, or is another user's endpoint (I7)."""
    text = str(endpoint_id)
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 2**63:
        raise WebhookEndpoint.DoesNotExist(f"no webhook endpoint {endpoint_id!r}")
    return WebhookEndpoint.objects.get(pk=int(text), owner_id=user.pk)


def webhook_delivery_list(*, endpoint: WebhookEndpoint) -> QuerySet[WebhookDelivery]:
    """``endpoint``'s deliveries, newest first, with their attempts (one more query per page); of an
    ``all_sessions`` endpoint whose owner is no longer staff, only those of the owner's own sessions."""
    deliveries = endpoint.deliveries.order_by("-id").prefetch_related("attempt_log")
    if endpoint.all_sessions and not endpoint.owner.is_staff:
        deliveries = deliveries.filter(session_id__in=Session.objects.filter(owner_id=endpoint.owner_id).values("id"))
    return deliveries


def webhook_delivery_claimed(*, delivery_id: int, token: uuid.UUID) -> WebhookDelivery | None:
    """Delivery ``delivery_id`` with its endpoint while claim ``token`` holds it and the endpoint is active
    (the sender's read before an attempt); ``None`` otherwise."""
    return (WebhookDelivery.objects.select_related("endpoint")
            .filter(pk=delivery_id, claim_token=token, endpoint__active=True).first())


def turn_is_queued(*, turn_id: Any) -> bool:
    """Whether turn ``turn_id`` is still queued (one indexed read, no lock); False for a malformed id."""
    try:
        pk = turn_id if isinstance(turn_id, uuid.UUID) else uuid.UUID(str(turn_id))
    except (ValueError, TypeError, AttributeError):
        return False
    return Turn.objects.filter(pk=pk, status=Turn.Status.QUEUED).exists()


def turn_list_newest_first(*, session: Session) -> QuerySet[Turn]:
    """The session's turns, newest first (``GET /api/sessions/{id}/turns/``; the unique
    ``(session, seq)`` index serves the order)."""
    return with_waiting(Turn.objects.filter(session=session)).order_by("-seq")


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


def turn_events_after(*, after_id: int, limit: int, turn_id: Any = None, session_id: str | None = None) -> QuerySet[TurnEvent]:
    """The stream events of one turn (``turn_id``) or of a whole session (``session_id``) with
    ``id > after_id``, oldest first, at most ``limit`` (``docs/contract.md`` §8). Uses the
    ``(turn, id)`` / ``(session, id)`` indexes."""
    queryset = TurnEvent.objects.filter(id__gt=after_id)
    queryset = queryset.filter(turn_id=turn_id) if turn_id is not None else queryset.filter(session_id=session_id)
    return queryset.order_by("id")[:limit]


def session_last_event_id(*, session_id: str) -> int:
    """The id of the session's newest stream event, 0 when it has none."""
    return TurnEvent.objects.filter(session_id=session_id).aggregate(m=Max("id"))["m"] or 0


def session_export_list(
    *, owner: str | None = None, session_ids: list[str] | None = None, since: datetime | None = None
) -> QuerySet[Session]:
    """Sessions for ``manage.py export_sessions``, by id, each annotated with ``last_activity``:
    only those of the user named ``owner`` (username), only ``session_ids``, only those active at or
    after ``since`` (aware datetime). Filters combine with AND; none given means every session."""
    queryset = Session.objects.annotate(last_activity=last_activity_expression())
    if owner is not None:
        queryset = queryset.filter(owner__username=owner)
    if session_ids:
        queryset = queryset.filter(pk__in=session_ids)
    if since is not None:
        queryset = queryset.filter(last_activity__gte=since)
    return queryset.order_by("id")


def session_inactive_list(*, before: datetime) -> QuerySet[Session, tuple[str, datetime, int]]:
    """``(session id, last activity, queued + running turns)`` of each session whose last activity
    (``last_activity_expression``) is older than ``before`` (aware datetime), by id."""
    active = Turn.objects.filter(status__in=(Turn.Status.QUEUED, Turn.Status.RUNNING))
    return (
        Session.objects.annotate(last_activity=last_activity_expression(), active_turns=_per_session_count(active))
        .filter(last_activity__lt=before)
        .order_by("id")
        .values_list("id", "last_activity", "active_turns")
    )


def rollout_list(*, session: Session) -> QuerySet[CodexRollout]:
    """The session's stored codex rollouts (headers only, no chunk bytes), oldest first."""
    return CodexRollout.objects.filter(session=session).order_by("updated_at", "id")


def rollout_chunk_list(*, rollout: CodexRollout) -> QuerySet[RolloutChunk]:
    """A rollout's chunks in ``seq`` order, bytes included (export only: nothing that lists sessions
    or turns reads chunks)."""
    return RolloutChunk.objects.filter(rollout=rollout).order_by("seq")


# --- the admin's pages -----------------------------------------------------------------------------


def session_with_unacknowledged_notices(queryset: QuerySet[Session], *, present: bool) -> QuerySet[Session]:
    """``queryset`` narrowed to sessions that have (``present``) or have not an unacknowledged notice
    (an ``EXISTS`` on the partial index ``notice_unacked_session``, no join fan-out)."""
    unacked = Exists(Notice.objects.filter(session=OuterRef("pk"), acknowledged_at__isnull=True))
    return queryset.filter(unacked if present else ~unacked)


def unacknowledged_notice_count() -> int:
    """How many notices wait for an operator, across sessions (one ``COUNT`` over the partial index)."""
    return Notice.objects.filter(acknowledged_at__isnull=True).count()


def pending_approval_count() -> int:
    """How many approvals wait for a person's decision, across sessions (one ``COUNT`` over the partial
    index ``approval_pending``)."""
    return Approval.objects.filter(status=Approval.Status.PENDING).count()


#: Rows per transcript page in the admin (and the largest page the admin asks for).
TRANSCRIPT_PAGE_ROWS = 50
#: Turns shown on a session page and in its timeline (the newest; the turns list has the rest).
SESSION_PAGE_TURNS = 50


@dataclass(frozen=True)
class TranscriptPage:
    """One page of transcript rows, newest first: ``rows`` (at most the limit asked for), and
    ``older_before``, the key (``seq`` in a session, ``id`` across sessions) to pass as ``before_…``
    for the next older page (``None`` on the last page)."""

    rows: list[Message]
    older_before: int | None


def transcript_page(
    *, session_id: str, before_seq: int | None = None, limit: int = TRANSCRIPT_PAGE_ROWS, q: str = ""
) -> TranscriptPage:
    """The session's transcript newest first: rows with ``seq < before_seq`` (all when ``None``), at
    most ``limit`` (1…``TRANSCRIPT_PAGE_ROWS``), matching ``q`` when given (``message_search_filter``).

    One query, keyset on the unique ``(session_id, seq)`` index read backwards (``LIMIT limit + 1`` to
    know whether an older page exists): its cost does not grow with the transcript. No ``COUNT``."""
    limit = max(1, min(limit, TRANSCRIPT_PAGE_ROWS))
    rows = Message.objects.filter(session_id=session_id)
    if q:
        rows = message_search_filter(rows, q)
    if before_seq is not None:
        rows = rows.filter(seq__lt=before_seq)
    page = list(rows.order_by("-seq")[: limit + 1])
    older = page[limit - 1].seq if len(page) > limit else None
    return TranscriptPage(rows=page[:limit], older_before=older)


def session_page_turns(*, session_id: str, limit: int = SESSION_PAGE_TURNS) -> list[Turn]:
    """The session's newest ``limit`` turns, oldest first (for the session page and its timeline);
    one query on the ``(session, seq)`` unique index."""
    newest = list(Turn.objects.filter(session_id=session_id).order_by("-seq")[:limit])
    return newest[::-1]


#: ``Turn.usage`` keys summed by ``session_token_totals`` (codex's ``thread/tokenUsage/updated``
#: figures, stored by ``services.turns._finish``; docs/codex.md).
USAGE_KEYS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_output_tokens", "total_tokens")


def session_token_totals(*, session_id: str) -> dict[str, int]:
    """Sum of each ``USAGE_KEYS`` figure over the session's turns (0 where no turn reported one), in
    one aggregate query. On PostgreSQL a key holding a non-number would fail the cast; the service
    stores only codex's integers."""
    sums = {
        key: Coalesce(Sum(Cast(KT(f"usage__{key}"), output_field=IntegerField())), Value(0)) for key in USAGE_KEYS
    }
    return {k: int(v) for k, v in Turn.objects.filter(session_id=session_id).aggregate(**sums).items()}


# --- message search --------------------------------------------------------------------------------

#: Longest search text accepted (characters); longer is a client error, not a slow query.
MAX_SEARCH_CHARS = 200


class InvalidSearch(ValueError):
    """The search text is empty (after trimming) or longer than ``MAX_SEARCH_CHARS``; the message says which."""


def search_text(value: Any) -> str:
    """``value`` (a query-string ``q``) trimmed; raises ``InvalidSearch`` when it is not a string, is
    longer than ``MAX_SEARCH_CHARS`` (counted before trimming, as the API's schema says) or holds
    nothing but whitespace."""
    if not isinstance(value, str):
        raise InvalidSearch("q must be a string")
    if len(value) > MAX_SEARCH_CHARS:
        raise InvalidSearch(f"q is {len(value)} characters; the limit is {MAX_SEARCH_CHARS}")
    text = value.strip()
    if not text:
        raise InvalidSearch("q must not be empty")
    _check_tsquery(text)
    return text


def _check_tsquery(text: str) -> None:
    """Raise ``InvalidSearch`` when PostgreSQL cannot parse ``text`` as a web-search query: e.g. 33 or
    more ``-`` in a row (PostgreSQL 15: ``tsquery stack too small``), which used to surface as a 500 where
    the search ran. One tiny query in a savepoint, so the refusal leaves the caller's transaction usable."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(query("message_search_nodes"), [MESSAGE_SEARCH_CONFIG, text])
    except DatabaseError as exc:
        raise InvalidSearch(f"q cannot be searched: {str(exc).strip()}") from exc


def message_search_filter(queryset: QuerySet[Message], q: str) -> QuerySet[Message]:
    """``queryset`` narrowed to rows whose ``content`` matches ``q``.

    Full-text search in web-search syntax (``websearch_to_tsquery``: words are ANDed,
    ``"a phrase"``, ``or``, ``-word``), with ``models.MESSAGE_SEARCH_CONFIG`` on both sides, through
    the GIN index ``message_content_search`` on ``models.MessageSearchVector`` (migration 0004; the
    expression here is the index's)."""
    vector = MessageSearchVector("content")
    query = SearchQuery(q, config=MESSAGE_SEARCH_CONFIG, search_type="websearch")
    return queryset.filter(SearchVectorExact(vector, query))


def message_search(*, session: Session, q: str) -> QuerySet[Message]:
    """Rows of ``session`` matching ``q`` (``message_search_filter``), newest first (``-seq``).
    Page it by keyset on ``seq`` (the API's cursor, ``transcript_page`` in the admin)."""
    return message_search_filter(Message.objects.filter(session=session), q).order_by("-seq")


def message_search_for_user(*, user: User, q: str) -> QuerySet[Message]:
    """Rows matching ``q`` in the sessions ``user`` owns, newest first (``-id``: ids grow with
    insertion), with ``session`` joined. Page it by keyset on ``id``."""
    rows = Message.objects.filter(session__owner_id=user.pk)
    return message_search_filter(rows, q).select_related("session").order_by("-id")


def message_search_all(*, q: str, before_id: int | None = None, limit: int = TRANSCRIPT_PAGE_ROWS) -> TranscriptPage:
    """Staff search across every session: at most ``limit`` (1…``TRANSCRIPT_PAGE_ROWS``) rows matching
    ``q`` with ``id < before_id`` (keyset; all when ``None``), newest first, each with its session;
    ``older_before`` is then an ``id``. One query, no ``COUNT``."""
    limit = max(1, min(limit, TRANSCRIPT_PAGE_ROWS))
    rows = message_search_filter(Message.objects.all(), q)
    if before_id is not None:
        rows = rows.filter(id__lt=before_id)
    page = list(rows.select_related("session").order_by("-id")[: limit + 1])
    return TranscriptPage(rows=page[:limit], older_before=page[limit - 1].id if len(page) > limit else None)


@dataclass(frozen=True)
class MetricsState:
    """The state ``GET /metrics`` reads from PostgreSQL at each scrape (``metrics_state``)."""

    queued: int
    running: int
    leases_expired: int
    notices_unacknowledged: int
    approvals_pending: int
    turn_workers: int
    warm_threads: int
    queues: list[tuple[str, int, float]]  # (queue, queued turns, oldest one's age in seconds)


def metrics_state(*, turn_queue: str, fresh_after: datetime) -> MetricsState:
    """The counts of ``queries.sql``'s ``metrics_state`` and ``metrics_queues`` (two statements, no
    transaction): ``turn_queue`` names the shared queue, ``fresh_after`` is the oldest heartbeat still fresh."""
    with connection.cursor() as cursor:
        cursor.execute(query("metrics_state"), [fresh_after])
        row = cursor.fetchone()
        cursor.execute(query("metrics_queues"), [turn_queue, fresh_after])
        queues = [(str(q), int(n), float(age or 0.0)) for q, n, age in cursor.fetchall()]
    assert row is not None
    queued, running, expired, notices, approvals, workers, warm = (int(v) for v in row)
    return MetricsState(queued=queued, running=running, leases_expired=expired, notices_unacknowledged=notices,
                        approvals_pending=approvals, turn_workers=workers, warm_threads=warm, queues=queues)


def metric_reports() -> list[tuple[str, str, datetime, list, list]]:
    """Every process's metric report: ``(role, worker, reported_at, counters, gauges)``."""
    return list(MetricReport.objects.values_list("role", "worker", "reported_at", "counters", "gauges"))
