"""Turn writes. Every function is keyword-only, runs its writes inside one short
``transaction.atomic`` block under the session's row lock, and never holds a transaction or row lock
while codex works (invariant I3). The turn lifecycle:

    turn_enqueue   (API)     → Turn(queued); the Celery task is sent after the row commits
    turn_claim     (worker)  → Turn(running, lease) + the user's message row, if it is the session's next turn
    turn_heartbeat (worker)  → renews the lease while codex works; reports a cancel request or a lost claim
    turn_finalize  (worker)  → transcript rows + binding publish/rotation + notice + turn state, one transaction
    turn_fail      (worker)  → failed turn with a reason; a proven-dead thread still ends its binding
    turn_cancel    (API)     → a queued turn is cancelled; a running one is asked to interrupt

``turn_finalize`` and ``turn_fail`` are guarded by the claim token, so a second delivery of the same
task, or a worker that lost its claim, changes nothing (invariant I2). The worker's writes (claim,
heartbeat, requeue, finalize/fail) are ``transaction.atomic(durable=True)``: each is a commit point and
must never be folded into a caller's transaction. Celery tasks are sent through ``dispatch.py``.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from .. import policy
from ..codex.runner import TurnOutcome
from ..history_seed import MIN_SEED_ROW_CHARS, TOOL_RESULT_CHARS, render_history_seed
from ..models import CodexBinding, Message, Session, Turn
from ..sanitize import clean_json, clean_text
from ..selectors import is_valid_session_id
from ..sql import query, value_rows
from ..sql.rows import pk_value, save_values, touch
from . import approvals, bindings, dispatch, events, rollouts, routing
from .errors import InvalidInput, SessionBusy, SessionLocked
from .locks import bound_lock_waits, lock_session_and_turn, lock_session_and_turn_later, lock_wait_timed_out
from .pipelining import Batch, Later, pipelined_atomic
from .turn_log import turn_ended_on_commit
from .users import require_user

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

logger = logging.getLogger(__name__)

MAX_INPUT_CHARS = 200_000
MAX_ERROR_CHARS = 8_000
ON_BUSY = ("enqueue", "reject", "interrupt")


# --- turns: accept ---------------------------------------------------------------------------------


def turn_enqueue(
    *, session: Session | None = None, input_text: str, user: User | AnonymousUser | None, on_busy: str = "enqueue",
    owned_session_id: str | None = None,
) -> Turn:
    """Accept one user input for ``session`` as a queued turn and schedule it.

    ``owned_session_id`` instead of ``session`` (the API's ``POST``): the session of that id owned by
    ``user``, checked by the enqueue's locking UPDATE itself (``… WHERE id = … AND owner_id = …``) —
    no read of the session before it, one round trip fewer; ``Session.DoesNotExist`` when it is
    malformed, unknown or someone else's (nothing written; invariant I7: the three look alike).

    ``on_busy`` says what to do when the session already has a turn running or queued:
    ``enqueue`` (run after them, in order), ``reject`` (raise ``SessionBusy`` naming that turn) or
    ``interrupt`` (ask the running turn to stop via ``turn/interrupt``, then run after it). The turn
    gets the session's next turn ``seq`` under the session row lock; the Celery task ``run_turn`` is
    sent only after the row commits. Raises ``InvalidInput`` for empty or oversized
    (> ``MAX_INPUT_CHARS``) input or an unknown ``on_busy``, and ``SessionLocked`` when another writer
    held the session's lock longer than ``HERMES_POST_LOCK_TIMEOUT_MS`` (PostgreSQL's ``lock_timeout``,
    SQLSTATE 55P03; nothing written).
    """
    text = clean_text(input_text)
    if not text.strip():
        raise InvalidInput("input must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidInput(f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    if on_busy not in ON_BUSY:
        raise InvalidInput(f"on_busy must be one of {', '.join(ON_BUSY)}")
    created_by = None if user is None else require_user(user)
    if session is not None:
        session_id, owner_id = str(session.pk), None
    elif owned_session_id is not None and created_by is not None:
        if not is_valid_session_id(owned_session_id):  # never reaches the database (a NUL byte, an over-long id)
            raise Session.DoesNotExist(f"no session {owned_session_id!r}")
        session_id, owner_id = owned_session_id, created_by.pk
    else:
        raise TypeError("turn_enqueue needs session, or owned_session_id and a user")
    try:
        return _enqueue(session_id=session_id, owner_id=owner_id, text=text, created_by=created_by, on_busy=on_busy)
    except OperationalError as exc:
        if lock_wait_timed_out(exc):
            raise SessionLocked(f"session {session_id} is locked by another operation; nothing was queued, retry "
                                "shortly") from exc
        raise


def _enqueue(*, session_id: str, owner_id: int | None, text: str, created_by: User | None, on_busy: str) -> Turn:
    if on_busy == "enqueue" and not connection.in_atomic_block:
        return _enqueue_in_one_trip(session_id=session_id, owner_id=owner_id, text=text, created_by=created_by)
    # Two round trips (``pipelining``): the lock, the draw and the reads; then the writes with the COMMIT.
    # (``reject`` must see the busy turn before it writes, ``interrupt`` closes its pending approvals;
    # inside a caller's transaction nothing is pipelined.)
    with pipelined_atomic() as batch:
        bound_lock_waits(batch)  # the wait for the session's lock below, and any other, until this transaction ends
        # The session's row lock, taken by the UPDATE that draws the turn's seq (FOR NO KEY UPDATE — the
        # mode of the event lock, locks.lock_session_for_events — held to the commit): every other writer
        # of the session waits here, and this one waits for them (I3, docs/contract.md §8).
        now = timezone.now()
        drawn: Later[Any]
        if owner_id is None:
            drawn = batch.add(query("draw_turn_seq"), [now, session_id])
        else:
            drawn = batch.add(query("draw_turn_seq_owned"), [now, session_id, owner_id])
        # A statement of its own, after the lock: its snapshot has every turn committed while it waited.
        row = batch.add(query("enqueue_reads"), [
            session_id, Turn.Status.RUNNING, Turn.Status.QUEUED, session_id, Turn.Status.RUNNING,
            Turn.Status.QUEUED, *routing.session_route_params(session_id), session_id]).one()
        if row is None or drawn.rowcount != 1:  # the UPDATE found no row to lock (or not the owner's)
            raise Session.DoesNotExist(f"no session {session_id!r}")
        seq, busy_id, busy_status, route_value = row
        route = routing.parse_route(route_value)
        if busy_id is not None and on_busy == "reject":
            raise SessionBusy(f"turn {busy_id} of this session is {busy_status}", turn_id=str(busy_id))
        if busy_id is not None and on_busy == "interrupt":
            running = Turn.objects.filter(session_id=session_id, status=Turn.Status.RUNNING,
                                          cancel_requested_at__isnull=True).values_list("pk", flat=True)
            for running_id in list(running):
                locked = lock_session_and_turn(running_id)  # the session's lock is held already (the draw)
                if locked is not None:
                    _ask_to_stop(locked[1], reason="the turn was interrupted by a newer input")
        # Stamped as sent now, in the row: the task goes out right after this transaction commits.
        turn = Turn(session_id=session_id, seq=seq, input=text, created_by=created_by, dispatched_at=timezone.now())
        _insert_turn(turn, batch)
        # Its event lock: held already (above). Its NOTIFY goes out after the task (event_notify_on_commit).
        queued = events.event_append_batched(batch, turn=turn, items=[(events.QUEUED, {"seq": turn.seq})], notify=False)
        # Dispatched only as its session's next turn (a turn queued behind another is dispatched by that
        # one's end): a holder whose wake listener listens hears of it by NOTIFY at the commit (``wake``),
        # any other worker by the shared queue.
        if busy_id is None:
            if route is not None and route.wakeable and dispatch.routes_to_workers():
                routing.wake_batched(batch, queue=route.queue, turn_id=turn.id, session_id=session_id, text=text)
            else:
                dispatch.turn_dispatch_on_commit(turn.id, stamped=True, wake=False)
        events.event_notify_on_commit(queued)
    return turn


def _enqueue_in_one_trip(*, session_id: str, owner_id: int | None, text: str, created_by: User | None) -> Turn:
    """``_enqueue`` for ``on_busy`` ``enqueue``, as the outermost transaction:
    one round trip (``pipelining``) from ``BEGIN`` to ``COMMIT`` — the lock and the draw, the turn's INSERT
    with the drawn ``seq`` read from the locked session row (and its ``created_at`` / ``dispatched_at`` from
    the clock after the lock's wait), its ``queued`` event (its ``seq`` likewise), then the
    reads and the conditional wake as one statement — where ``_enqueue`` needs
    two: none of these writes depends on what the reads find (a turn is queued, busy or not), so Python
    has nothing to decide between them. The wake's ``pg_notify`` is the one ``_enqueue`` holds (``wake``),
    sent by the statement itself when the route is a wakeable worker's, no other turn of the session is
    running or queued and the turn was inserted; its channel named in SQL (``queries.sql``:
    ``enqueue_reads_and_wake``).
    Every statement after the lock runs after it (a statement's snapshot is taken when it starts): the
    reads see every turn committed while this one waited, as in ``_enqueue``. A session that is not the
    caller's (or no session) matches nothing: nothing is written, no wake is sent, the commit is empty,
    ``Session.DoesNotExist`` (I7). Measured with ``HERMES_LATENCY_MARKS``: the second round trip and the
    Python between them were ~1.5 ms of a warm turn's way from the ``POST`` to the woken worker.

    The ``queued`` event's ``NOTIFY`` for the event streams is its own statement's (sent at the COMMIT),
    not a ``pg_notify`` round trip after the task's send as in ``_enqueue``: that standalone transaction
    took ~0.8 ms of PostgreSQL's time (its log, ``log_min_duration_statement = 0`` under ``make
    bench-warm``) exactly while the woken worker claimed the turn and codex started it."""
    now = timezone.now()
    turn = Turn(session_id=session_id, seq=0, input=text, created_by=created_by, dispatched_at=now)
    touch(turn, "created_at")
    can_wake = dispatch.routes_to_workers()
    payload = routing.wake_payload(turn_id=turn.id, session_id=session_id,
                                text=text if settings.HERMES_EARLY_START else None) if can_wake else ""
    owned = owner_id is not None
    with pipelined_atomic() as batch:
        bound_lock_waits(batch)  # the wait for the session's lock below, and any other, until this transaction ends
        # The session's row lock (as in ``_enqueue``), held to the commit.
        owner = [owner_id] if owned else []
        drawn: Later[Any] = batch.add(query("draw_turn_seq_owned" if owned else "draw_turn_seq"), [now, session_id, *owner])
        inserted: Later[Any] = batch.add(query("turn_insert_drawn_owned" if owned else "turn_insert_drawn"),
                                         [*save_values(turn, _DRAWN_TURN_FIELDS), session_id, *owner])
        turn._state.adding, turn._state.db = False, connection.alias
        events.event_append_batched(batch, turn=turn, items=[(events.QUEUED, None)], drawn_seq=True)
        reads: Later[Any] = batch.add(query("enqueue_reads_and_wake"), [
            session_id, Turn.Status.RUNNING, Turn.Status.QUEUED, turn.id, session_id, Turn.Status.RUNNING,
            Turn.Status.QUEUED, turn.id, *routing.session_route_params(session_id), session_id, payload, can_wake,
            turn.id])

        def after_commit() -> None:  # Django runs it after the COMMIT, by then the round trip's results are in
            row = reads.one()
            if row is None or drawn.rowcount != 1:
                return
            # Outside the transaction now. The streams' NOTIFY went with the COMMIT (the event's statement);
            # so did the holder's wake, if one was sent. A turn queued behind another is dispatched by that
            # one's end.
            if row[1] is None and not row[4]:
                dispatch.turn_dispatch_on_commit(turn.id, stamped=True, wake=False)

        transaction.on_commit(after_commit)
    row = reads.one()
    if row is None or drawn.rowcount != 1:  # the UPDATE found no row to lock (or not the owner's)
        raise Session.DoesNotExist(f"no session {session_id!r}")
    turn.seq = row[0]
    turn.created_at, turn.dispatched_at = inserted.one() or (turn.created_at, now)  # stamped once the lock was held
    return turn


def _insert_turn(turn: Turn, batch: Batch) -> None:
    """``turn.save()`` of a new turn without the ORM's compile: one INSERT of every concrete field
    (``created_at``, ``auto_now_add``, set now as ``save`` would), batched in ``batch``."""
    touch(turn, "created_at")
    batch.add(query("turn_insert"), save_values(turn, _TURN_FIELDS))
    turn._state.adding, turn._state.db = False, connection.alias


# The columns of ``queries.sql``'s ``turn_insert``, in its order; ``turn_insert_drawn`` takes all but the
# three it reads itself (``seq`` from the session row, the two times from the clock after the lock wait).
_TURN_FIELDS = ("id", "session", "seq", "status", "input", "thread_action", "codex_thread_id", "codex_turn_id",
                "codex_methods", "final_text", "error", "usage", "timings", "attempt", "claim_token",
                "lease_expires_at", "dispatched_at", "cancel_requested_at", "created_by", "created_at",
                "started_at", "finished_at")
_DRAWN_TURN_FIELDS = tuple(name for name in _TURN_FIELDS if name not in ("seq", "created_at", "dispatched_at"))


# --- turns: claim ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnClaim:
    """What a worker needs to run a claimed turn. ``token`` must be handed back to finalize/fail."""

    turn_id: uuid.UUID
    session_id: str
    token: uuid.UUID
    input_text: str
    thread_id: str | None  # the active binding's thread, if any
    # The fencing generation of that thread's rollout in PostgreSQL when claimed (None: none stored).
    rollout_generation: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # policy.effective_config(...)
    attempt: int = 1  # >1: an earlier worker died holding this turn
    previous_thread_id: str | None = None  # the fresh thread that earlier worker had started, if any
    # The session's creation time (ISO 8601): with its id, which session this is — an id is free again
    # once its session is deleted (``policy.session_workdir_ready``).
    session_created: str = ""
    # Milliseconds of the worker's steps before codex (``claim_ms``: the claim transaction), merged into
    # the turn's ``timings`` (the bench's phase breakdown).
    timings: dict[str, float] = field(default_factory=dict)


def _lease_deadline() -> datetime:
    return timezone.now() + timedelta(seconds=settings.HERMES_LEASE_SECONDS)


def turn_claim(*, turn_id: uuid.UUID | str) -> TurnClaim | None:
    """Mark the turn running if it is its session's next turn; return ``None`` otherwise.

    A turn runs only when no turn of its session is running and no earlier turn is still queued
    (turns run one at a time, in the order they were accepted — I3). The user's message row is
    written here (once, even when a crashed turn is claimed again), so the transcript order follows
    the order turns actually run. The claim holds a lease of ``HERMES_LEASE_SECONDS`` that the
    worker renews (``turn_heartbeat``). A turn that is not runnable yet is not lost: the turn
    before it dispatches it when it ends, and the sweep re-dispatches any that were dropped.
    A durable transaction: raises ``RuntimeError`` inside another ``atomic`` block. A connection lost
    while its COMMIT was under way is asked about once more on a new one (the claim is returned if it
    committed, else the turn is claimed again); Django's ``OperationalError`` / ``InterfaceError`` otherwise.
    """
    try:
        pk = Turn._meta.pk.to_python(turn_id)
    except (ValueError, TypeError, ValidationError):
        pk = None
    if pk is None:
        logger.warning("turn %s does not exist; nothing to run", turn_id)
        return None
    sent: list[uuid.UUID] = []
    try:
        return _claim(pk, sent)
    except (OperationalError, InterfaceError):
        if not sent:
            raise  # lost before the claim's writes were sent: nothing of it can have committed
    # The connection was lost while the claim's writes and COMMIT were on their way: an
    # answer lost after the COMMIT would leave the turn running under a claim nobody holds until its lease
    # expires, one lost before it queued until the sweep. Ask again on a new connection: ours if it committed,
    # else claimed afresh. A second loss is raised (the task fails; the sweep or the lease recovers the turn).
    connection.close()
    held = _claim_held_by(pk, sent[0])
    if held is not None:
        logger.warning("turn %s: the claim's COMMIT answer was lost; it had committed, running it", pk)
        return held
    logger.warning("turn %s: the claim was not seen committed after its connection was lost; claiming again", pk)
    again = _claim(pk, [])
    if again is None:
        # The lost COMMIT may still have been running when it was asked about (the claim's whole transaction is
        # one write, which the server was still executing): the re-claim's locks waited for it, so its outcome is
        # final now. Found by the proxy test, once in ~20 runs: the re-claim saw the turn running and gave up.
        held = _claim_held_by(pk, sent[0])
        if held is not None:
            logger.warning("turn %s: the claim's COMMIT answer was lost; it had committed, running it", pk)
            return held
    return again


def _claim(pk: uuid.UUID, sent: list[uuid.UUID]) -> TurnClaim | None:
    """``turn_claim``'s transaction; the token of the claim it writes is put in ``sent`` before its COMMIT
    is sent. One round trip (``_claim_in_one_trip``)."""
    return _claim_in_one_trip(pk, sent)


def _claim_in_one_trip(pk: uuid.UUID, sent: list[uuid.UUID]) -> TurnClaim | None:
    """The claim in one round trip (``pipelining``): ``BEGIN``, the session and turn locks
    (``lock_session_and_turn_later``), the decision and its writes (``queries.sql``: ``claim``), the ``running``
    event (written only if that claim happened) and the ``COMMIT``. A turn that may not run commits nothing
    (its locks are released); one whose cancel was asked for while its worker was lost is ended by a second
    transaction (``_end_cancelled_unrun``: rare, not worth its own SQL)."""
    token = uuid.uuid4()
    with pipelined_atomic(durable=True) as batch:
        lock = lock_session_and_turn_later(batch, pk)
        decided: Later[Any] = batch.add(query("claim"), _claim_params(turn_id=pk, token=token, lease=_lease_deadline()))
        events.event_append_claimed_batched(batch, turn_id=pk, token=token, items=[(events.RUNNING, {})])
        sent.append(token)
    locked = lock.get()
    if locked is None:
        logger.warning("turn %s does not exist; nothing to run", pk)
        return None
    session, turn = locked  # as the locks found them, before this claim's writes
    attempt, thread_id, generation = decided.one() or (None, None, None)
    if attempt is None:
        if turn.status == Turn.Status.QUEUED and turn.cancel_requested_at is not None:
            _end_cancelled_unrun(pk)
        return None  # not queued (run or ended already), or not the session's next turn yet (``blocked``)
    return TurnClaim(turn_id=turn.id, session_id=session.id, token=token, input_text=turn.input, thread_id=thread_id,
                     rollout_generation=generation, config=_config_for(session),
                     attempt=attempt, previous_thread_id=turn.codex_thread_id or None,
                     session_created=session.created_at.isoformat())


def _config_for(session: Session) -> dict[str, Any]:
    """``policy.effective_config`` of ``session``, with a staff-only sandbox (``danger-full-access``)
    lowered to ``workspace-write`` when its owner is no longer active staff: the right is checked when a
    turn runs, not only when the session was made (one read, for such sessions only;
    tests/services/test_turns_policy.py)."""
    config = policy.effective_config(session.model_config)
    if config["sandbox"] not in policy.CLIENT_SANDBOXES and not get_user_model().objects.filter(
            pk=session.owner_id, is_staff=True, is_active=True).exists():
        logger.warning("session %s: sandbox %s is reserved to staff and its owner is not (any more); the turn "
                       "runs under workspace-write", session.pk, config["sandbox"])
        config["sandbox"] = "workspace-write"
    return config


def _claim_params(*, turn_id: uuid.UUID, token: uuid.UUID, lease: datetime) -> dict[str, Any]:
    """``queries.sql``'s ``claim`` parameters: the turn, the new claim ``token`` and the lease's end.
    ``started_at``, the user row's ``created_at`` and the session's ``updated_at`` are the statement's own
    clock (``clk``: ``clock_timestamp()``, read once), taken after the locking statement before it — not the
    caller's before the round trip: a claim that waited for the session's lock while the turn before it was
    finalized had a ``started_at`` before that turn's ``finished_at``, which ``make faults`` reports as turns
    that "overlapped or ran out of order"; the one-trip enqueue stamps its times the same way."""
    return {"turn": turn_id, "token": token, "lease": lease, "running": Turn.Status.RUNNING,
            "queued": Turn.Status.QUEUED, "user": Message.Role.USER, "active": CodexBinding.Status.ACTIVE}


def turn_end_cancelled_unrun(session: Session, turn: Turn) -> None:
    """End ``turn`` — cancelled by its user while the worker running it was lost — ``cancelled`` instead
    of running it again: its terminal event, its end line, the session's next turn dispatched, all on
    this transaction's commit. Caller holds the session and turn locks (the claim, or the lease
    take-back, ``recovery._take_back``, so that no ``retrying`` event precedes the ``cancelled`` one)."""
    turn.status, turn.finished_at = Turn.Status.CANCELLED, timezone.now()
    turn.claim_token = turn.lease_expires_at = None
    turn.error = turn.error or "cancelled; not run again after its worker was lost"
    turn.save(update_fields=["status", "finished_at", "error", "claim_token", "lease_expires_at"])
    _close_approvals_of_ended(turn)
    turn_ended_on_commit(turn)
    events.event_terminal(turn=turn)
    dispatch.session_dispatch_next_on_commit(session)


def _close_approvals_of_ended(turn: Turn) -> None:
    """A turn that ran (``attempt`` ≥ 1) and ends without a worker's finalize — given up after its last
    attempt, cancelled while queued for a re-run — may leave an earlier claim's approval pending; it ends
    with the turn, in the caller's transaction (tests/services/test_approvals_rerun.py)."""
    if turn.attempt:
        approvals.approvals_close_for_turn(turn=turn, reason=f"the turn ended ({turn.status}) while it waited")


