"""The worker's approval desk: codex asks, a person decides, codex gets the answer (``docs/contract.md`` §9).

A turn registers itself while it talks to codex (``turn_asks``, around ``drive_turn`` in
``execution._drive``). When codex sends an approval-like request, the client's dispatcher thread calls
``ask`` (``codex.server_requests.make_server_request_handler``): it finds the running turn by the
request's ``threadId`` (``TurnControl.thread_id``), records the approval
(``services.approval_request``) and waits for its row to change — reading it every ``POLL_SECONDS``
(one primary-key read; no transaction or lock is held while waiting). The row is the truth: whatever
it says when the wait ends is what codex is answered, once (I9).

While a request waits:

* the turn thread keeps reading codex's notifications, and the lease keeps being renewed by the
  scheduler's heartbeat job (``heartbeats.py``): waiting costs the turn's app-server process and its
  reader threads, and two idle database connections (the turn thread's, and this thread's, kept between
  reads until codex is answered); no transaction, no lock (``make bench-approvals``, ``docs/operating.md`` §3);
* once the request has waited ``PARK_AFTER`` seconds the turn **parks** (``AskingTurn.park``,
  ``execution._Handover.park``, ``runners.py``): the worker's slot — the Celery pool slot that delivered
  it, or the permit of ``wake.TurnSlots`` a woken turn runs on — is free for other turns, while the turn keeps its runner
  thread and its app-server process (codex keeps the request in that process only). Past
  ``HERMES_MAX_PARKED_TURNS`` parked turns in the process, a waiting turn keeps its slot;
* the wait is not counted against ``CODEX_TURN_TIMEOUT`` (``TurnControl.person_waits``); it is bounded by
  ``HERMES_APPROVAL_TIMEOUT_SECONDS`` per turn (all its waits together), which the turn's time limits
  include (``time_limits.turn_time_limits``). At its end the approval is ``expired`` and codex is
  answered ``decline``;
* a cancel or interrupt of the turn (``turn_cancel`` and the interrupting enqueue close its pending
  approvals in their transactions) or the time limit end the wait at once: codex is answered ``decline``
  (``cancel`` when the turn was cancelled and codex offered it);
* a lost claim, or the turn's codex ending without the turn (a requeue), end the wait too but leave the
  row pending: the claim that runs the turn next carries it over when codex asks the same request
  again, and a decision given meanwhile applies there (``services.approval_request``, A8).

Whatever the row says when the wait ends is stamped ``answered_at`` before codex is answered with it
(``services.approval_answered``): a decision reaches codex at most once.

``thread/increment_elicitation`` is not sent: on codex 0.171.0 it pauses only the output window of a
command already running (unified exec's ``yield_time_ms``), and codex keeps no timer on a request that
waits for our answer (``docs/codex.md`` §5: a command approval answered 35 s late still ran the command).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connection
from django.utils import timezone

from ..codex.runner import TurnControl
from ..codex.server_requests import CANCEL, DECLINE, FILE_CHANGE, ApprovalRequest, Verdict
from ..models import Approval
from ..services import approvals as approval_services

logger = logging.getLogger(__name__)

#: How often a waiting request reads its approval row (seconds).
POLL_SECONDS = 0.25
#: How long a request whose turn is not registered yet is held for it (an early ``turn/start``, sent
#: while the turn was claimed, may make codex ask before ``execution._drive`` registered the turn).
MATCH_SECONDS = 5.0
#: How long a file-change request waits for its item's ``item/started`` (which carries the diff).
CHANGES_SECONDS = 1.0
#: How long a request waits for a person before its turn parks (seconds): a decision given at once (a
#: person watching, a client that decides by rule) leaves the turn on its permit, and costs no hand-over.
PARK_AFTER = 1.0


@dataclass
class AskingTurn:
    """A turn running here that codex may ask about: its ids, claim, control, and the seconds of
    waiting it has left (``budget``)."""

    turn_id: uuid.UUID
    token: uuid.UUID
    control: TurnControl
    budget: float
    unattended: bool = False  # approval_policy "never": nobody is asked anything (A7)
    asked: int = 0  # approvals recorded in this claim (``TurnOutcome.approvals``)
    ended: threading.Event = field(default_factory=threading.Event)
    # Frees the worker's permit while a person decides: ``park(token=, control=)`` → whether it parked
    # (``execution._Handover.park``); ``None``: the turn keeps its permit (no runner: an eager task, a test).
    park: Callable[..., bool] | None = None
    parked: bool = False


_lock = threading.Lock()
_turns: list[AskingTurn] = []


@contextmanager
def turn_asks(*, turn_id: uuid.UUID, token: uuid.UUID, control: TurnControl, approval_policy: str = "untrusted",
              park: Callable[..., bool] | None = None) -> Iterator[AskingTurn]:
    """Register the claimed turn for the block: codex's requests on its thread are put to a person —
    unless ``approval_policy`` is ``never`` (codex then asks no approval, but a question from
    ``request_user_input`` is answered fail-closed at once rather than left to wait). ``park``: see
    ``AskingTurn``."""
    turn = AskingTurn(turn_id=turn_id, token=token, control=control, park=park,
                      budget=float(settings.HERMES_APPROVAL_TIMEOUT_SECONDS), unattended=approval_policy == "never")
    with _lock:
        _turns.append(turn)
    try:
        yield turn
    finally:
        turn.ended.set()  # a request still waiting ends now: the turn is over
        with _lock:
            _turns.remove(turn)


def _find(thread_id: str) -> AskingTurn | None:
    end = time.monotonic() + MATCH_SECONDS
    while True:
        with _lock:
            found = next((t for t in _turns if thread_id and t.control.thread_id == thread_id), None)
        if found is not None or time.monotonic() >= end:
            return found
        time.sleep(0.05)


def ask(request: ApprovalRequest) -> Verdict | None:
    """Put ``request`` to a person and wait for the decision (module docstring). Runs on the client's
    dispatcher thread, whose database connection it closes before returning. ``None`` when no turn of
    this process runs the request's thread or its claim is gone: the handler then answers fail-closed."""
    turn = _find(request.thread_id)
    if turn is not None and turn.unattended:
        return None
    if turn is None:
        logger.warning("codex asked %s on thread %s, which no turn here runs; answered fail-closed",
                       request.method, request.thread_id)
        return None
    try:
        return _ask(turn, request)
    except DatabaseError:
        logger.exception("turn %s: could not record or read an approval; codex is answered decline", turn.turn_id)
        return Verdict(DECLINE)
    finally:
        connection.close()  # this thread's own connection: not left open between requests


