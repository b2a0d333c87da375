"""Approval writes — the only writer of ``Approval`` (``docs/contract.md`` §10, invariant I9).

    approval_request  (worker)  → Approval(pending) + ``approval.requested``; or the same request an earlier
                                  claim of the turn asked, carried over (a re-run after a lost worker);
                                  or, when the session holds an ``acceptForSession`` grant for the same
                                  request (``fingerprint``), one accepted at once (+ ``approval.resolved``)
    approval_decide   (API)     → pending → accepted | declined | cancelled by a person + ``approval.resolved``
    approval_close    (worker)  → pending → expired (HERMES_APPROVAL_TIMEOUT_SECONDS) or cancelled (the turn
                                  stopped) + ``approval.resolved``; a decision that landed first stands
    approval_answered (worker)  → ``answered_at``: the decision is on its way to codex (at most once)
    approvals_close_for_turn    → every pending approval of a turn, inside the caller's transaction that
                                  ends or cancels the turn (``turns.turn_cancel``, the enqueue that
                                  interrupts it, the finalize, the sweep giving up)

Every status change runs under the turn's locks (``locks.lock_session_and_turn``: the session row, then
the turn row), then the approval row: a decision and the worker's expiry serialize there, so exactly one
of them ends a pending approval and the worker answers codex with what the row says (I9: once, only a
decision codex offered, only while the turn runs). A decision on an approval that is not pending, or
whose turn ended or is cancelled, raises ``ApprovalClosed`` (HTTP 409) and reaches nobody.
"""
from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils import timezone

from ..codex.server_requests import ACCEPT_FOR_SESSION, CANCEL, DECLINE, USER_INPUT, ApprovalRequest
from ..models import Approval, Turn
from ..sanitize import clean_json
from . import events
from .errors import ServiceError
from .locks import lock_session_and_turn
from .users import require_user

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

#: Event kinds on the turn's and the session's streams (``docs/contract.md`` §8).
REQUESTED, RESOLVED = "approval.requested", "approval.resolved"
MAX_ANSWER_CHARS = 20_000  # one answer to a question
MAX_RESPONSE_BYTES = 64_000  # the JSON of the answers or the form


class ApprovalClosed(ServiceError):
    """The approval is no longer pending, or its turn no longer runs (HTTP 409); ``approval`` is it as it is."""

    def __init__(self, message: str, *, approval: Approval) -> None:
        super().__init__(message)
        self.approval = approval


class InvalidDecision(ServiceError):
    """A decision the approval does not offer, or answers that do not fit its questions (HTTP 400);
    ``available`` lists the decisions it offers."""

    def __init__(self, message: str, *, available: list[str]) -> None:
        super().__init__(message)
        self.available = available


def _status_of(decision: str) -> str:
    if decision == DECLINE:
        return Approval.Status.DECLINED
    if decision == CANCEL:
        return Approval.Status.CANCELLED
    return Approval.Status.ACCEPTED


def event_data(approval: Approval) -> dict[str, Any]:
    """The ``approval.requested`` / ``approval.resolved`` payload: ``{"approval", "kind", "status",
    "decision", "request", "available_decisions", "expires_at", "reason"}`` (ids as text)."""
    return {"approval": str(approval.pk), "kind": approval.kind, "status": approval.status,
            "decision": approval.decision, "request": approval.request,
            "available_decisions": approval.available_decisions,
            "expires_at": approval.expires_at.isoformat(), "reason": approval.reason}


def approval_request(*, turn_id: uuid.UUID, token: uuid.UUID, request: ApprovalRequest,
                     timeout: float) -> Approval | None:
    """Record what codex asked in the running turn ``turn_id`` under claim ``token``, pending for at most
    ``timeout`` seconds (``expires_at``). Returns the row the worker answers codex from:

    * the same request (``request.request_id`` within the claim) asked again: the row as it is;
    * the same request an earlier claim of this turn asked (a re-run after a lost worker: same kind and
      ``fingerprint``) whose decision no codex has been answered with yet (``answered_at`` null): that row,
      carried over to this claim (``attempt``, ``codex_request_id``) — still pending, or already decided,
      in which case the decision applies now and nobody is asked again (``docs/contract.md`` §10, A8);
    * an accepted ``acceptForSession`` approval of the session with the same fingerprint: a new row,
      accepted at once (``decided_by`` null, ``reason`` names the grant);
    * otherwise a new pending row.

    Each carried or new row gets its ``approval.requested`` event on this claim (and ``approval.resolved``
    when it is decided already). Returns ``None`` — nothing written — when the claim is no longer held
    (the worker then answers codex fail-closed)."""
    with transaction.atomic(durable=True):
        locked = lock_session_and_turn(turn_id)
        if locked is None:
            return None
        session, turn = locked
        if turn.status != Turn.Status.RUNNING or turn.claim_token != token:
            return None
        existing = Approval.objects.filter(turn_ref=turn.pk, attempt=turn.attempt,
                                           codex_request_id=request.request_id).first()
        if existing is not None:
            return existing
        fingerprint = request.fingerprint()
        earlier = _earlier_claims_request(turn, kind=request.kind, fingerprint=fingerprint)
        if earlier is not None:
            carried_from = earlier.attempt
            earlier.attempt, earlier.codex_request_id = turn.attempt, request.request_id
            earlier.save(update_fields=["attempt", "codex_request_id"])
            _announce(turn, earlier, carried_from=carried_from)
            return earlier
        now = timezone.now()
        approval = Approval(
            session=session, turn=turn, turn_ref=turn.pk, attempt=turn.attempt, kind=request.kind,
            codex_request_id=request.request_id, codex_item_id=request.item_id[:255],
            request=clean_json(request.as_dict()), available_decisions=request.decisions,
            offered=clean_json(request.offered), fingerprint=fingerprint,
            expires_at=now + timedelta(seconds=max(timeout, 0.0)),
        )
        grant = (Approval.objects.filter(session=session, fingerprint=fingerprint, kind=request.kind,
                                         status=Approval.Status.ACCEPTED, decision=ACCEPT_FOR_SESSION)
                 .order_by("-decided_at").only("pk").first()
                 if ACCEPT_FOR_SESSION in request.decisions else None)
        if grant is not None:
            approval.status, approval.decision, approval.decided_at = Approval.Status.ACCEPTED, ACCEPT_FOR_SESSION, now
            approval.reason = f"accepted for the session by approval {grant.pk}"
        approval.save(force_insert=True)
        _announce(turn, approval)
        return approval