def _bound_thread(session: Session) -> tuple[str | None, int | None]:
    """The session's active binding's thread and that thread's stored rollout generation (each ``None``
    when there is none), read with the ORM (``queries.sql``'s ``claim`` reads the same in SQL)."""
    binding = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).first()
    stored = rollouts.rollout_state(thread_id=binding.thread_id if binding else None)
    return (binding.thread_id if binding else None), (stored.generation if stored is not None else None)


def _end_cancelled_unrun(pk: uuid.UUID) -> None:
    """End the queued turn ``pk`` ``cancelled`` when its cancel was asked for while its worker was lost
    (``turn_end_cancelled_unrun``), in a transaction of its own under both locks; ``None`` (nothing to run)."""
    with transaction.atomic(durable=True):
        locked = lock_session_and_turn(pk)
        if locked is not None and locked[1].status == Turn.Status.QUEUED and locked[1].cancel_requested_at is not None:
            turn_end_cancelled_unrun(*locked)


def _claim_held_by(pk: uuid.UUID, token: uuid.UUID) -> TurnClaim | None:
    """The claim ``token`` of turn ``pk`` read back, if it holds the running turn (its COMMIT's answer was
    lost): what the claim transaction had read — nobody else changes the session's binding or the thread's
    rollout while the claim holds its turn (I3) — else ``None``."""
    turn = Turn.objects.select_related("session").filter(pk=pk, status=Turn.Status.RUNNING, claim_token=token).first()
    if turn is None:
        return None
    thread_id, generation = _bound_thread(turn.session)
    return TurnClaim(turn_id=turn.id, session_id=turn.session_id, token=token, input_text=turn.input,
                     thread_id=thread_id, rollout_generation=generation,
                     config=_config_for(turn.session), attempt=turn.attempt,
                     previous_thread_id=turn.codex_thread_id or None,
                     session_created=turn.session.created_at.isoformat())