def _ask(turn: AskingTurn, request: ApprovalRequest) -> Verdict | None:
    if request.kind == FILE_CHANGE:
        _add_changes(turn, request)
    turn.asked += 1
    request.request_id = str(turn.asked)
    started = time.monotonic()
    approval = approval_services.approval_request(turn_id=turn.turn_id, token=turn.token, request=request,
                                                  timeout=turn.budget)
    if approval is None:
        return None  # the claim is gone
    if approval.is_pending:
        # A row carried over from an earlier claim keeps its own expiry: every wait for it ends (A5).
        left = min(turn.budget, (approval.expires_at - timezone.now()).total_seconds())
        turn.control.person_waits(True)
        try:
            waited = _wait(turn, approval, deadline=started + max(left, 0.0))
        finally:
            turn.control.person_waits(False)
            turn.budget = max(0.0, turn.budget - (time.monotonic() - started))
        if waited is None:
            # Left pending for the claim that runs the turn next, which carries it over (A8); this codex
            # is being abandoned or is done, and runs nothing on this answer.
            return Verdict(DECLINE)
        approval = waited
    if not approval_services.approval_answered(approval_id=approval.pk, attempt=approval.attempt):
        logger.warning("turn %s: approval %s was answered already or moved to another claim; codex is "
                       "answered decline", turn.turn_id, approval.pk)
        return Verdict(DECLINE)  # applied at most once (I9)
    return _verdict(approval, request)


def _wait(turn: AskingTurn, approval: Approval, *, deadline: float) -> Approval | None:
    """Wait until the row is decided, or end it: expired at ``deadline``, cancelled once the turn is
    cancelled or out of time. ``None`` — the row left pending — when this claim stops without the turn
    ending: the claim lost, or the turn's codex done (a requeue, a retry); the next claim carries it over."""
    control = turn.control
    park_at = time.monotonic() + PARK_AFTER
    while True:
        current = Approval.objects.filter(pk=approval.pk).first()
        if current is None or not current.is_pending:
            return current or approval
        if control.abandon.is_set() or turn.ended.is_set():
            return None
        stop = _stop_reason(turn)
        if stop:
            return approval_services.approval_close(approval_id=approval.pk, status=Approval.Status.CANCELLED,
                                                    reason=stop)
        if time.monotonic() >= deadline:
            return approval_services.approval_close(
                approval_id=approval.pk, status=Approval.Status.EXPIRED,
                reason=f"no decision within HERMES_APPROVAL_TIMEOUT_SECONDS "
                       f"({settings.HERMES_APPROVAL_TIMEOUT_SECONDS:g} s for the turn's approvals); answered decline")
        if turn.park is not None and not turn.parked and park_at and time.monotonic() >= park_at:
            park_at = 0.0  # once per wait: refused (the bound), this wait keeps the slot
            turn.parked = turn.park(token=turn.token, control=control)
        control.interrupt.wait(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def _stop_reason(turn: AskingTurn) -> str:
    control = turn.control
    if control.interrupt.is_set():
        return "the turn was cancelled or interrupted while the approval waited"
    if control.time_limit:
        return f"the turn ran out of time while the approval waited ({control.time_limit})"
    return ""


def _verdict(approval: Approval, request: ApprovalRequest) -> Verdict:
    """What codex is answered for the row as it stands: the person's decision; ``decline`` for an
    expired one; ``cancel`` (if codex offered it, else ``decline``) for one cancelled with its turn."""
    if approval.status in (Approval.Status.EXPIRED, Approval.Status.PENDING):
        return Verdict(DECLINE)
    if approval.status == Approval.Status.CANCELLED and approval.decision != CANCEL:
        return Verdict(CANCEL if CANCEL in request.decisions else DECLINE)
    return Verdict(approval.decision, dict(approval.response or {}))


def _add_changes(turn: AskingTurn, request: ApprovalRequest) -> None:
    """A file-change request names only its item: the paths and diff come from the item's
    ``item/started``, which the turn thread may not have read yet (``TurnControl.file_changes``)."""
    end = time.monotonic() + CHANGES_SECONDS
    while request.item_id not in turn.control.file_changes and time.monotonic() < end:
        time.sleep(0.02)
    changes = turn.control.file_changes.get(request.item_id) or []
    request.details["changes"] = [
        {"path": str(c.get("path") or ""), "kind": c.get("kind"), "diff": str(c.get("diff") or "")}
        for c in changes if isinstance(c, dict)]