def _earlier_claims_request(turn: Turn, *, kind: str, fingerprint: str) -> Approval | None:
    """The oldest approval of ``turn`` asked by an earlier claim with this kind and fingerprint that no
    codex has been answered from, locked; ``None`` when there is none (or the turn runs its first claim)."""
    if turn.attempt <= 1:
        return None
    return (Approval.objects.select_for_update()
            .filter(turn_ref=turn.pk, attempt__lt=turn.attempt, kind=kind, fingerprint=fingerprint,
                    answered_at__isnull=True)
            .order_by("created_at").first())


def _announce(turn: Turn, approval: Approval, *, carried_from: int | None = None) -> None:
    """``approval.requested`` on ``turn``'s current claim; ``approval.resolved`` too when it is decided.
    A row carried over from claim ``carried_from`` says so (``carried_from_attempt``): the person was
    told of it already, so no ``approval.requested`` webhook goes out for it again (migration 0013's
    trigger skips it)."""
    requested = event_data(approval)
    if carried_from is not None:
        requested["carried_from_attempt"] = carried_from
    kinds = [(REQUESTED, requested)]
    if not approval.is_pending:
        kinds.append((RESOLVED, event_data(approval)))
    events.event_append_many(turn=turn, items=kinds)


def approval_answered(*, approval_id: uuid.UUID, attempt: int) -> bool:
    """Stamp ``answered_at`` on decided approval ``approval_id`` just before the worker of claim
    ``attempt`` answers codex with it; ``False`` — and codex must be answered fail-closed instead — when
    the row is still pending, was answered already, or was carried to another claim meanwhile. One
    conditional UPDATE: a decision is applied at most once (I9). It touches no status, so it needs no
    turn lock: ``approval_decide`` and ``approval_close`` change pending rows only."""
    with transaction.atomic(durable=True):
        return bool(Approval.objects.filter(pk=approval_id, attempt=attempt, answered_at__isnull=True)
                    .exclude(status=Approval.Status.PENDING).update(answered_at=timezone.now()))


def _check_response(approval: Approval, decision: str, answers: Any, content: Any) -> dict[str, Any]:
    """The ``response`` to store for ``decision``, or ``InvalidDecision``: user input accepted needs an
    answer (a string or a list of strings) to every question; an MCP form accepted takes ``content`` (an object)."""
    available = list(approval.available_decisions)
    if decision not in available:
        raise InvalidDecision(f"decision {decision!r} is not offered for this approval; offered: {', '.join(available)}",
                              available=available)
    if decision in (DECLINE, CANCEL):
        return {}
    if approval.kind == USER_INPUT:
        questions = [str(q.get("id") or "") for q in approval.request.get("questions") or []]
        if not isinstance(answers, dict):
            raise InvalidDecision(f"answers is required to accept: an object of question id → answer, for "
                                  f"{', '.join(questions) or 'no questions'}", available=available)
        missing = [q for q in questions if q not in answers]
        unknown = [str(k) for k in answers if str(k) not in questions]
        if missing or unknown:
            raise InvalidDecision(f"answers must answer exactly the questions {questions}; missing {missing}, "
                                  f"unknown {unknown}", available=available)
        clean: dict[str, list[str]] = {}
        for qid, value in answers.items():
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, str) and len(v) <= MAX_ANSWER_CHARS for v in values):
                raise InvalidDecision(f"the answer to {qid!r} must be a string or a non-empty list of strings of "
                                      f"at most {MAX_ANSWER_CHARS} characters", available=available)
            clean[str(qid)] = values
        return clean_json({"answers": clean})
    if approval.kind == Approval.Kind.MCP_ELICITATION and content is not None:
        if not isinstance(content, dict):
            raise InvalidDecision("content must be an object (the form's values)", available=available)
        return clean_json({"content": content})
    return {}