def turn_note_thread(*, turn_id: uuid.UUID, token: uuid.UUID, thread_id: str) -> None:
    """Record the fresh thread a running turn started, before its ``turn/start``: not a binding
    (I1), just a note that lets a re-run after a crash resume that thread instead of starting a
    second one and running the input twice. One UPDATE, guarded by the claim token."""
    with transaction.atomic(durable=True):
        Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).update(
            codex_thread_id=clean_text(thread_id, max_chars=64)
        )


def turn_requeue(*, turn_id: uuid.UUID, token: uuid.UUID, reason: str) -> Turn | None:
    """Give a claimed turn back to the queue (codex could not take it yet, e.g. another process
    still holds the thread), to be claimed again — at most ``HERMES_MAX_ATTEMPTS`` claims in all,
    then it fails with ``reason``. Returns ``None`` when the claim is no longer held."""
    with transaction.atomic(durable=True):
        locked = _lock_claimed(turn_id, token)
        if locked is None:
            return None
        session, turn = locked
        if turn.attempt >= settings.HERMES_MAX_ATTEMPTS:
            _finish(turn, TurnOutcome(), status=Turn.Status.FAILED,
                    error=f"{reason} (gave up after {turn.attempt} attempts)")
            _close_approvals_of_ended(turn)
            events.event_terminal(turn=turn)
            dispatch.session_dispatch_next_on_commit(session)
            return turn
        turn.status, turn.claim_token, turn.lease_expires_at = Turn.Status.QUEUED, None, None
        turn.error = clean_text(f"attempt {turn.attempt} put back in the queue: {reason}", max_chars=MAX_ERROR_CHARS)
        turn.save(update_fields=["status", "claim_token", "lease_expires_at", "error"])
        events.event_append(turn=turn, kind=events.RETRYING, data={"reason": turn.error, "requeued": True})
        dispatch.turn_dispatch_on_commit(turn.pk)
        return turn


@dataclass(frozen=True)
class Heartbeat:
    """``held``: the lease was renewed (False: the claim is gone — stop, commit nothing).
    ``cancel_requested``: a client asked to cancel (or interrupt) the turn."""

    held: bool
    cancel_requested: bool


def turn_heartbeat(*, turn_id: uuid.UUID, token: uuid.UUID) -> Heartbeat:
    """Renew the claim's lease to now + ``HERMES_LEASE_SECONDS``; one UPDATE, no row lock held."""
    with transaction.atomic(durable=True):
        held = Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).update(
            lease_expires_at=_lease_deadline()
        )
        cancel = held and Turn.objects.filter(pk=turn_id, cancel_requested_at__isnull=False).exists()
    return Heartbeat(held=bool(held), cancel_requested=bool(cancel))


def turn_cancel(*, turn: Turn) -> Turn:
    """Cancel ``turn``: a queued turn ends ``cancelled`` at once; a running one is marked and its
    worker sends ``turn/interrupt`` within a heartbeat (it then ends ``cancelled`` with the items
    codex completed before the interrupt); a finished turn is returned unchanged."""
    with transaction.atomic():
        locked = lock_session_and_turn(turn.pk)
        if locked is None:  # deleted meanwhile: nothing left to cancel
            return turn
        session, turn = locked
        if turn.status == Turn.Status.QUEUED:
            turn.status = Turn.Status.CANCELLED
            turn.error = "cancelled before it ran"
            turn.finished_at = timezone.now()
            turn.cancel_requested_at = turn.finished_at
            turn.save(update_fields=["status", "error", "finished_at", "cancel_requested_at"])
            _close_approvals_of_ended(turn)
            turn_ended_on_commit(turn)
            events.event_terminal(turn=turn)
            dispatch.session_dispatch_next_on_commit(session)
        elif turn.status == Turn.Status.RUNNING and turn.cancel_requested_at is None:
            _ask_to_stop(turn, reason="the turn was cancelled")
        return turn