def approval_decide(*, approval_id: uuid.UUID, user: User | AnonymousUser, decision: str,
                    answers: Any = None, content: Any = None) -> Approval:
    """A person's ``decision`` on pending approval ``approval_id`` (the caller checked it is theirs):
    ``accept`` / ``acceptForSession`` / an amendment → ``accepted``, ``decline`` → ``declined``,
    ``cancel`` → ``cancelled``; ``answers`` (user input) or ``content`` (MCP form) are stored in
    ``response``. Raises ``InvalidDecision`` (400: not offered, bad answers) and ``ApprovalClosed`` (409:
    already ended, or its turn ended or is cancelled). A turn taken back after a lost worker still takes
    it: the re-run applies it when codex asks the same request again (A8). Returns the decided approval;
    a waiting worker reads it within ``worker.approvals.POLL_SECONDS``."""
    user = require_user(user)
    turn_ref = Approval.objects.values_list("turn_ref", flat=True).get(pk=approval_id)
    with transaction.atomic():
        locked = lock_session_and_turn(turn_ref)  # the turn's locks first, as every turn write takes them
        approval = Approval.objects.select_for_update().get(pk=approval_id)
        if not approval.is_pending:
            raise ApprovalClosed(f"approval already {approval.status}", approval=approval)
        turn = locked[1] if locked is not None else None
        # A turn taken back after a lost worker (queued, or running a later claim) still takes the
        # decision: its re-run applies it when codex asks the same request again (A8).
        if (turn is None or turn.status not in (Turn.Status.RUNNING, Turn.Status.QUEUED)
                or turn.cancel_requested_at is not None):
            raise ApprovalClosed("the turn that asked no longer runs (ended or cancelled); "
                                 "the decision was not applied", approval=approval)
        if approval.expires_at <= timezone.now():
            # Past its wait with no worker there to expire it (its worker was lost): it expires now — this
            # commits — and the decision is refused (A5); a re-run's request, carried over, is answered decline.
            _close(approval, status=Approval.Status.EXPIRED, turn=turn,
                   reason=f"no decision within HERMES_APPROVAL_TIMEOUT_SECONDS (it expired at "
                          f"{approval.expires_at:%Y-%m-%d %H:%M:%S} UTC)")
            expired = approval
        else:
            expired = None
            response = _check_response(approval, decision, answers, content)
            approval.status, approval.decision, approval.response = _status_of(decision), decision, response
            approval.decided_by, approval.decided_at = user, timezone.now()
            approval.save(update_fields=["status", "decision", "response", "decided_by", "decided_at"])
            events.event_append(turn=turn, kind=RESOLVED, data=event_data(approval))
    if expired is not None:
        raise ApprovalClosed("approval expired: no decision within HERMES_APPROVAL_TIMEOUT_SECONDS; "
                             "the decision was not applied", approval=expired)
    return approval


def approval_close(*, approval_id: uuid.UUID, status: str, reason: str) -> Approval:
    """End pending approval ``approval_id`` as ``status`` (``expired`` or ``cancelled``) with decision
    ``decline`` and ``reason``, by the worker (no user). When a decision committed first, that one
    stands: the approval is returned as it is. Either way the result is what codex is answered."""
    turn_ref = Approval.objects.values_list("turn_ref", flat=True).get(pk=approval_id)
    with transaction.atomic(durable=True):
        locked = lock_session_and_turn(turn_ref)
        approval = Approval.objects.select_for_update().get(pk=approval_id)
        if approval.is_pending:
            _close(approval, status=status, reason=reason, turn=locked[1] if locked is not None else None)
        return approval


def _close(approval: Approval, *, status: str, reason: str, turn: Turn | None) -> None:
    approval.status, approval.decision, approval.reason = status, DECLINE, reason
    approval.decided_at = timezone.now()
    approval.save(update_fields=["status", "decision", "reason", "decided_at"])
    if turn is not None:
        events.event_append(turn=turn, kind=RESOLVED, data=event_data(approval))


def approvals_close_for_turn(*, turn: Turn, status: str = Approval.Status.CANCELLED, reason: str) -> int:
    """Inside the caller's transaction, which holds ``turn``'s locks and ends or cancels it: every pending
    approval of ``turn`` ends as ``status`` with ``reason`` (one ``approval.resolved`` each). Returns how
    many. A decision arriving afterwards is 409 and never reaches codex (``../shared/pitfalls.md``,
    octos-org/octos#646)."""
    pending = list(Approval.objects.select_for_update().filter(turn_ref=turn.pk, status=Approval.Status.PENDING))
    for approval in pending:
        _close(approval, status=status, reason=reason, turn=turn)
    return len(pending)