def _ask_to_stop(turn: Turn, *, reason: str) -> None:
    """Mark running ``turn`` (locked by the caller) to stop — its worker sends ``turn/interrupt`` within a
    heartbeat — and close its pending approvals with ``reason`` in the caller's transaction: a decision
    arriving afterwards is 409 and never reaches codex
    (tests/api/test_approvals.py::test_cancelling_the_turn_cancels_its_pending_approvals_and_a_late_decision_is_409,
    ::test_an_interrupting_input_closes_the_running_turns_pending_approvals)."""
    turn.cancel_requested_at = timezone.now()
    turn.save(update_fields=["cancel_requested_at"])
    approvals.approvals_close_for_turn(turn=turn, reason=reason)


def history_seed(*, session_id: str, exclude_turn_id: uuid.UUID) -> str:
    """The bounded rendering of the session's transcript that a fresh thread's first input carries
    (``docs/contract.md`` §3); the rows of ``exclude_turn_id`` (the current turn) are left out. Reads only."""
    rows, more_before = history_seed_rows(session_id=session_id, exclude_turn_id=exclude_turn_id)
    return render_history_seed(rows, more_before=more_before)


#: Rows in the seed's first page; each further page is twice the last (64, 128, 256, …).
SEED_FIRST_PAGE_ROWS = 64


def history_seed_rows(*, session_id: str, exclude_turn_id: uuid.UUID) -> tuple[list[Message], bool]:
    """The newest transcript rows the seed can hold, oldest first, and whether older rows exist.

    Read newest first in pages that double in size (keyset on ``seq``, each query with a LIMIT) until
    the rows read could fill ``HERMES_HISTORY_SEED_MAX_CHARS`` (each row's rendering is at least
    :func:`_seed_chars_at_least`) or ``seed_row_limit()`` rows are read: the cost follows the cap and
    the rows' size, never the session's history — about 2 queries and ~2× the rows that fit for
    chat-sized rows, at most ~7 queries and ``seed_row_limit() + 1`` rows for tiny ones."""
    limit, cap = seed_row_limit(), settings.HERMES_HISTORY_SEED_MAX_CHARS
    rows = (Message.objects.filter(session_id=session_id).exclude(turn_id=exclude_turn_id)
            .only("seq", "role", "content", "tool_calls").order_by("-seq"))
    newest: list[Message] = []
    page_rows, chars = SEED_FIRST_PAGE_ROWS, 0
    while len(newest) <= limit:
        page_query = rows.filter(seq__lt=newest[-1].seq) if newest else rows
        page = list(page_query[: min(page_rows, limit + 1 - len(newest))])
        newest.extend(page)
        chars += sum(_seed_chars_at_least(m) for m in page)
        if len(page) < page_rows or chars > cap:
            break
        page_rows *= 2
    more_before = len(newest) > limit or (bool(newest) and chars > cap and rows.filter(seq__lt=newest[-1].seq).exists())
    return newest[:limit][::-1], more_before


def _seed_chars_at_least(row: Message) -> int:
    """A lower bound of ``row``'s length in the seed (``history_seed.render_history_seed``): once the
    rows read add up to more than the cap, older rows cannot be in the seed."""
    if row.role == Message.Role.SYSTEM:
        return 0  # not replayed
    text = row.content or ""
    shown = min(len(text), TOOL_RESULT_CHARS) if row.role == Message.Role.TOOL else len(text)
    return shown + MIN_SEED_ROW_CHARS


def seed_row_limit() -> int:
    """Rows that can contribute to a seed of ``HERMES_HISTORY_SEED_MAX_CHARS``: every rendered row costs
    at least ``MIN_SEED_ROW_CHARS`` (``[USER]``/``[ASSISTANT]`` header, newline, separator)."""
    return settings.HERMES_HISTORY_SEED_MAX_CHARS // MIN_SEED_ROW_CHARS + 1


# --- turns: finish ---------------------------------------------------------------------------------


# codex's turn/completed status → ours
_TURN_STATUS = {
    "completed": Turn.Status.SUCCEEDED,
    "failed": Turn.Status.FAILED,
    "interrupted": Turn.Status.CANCELLED,
}


def turn_finalize(*, turn_id: uuid.UUID, token: uuid.UUID, result: TurnOutcome, warm_queue: str = "") -> Turn | None:
    """Commit a codex turn that reached ``turn/completed``, all in one transaction (I1, I2):
    the projected transcript rows, the binding (published for a started or rotated thread only now
    that its rows are durable), the end of a dead binding plus exactly one notice, and the turn's
    final state, usage and timings. Returns the turn, or ``None`` when the claim is no longer
    held (a duplicate delivery or a lost claim) — then nothing is written.

    ``warm_queue``: the route of the worker that will keep the thread loaded (session affinity,
    ``routing.warm_thread_record``), recorded only for a succeeded turn whose rollout was stored here;
    every other end of a turn records that no worker holds it.
    """
    status = _TURN_STATUS.get(result.status or "", Turn.Status.FAILED)
    error = result.error
    if status == Turn.Status.FAILED and not error:
        error = f"codex ended the turn with status {result.status!r}"
    elif status == Turn.Status.CANCELLED and not error:
        error = "cancelled while running (turn/interrupt); what codex completed before it is kept"
    # Only a thread that ran this turn has a rollout to resume (I1); one started and then
    # cancelled before turn/start is left unbound.
    bind = result.status is not None and bool(result.thread_id and result.codex_turn_id)
    return _commit_turn(turn_id, token, result, status=status, error=error, bind=bind,
                        warm_queue=warm_queue if status == Turn.Status.SUCCEEDED else "")


def turn_fail(*, turn_id: uuid.UUID, token: uuid.UUID, reason: str, result: TurnOutcome | None = None) -> Turn | None:
    """End a claimed turn as failed with ``reason`` (codex trouble, timeout, transport failure).

    The binding is kept — except when codex already proved the bound thread gone during this turn
    (``result.rotated_from``): that binding ends and the one rotation notice is recorded, and the
    next turn starts a fresh, seeded thread. Items codex completed before the failure are stored.
    Returns ``None`` when the claim is no longer held.
    """
    return _commit_turn(turn_id, token, result or TurnOutcome(), status=Turn.Status.FAILED, error=reason, bind=False)


def _commit_turn(
    turn_id: uuid.UUID, token: uuid.UUID, result: TurnOutcome, *, status: str, error: str, bind: bool,
    warm_queue: str = "",
) -> Turn | None:
    """The one transaction that ends a claimed turn: rows, rollout, rotation, binding, state, next
    dispatch. A rollout whose generation moved on since this worker restored it (another writer,
    ``rollouts.RolloutFenced``) rolls all of it back: the turn commits nothing (``None``)."""
    try:
        return _commit_turn_once(turn_id, token, result, status=status, error=error, bind=bind, warm_queue=warm_queue)
    except rollouts.RolloutFenced as exc:
        logger.warning("turn %s: %s; committing nothing", turn_id, exc)
        return None


def _commit_turn_once(
    turn_id: uuid.UUID, token: uuid.UUID, result: TurnOutcome, *, status: str, error: str, bind: bool,
    warm_queue: str = "",
) -> Turn | None:
    # A warm turn's finalize is two round trips (``pipelining``): the locks with the rollout's fenced
    # store, then the rows, the turn's end and its events with the COMMIT.
    with pipelined_atomic(durable=True) as batch:
        lock = lock_session_and_turn_later(batch, turn_id)
        t0 = time.monotonic()
        # Sent with the locks and run under them; rolled back below if the claim is no longer held.
        fence = (rollouts.rollout_store_batched(batch, delta=result.rollout, codex_version=result.codex_version)
                 if result.rollout is not None else None)
        store_ms = (time.monotonic() - t0) * 1000
        locked = _claimed(lock.get(), turn_id, token)
        if locked is None:
            transaction.set_rollback(True)  # nothing of this turn is written, the rollout store included
            return None
        session, turn = locked
        # A claim that asked nothing costs its finalize nothing here; a re-run may leave an earlier claim's
        # request pending that it never asked again (tests/services/test_approvals_rerun.py).
        if result.approvals or turn.attempt > 1:
            approvals.approvals_close_for_turn(turn=turn, reason=f"the turn ended ({status}) while it waited")
        if result.rollout is not None:
            t0 = time.monotonic()
            if fence is None:
                rollouts.rollout_store(session=session, delta=result.rollout, codex_version=result.codex_version)
            elif not fence.get():
                raise rollouts.RolloutFenced(rollouts.fenced_reason(result.rollout))
            result.timings["store_ms"] = round(store_ms + (time.monotonic() - t0) * 1000, 1)  # compress + chunk + header
        _append_messages(session, turn, result.messages, batch=batch)
        notice = ""
        if result.rotated_from and bindings.binding_rotate(session=session, turn=turn, thread_id=result.rotated_from,
                                                           reason=result.rotation_reason):
            notice = bindings.NOTICE_THREAD_ROTATED
        delta = result.rollout
        kept = bool(warm_queue and delta is not None and delta.thread_id == result.thread_id and bind)
        warm = routing.warm_thread_record_sql(
            session_id=session.pk, queue=warm_queue if kept else "", thread_id=result.thread_id or "",
            generation=(delta.base.generation + 1 if delta is not None and delta.base and delta.base.generation else 1))
        _set_finish(turn, result, status=status, error=error)
        end = _end_turn(session, turn, warm=warm, batch=batch)
        turn_ended_on_commit(turn)
        resumed = result.thread_action == Turn.ThreadAction.RESUMED
        if bind and not resumed:  # after the turn's row is written: the same transaction, so bound only with it (I1)
            bindings.binding_publish(session=session, turn=turn, thread_id=result.thread_id, resumed=resumed,
                                     active=end.get().active)
        _finish_events(turn, result, notice=notice, batch=batch)
        _dispatch_next_on_commit(end)
        return turn


def _dispatch_next_on_commit(end: Later[_TurnEnd]) -> None:
    """Once the finalize commits, send the session's next queued turn that ``_end_turn`` stamped (read
    then: its statement travels with the COMMIT)."""
    def send() -> None:
        nxt = end.get().next_turn
        if nxt is not None:
            dispatch.turn_dispatch_on_commit(nxt, stamped=True)  # after the commit: sends at once

    transaction.on_commit(send)


@dataclass(frozen=True)
class _TurnEnd:
    """What ``_end_turn`` read: the session's active binding (after any rotation) and the session's
    next queued turn, already stamped ``dispatched_at`` (``None``: none queued)."""

    active: bindings.ActiveBinding | None
    next_turn: uuid.UUID | None


def _end_turn(session: Session, turn: Turn, *, warm: tuple[str, list[Any]], batch: Batch) -> Later[_TurnEnd]:
    """Write the ended ``turn`` (``_FINISH_FIELDS``) and ``warm`` (``routing.warm_thread_record_sql``),
    stamp the session's next queued turn as dispatched (``dispatch.session_next_turn_params``) and read the
    active binding, under the finalize's locks. One statement (data-modifying CTEs; its reads come after
    the locks and after any ``binding_rotate``, so they see what committed before this transaction took
    the session lock and what it wrote since). It was five statements,
    three of them ORM queries compiled per turn (``binding_publish``'s read, the upsert, the next turn):
    ~45 % of a warm finalize's samples under py-spy."""
    name = "turn_end_keeping_warm" if warm[0] == query("warm_thread_upsert") else "turn_end_forgetting_warm"
    return batch.add(query(name), [*save_values(turn, _FINISH_FIELDS), pk_value(turn), *warm[1],
                                   *dispatch.session_next_turn_params(session.pk), session.pk,
                                   CodexBinding.Status.ACTIVE], convert=_turn_end_row)


def _turn_end_row(rows: list[tuple[Any, ...]]) -> _TurnEnd:
    assert rows  # one row, whatever the joins find
    nxt, binding_pk, thread_id = rows[0]
    return _TurnEnd(active=bindings.ActiveBinding(binding_pk, thread_id) if binding_pk is not None else None,
                    next_turn=nxt)


def _finish_events(turn: Turn, result: TurnOutcome, *, notice: str = "", batch: Batch) -> None:
    """The stream's last events of a turn, in its finalize transaction (``docs/contract.md`` §8):
    the thread action (with ``notice``, the rotation notice this transaction recorded), the usage, the
    terminal state — one insert, one NOTIFY; before them, what the worker's stream writer still held
    (``result.stream_tail``: the turn's last deltas and items, in codex's order)."""
    items: list[tuple[str, dict[str, Any] | None]] = list(result.stream_tail)
    if result.thread_action or result.rotated_from:
        items.append((events.THREAD, {
            "action": turn.thread_action, "thread_id": turn.codex_thread_id,
            "rotated_from": result.rotated_from or "", "notice": notice}))
    if turn.usage:
        items.append((events.USAGE, turn.usage))
    items.append(events.terminal_item(turn))
    events.event_append_batched(batch, turn=turn, items=items)


def _lock_claimed(turn_id: uuid.UUID, token: uuid.UUID) -> tuple[Session, Turn] | None:
    """``lock_session_and_turn``, or ``None`` unless the turn is running under claim ``token``."""
    return _claimed(lock_session_and_turn(turn_id), turn_id, token)


def _claimed(locked: tuple[Session, Turn] | None, turn_id: uuid.UUID, token: uuid.UUID) -> tuple[Session, Turn] | None:
    """``locked`` (the locked session and turn), or ``None`` unless the turn is running under claim ``token``."""
    if locked is None:
        return None
    if locked[1].status != Turn.Status.RUNNING or locked[1].claim_token != token:
        logger.info("turn %s: claim %s no longer held (status %s); not writing", turn_id, token, locked[1].status)
        return None
    return locked


def _append_messages(session: Session, turn: Turn, rows: Iterable[dict[str, Any]], *,
                     batch: Batch | None = None) -> None:
    """Append transcript rows with the session's next sequence numbers (caller holds the session lock).
    ``batch``: send the statement with it (``pipelining``) instead of running it now."""
    new = []
    for row in rows:
        session.last_message_seq += 1
        new.append(
            Message(
                session=session,
                seq=session.last_message_seq,
                turn=turn,
                role=row["role"],
                content=clean_text(row.get("content")),
                tool_calls=clean_json(row.get("tool_calls")),
                tool_call_id=clean_text(row.get("tool_call_id"), max_chars=255),
                reasoning=clean_text(row.get("reasoning")),
                codex_item_id=clean_text(row.get("codex_item_id"), max_chars=255),
            )
        )
    if not new:
        return
    # One statement (``queries.sql``: ``messages_append``): the session's counter, the rows.
    touch(session, "updated_at")
    for message in new:
        message.created_at = session.updated_at
    statement = (query("messages_append").replace("{rows}", value_rows(len(_MESSAGE_FIELDS), len(new))),
                 [*save_values(session, ("last_message_seq", "updated_at")), pk_value(session),
                  *(value for message in new for value in save_values(message, _MESSAGE_FIELDS))])
    if batch is not None:
        batch.add(*statement)
        return
    with connection.cursor() as cursor:
        cursor.execute(*statement)


_MESSAGE_FIELDS = ("session", "seq", "turn", "role", "content", "tool_calls", "tool_call_id", "reasoning",
                   "codex_item_id", "created_at")


def _finish(turn: Turn, result: TurnOutcome, *, status: str, error: str) -> None:
    """End ``turn`` with ``status``: its fields (``_set_finish``), written, and its end line on commit."""
    _set_finish(turn, result, status=status, error=error)
    with connection.cursor() as cursor:
        cursor.execute(query("turn_finish"), [*save_values(turn, _FINISH_FIELDS), pk_value(turn)])
    turn_ended_on_commit(turn)


def _set_finish(turn: Turn, result: TurnOutcome, *, status: str, error: str) -> None:
    turn.status = status
    turn.thread_action = result.thread_action or ""
    turn.codex_thread_id = clean_text(result.thread_id, max_chars=64)
    turn.codex_turn_id = clean_text(result.codex_turn_id, max_chars=64)
    turn.codex_methods = clean_json(result.methods)
    turn.final_text = clean_text(result.final_text)
    turn.error = clean_text(error, max_chars=MAX_ERROR_CHARS)
    turn.usage = clean_json(result.usage)
    turn.finished_at = timezone.now()
    timings = dict(result.timings)
    if turn.started_at:
        timings["run_ms"] = round((turn.finished_at - turn.started_at).total_seconds() * 1000, 1)
    turn.timings = clean_json(timings)
    turn.claim_token = None
    turn.lease_expires_at = None


_FINISH_FIELDS = ("status", "thread_action", "codex_thread_id", "codex_turn_id", "codex_methods", "final_text", "error",
                  "usage", "finished_at", "timings", "claim_token", "lease_expires_at")
