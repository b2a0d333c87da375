"""Domain operations — the only code that writes sessions, turns, messages, bindings and notices.

Every function is keyword-only, runs its writes inside one short ``transaction.atomic`` block and
never holds a transaction or row lock while codex works (invariant I3). The turn lifecycle:

    turn_enqueue  (API)     → Turn(queued); the Celery task is sent after the row commits
    turn_claim    (worker)  → Turn(running) + the user's message row, if it is the session's next turn
    … codex runs, no transaction open …
    turn_finalize (worker)  → transcript rows + binding publish/rotation + notice + turn state, one transaction
    turn_fail     (worker)  → failed turn with a reason; a proven-dead thread still ends its binding

``turn_finalize`` and ``turn_fail`` are guarded by the claim token, so a second delivery of the same
task, or a worker that lost its claim, changes nothing (invariant I2).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from . import policy
from .codex.client import AppServerClient
from .codex.launch import app_server_argv, app_server_env, ensure_codex_home
from .codex.runner import TurnOutcome, TurnRunError, TurnSpec, run_turn
from .codex.server_requests import make_server_request_handler
from .history_seed import render_history_seed, seeded_input
from .models import CodexBinding, Message, Notice, Session, Turn
from .sanitize import clean_json, clean_text

logger = logging.getLogger(__name__)

NOTICE_THREAD_ROTATED = "Codex thread could not be resumed; starting a new one."
MAX_INPUT_CHARS = 200_000
MAX_ERROR_CHARS = 8_000


class ServiceError(Exception):
    """A domain rule refused the operation; ``str(exc)`` is the reason to show the client."""


class SessionIdTaken(ServiceError):
    """``session_create`` was given an id that already exists."""


class InvalidInput(ServiceError):
    """The turn input is empty or too long."""


# --- sessions ------------------------------------------------------------------------------------


def session_create(*, owner, session_id: str | None = None, title: str = "", model_config: dict | None = None) -> Session:
    """Create a session owned by ``owner``.

    ``session_id`` is the client's choice (validated against ``models.SESSION_ID_RE``) or a generated
    ``sess-<hex>``. ``model_config`` is cleaned by ``policy.validate_model_config`` (raises
    ``policy.PolicyError``). Raises ``SessionIdTaken`` when the id exists (whoever owns it).
    """
    config = policy.validate_model_config(model_config, is_staff=bool(getattr(owner, "is_staff", False)))
    session = Session(owner=owner, title=clean_text(title, max_chars=200), model_config=clean_json(config))
    if session_id:
        session.id = session_id
    session.full_clean(exclude=["owner"], validate_unique=False)
    try:
        with transaction.atomic():
            session.save(force_insert=True)
    except IntegrityError as exc:
        raise SessionIdTaken(f"session id {session.id!r} is already taken") from exc
    return session


# --- turns: accept ---------------------------------------------------------------------------------


def turn_enqueue(*, session: Session, input_text: str, user) -> Turn:
    """Accept one user input for ``session`` as a queued turn and schedule it.

    The turn gets the session's next turn ``seq`` under the session row lock; the Celery task
    ``run_turn`` is sent only after the row commits. Raises ``InvalidInput`` for empty or oversized
    (> ``MAX_INPUT_CHARS``) input.
    """
    text = clean_text(input_text)
    if not text.strip():
        raise InvalidInput("input must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidInput(f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    with transaction.atomic():
        locked = Session.objects.select_for_update().get(pk=session.pk)
        locked.last_turn_seq += 1
        locked.save(update_fields=["last_turn_seq", "updated_at"])
        turn = Turn.objects.create(session=locked, seq=locked.last_turn_seq, input=text, created_by=user)
        _dispatch_on_commit(turn.id)
    return turn


def _dispatch_on_commit(turn_id: uuid.UUID) -> None:
    from .tasks import run_turn  # tasks import services; import here to keep the cycle lazy

    transaction.on_commit(lambda: run_turn.apply_async(args=[str(turn_id)]))


# --- turns: claim ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnClaim:
    """What a worker needs to run a claimed turn. ``token`` must be handed back to finalize/fail."""

    turn_id: uuid.UUID
    session_id: str
    token: uuid.UUID
    input_text: str
    thread_id: str | None  # the active binding's thread, if any
    config: dict[str, Any] = field(default_factory=dict)  # policy.effective_config(...)


def turn_claim(*, turn_id: uuid.UUID | str) -> TurnClaim | None:
    """Mark the turn running if it is its session's next turn; return ``None`` otherwise.

    A turn runs only when no turn of its session is running and no earlier turn is still queued
    (turns run one at a time, in the order they were accepted — I3). The user's message row is
    written here, so the transcript order follows the order turns actually run. A turn that is
    not runnable yet is not lost: the turn before it dispatches it when it ends.
    """
    with transaction.atomic():
        try:
            turn = Turn.objects.only("session_id").get(pk=turn_id)
        except (Turn.DoesNotExist, ValueError, TypeError):
            logger.warning("turn %s does not exist; nothing to run", turn_id)
            return None
        session = Session.objects.select_for_update().get(pk=turn.session_id)
        turn = Turn.objects.select_for_update().get(pk=turn_id)
        if turn.status != Turn.Status.QUEUED:
            return None
        siblings = Turn.objects.filter(session=session).exclude(pk=turn.pk)
        if siblings.filter(status=Turn.Status.RUNNING).exists():
            return None
        if siblings.filter(status=Turn.Status.QUEUED, seq__lt=turn.seq).exists():
            return None
        token = uuid.uuid4()
        turn.status = Turn.Status.RUNNING
        turn.started_at = timezone.now()
        turn.attempt += 1
        turn.claim_token = token
        turn.save(update_fields=["status", "started_at", "attempt", "claim_token"])
        _append_messages(session, turn, [{"role": Message.Role.USER, "content": turn.input}])
        binding = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).first()
        return TurnClaim(
            turn_id=turn.id,
            session_id=session.id,
            token=token,
            input_text=turn.input,
            thread_id=binding.thread_id if binding else None,
            config=policy.effective_config(session.model_config),
        )


def history_seed(*, session_id: str, exclude_turn_id: uuid.UUID) -> str:
    """The bounded rendering of the session's transcript that a fresh thread's first input carries
    (design §3.5); the rows of ``exclude_turn_id`` (the current turn) are left out. Reads only."""
    rows = Message.objects.filter(session_id=session_id).exclude(turn_id=exclude_turn_id).order_by("seq")
    return render_history_seed(rows)


# --- turns: run ------------------------------------------------------------------------------------


def turn_execute(*, turn_id: uuid.UUID | str) -> Turn | None:
    """Run one queued turn end to end on a fresh app-server process: claim → codex → finalize.

    Returns the finished turn, or ``None`` when the turn was not this call's to run (not the
    session's next turn, already running or finished — a duplicate delivery changes nothing).
    Every codex failure ends the turn ``failed`` with a readable reason; none escapes.
    """
    claim = turn_claim(turn_id=turn_id)
    if claim is None:
        return None
    config = claim.config
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        ensure_codex_home()
        workdir = policy.session_workdir(claim.session_id)
        workdir.mkdir(parents=True, exist_ok=True)
        spec = TurnSpec(
            text=claim.input_text,
            thread_id=claim.thread_id,
            cwd=str(workdir),
            sandbox=config["sandbox"],
            approval_policy=config["approval_policy"],
            model=config.get("model"),
            developer_instructions=config.get("developer_instructions"),
            fresh_input=lambda: seeded_input(
                history_seed(session_id=claim.session_id, exclude_turn_id=claim.turn_id), claim.input_text
            ),
            turn_timeout=settings.CODEX_TURN_TIMEOUT,
        )
        client = AppServerClient(
            app_server_argv(),
            env=app_server_env(),
            cwd=str(workdir),
            request_timeout=settings.CODEX_REQUEST_TIMEOUT,
            max_frame_bytes=settings.CODEX_MAX_FRAME_BYTES,
            server_request_handler=make_server_request_handler(approval_policy=config["approval_policy"]),
        )
        try:
            client.start()
            timings["initialize_ms"] = round((time.monotonic() - t0) * 1000, 1)
            outcome = run_turn(client, spec)
        finally:
            # Close before committing: the thread's writer lock must be free before the next
            # turn of this session can be dispatched (codex allows one writer per thread).
            client.close()
    except TurnRunError as exc:
        exc.outcome.timings.update(timings)
        return turn_fail(turn_id=claim.turn_id, token=claim.token, reason=str(exc), result=exc.outcome)
    except Exception as exc:  # noqa: BLE001 — codex start-up trouble of any kind fails the turn, not the worker
        logger.exception("turn %s: codex app-server could not run the turn", claim.turn_id)
        return turn_fail(
            turn_id=claim.turn_id, token=claim.token, reason=f"codex app-server could not run the turn: {exc}"
        )
    outcome.timings.update(timings)
    outcome.timings["codex_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome)


# --- turns: finish ---------------------------------------------------------------------------------


_TURN_STATUS = {
    "completed": Turn.Status.SUCCEEDED,
    "failed": Turn.Status.FAILED,
    "interrupted": Turn.Status.CANCELLED,
}


def turn_finalize(*, turn_id: uuid.UUID, token: uuid.UUID, result: TurnOutcome) -> Turn | None:
    """Commit a codex turn that reached ``turn/completed``, all in one transaction (I1, I2):
    the projected transcript rows, the binding (published for a started or rotated thread only now
    that its rows are durable), the end of a dead binding plus exactly one notice, and the turn's
    final state, usage and timings. Returns the turn, or ``None`` when the claim is no longer
    held (a duplicate delivery or a lost claim) — then nothing is written.
    """
    with transaction.atomic():
        session, turn = _lock_claimed(turn_id, token)
        if turn is None:
            return None
        _append_messages(session, turn, result.messages)
        _apply_rotation(session, turn, result)
        if result.thread_action in (Turn.ThreadAction.STARTED, Turn.ThreadAction.ROTATED) and result.thread_id:
            _bind(session, turn, result.thread_id)
        status = _TURN_STATUS.get(result.status or "", Turn.Status.FAILED)
        error = result.error
        if status == Turn.Status.FAILED and not error:
            error = f"codex ended the turn with status {result.status!r}"
        _finish(turn, result, status=status, error=error)
        _dispatch_next_on_commit(session)
        return turn


def turn_fail(*, turn_id: uuid.UUID, token: uuid.UUID, reason: str, result: TurnOutcome | None = None) -> Turn | None:
    """End a claimed turn as failed with ``reason`` (codex trouble, timeout, transport failure).

    The binding is kept — except when codex already proved the bound thread gone during this turn
    (``result.rotated_from``): that binding ends and the one rotation notice is recorded, and the
    next turn starts a fresh, seeded thread. Items codex completed before the failure are stored.
    Returns ``None`` when the claim is no longer held.
    """
    result = result or TurnOutcome()
    with transaction.atomic():
        session, turn = _lock_claimed(turn_id, token)
        if turn is None:
            return None
        _append_messages(session, turn, result.messages)
        _apply_rotation(session, turn, result)
        _finish(turn, result, status=Turn.Status.FAILED, error=reason)
        _dispatch_next_on_commit(session)
        return turn


def _lock_claimed(turn_id, token) -> tuple[Session | None, Turn | None]:
    turn = Turn.objects.filter(pk=turn_id).only("session_id").first()
    if turn is None:
        return None, None
    session = Session.objects.select_for_update().get(pk=turn.session_id)
    turn = Turn.objects.select_for_update().get(pk=turn_id)
    if turn.status != Turn.Status.RUNNING or turn.claim_token != token:
        logger.info("turn %s: claim %s no longer held (status %s); not writing", turn_id, token, turn.status)
        return session, None
    return session, turn


def _append_messages(session: Session, turn: Turn, rows: Iterable[dict[str, Any]]) -> None:
    """Append transcript rows with the session's next sequence numbers (caller holds the session lock)."""
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
    if new:
        Message.objects.bulk_create(new)
        session.save(update_fields=["last_message_seq", "updated_at"])


def _apply_rotation(session: Session, turn: Turn, result: TurnOutcome) -> None:
    if not result.rotated_from:
        return
    reason = clean_text(f"codex could not resume the thread: {result.rotation_reason}", max_chars=MAX_ERROR_CHARS)
    CodexBinding.objects.filter(
        session=session, status=CodexBinding.Status.ACTIVE, thread_id=result.rotated_from
    ).update(status=CodexBinding.Status.ENDED, ended_at=timezone.now(), ended_reason=reason, ended_by_turn=turn)
    Notice.objects.create(session=session, turn=turn, kind=Notice.Kind.LIFECYCLE, text=NOTICE_THREAD_ROTATED)


def _bind(session: Session, turn: Turn, thread_id: str) -> None:
    active = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).first()
    if active and active.thread_id == thread_id:
        return
    if active:
        active.status = CodexBinding.Status.ENDED
        active.ended_at = timezone.now()
        active.ended_reason = "replaced by a newer thread"
        active.ended_by_turn = turn
        active.save(update_fields=["status", "ended_at", "ended_reason", "ended_by_turn"])
    CodexBinding.objects.create(session=session, thread_id=clean_text(thread_id, max_chars=64), created_by_turn=turn)


def _finish(turn: Turn, result: TurnOutcome, *, status: str, error: str) -> None:
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
    turn.save()


def _dispatch_next_on_commit(session: Session) -> None:
    nxt = Turn.objects.filter(session=session, status=Turn.Status.QUEUED).order_by("seq").first()
    if nxt is not None:
        _dispatch_on_commit(nxt.id)


# --- notices ---------------------------------------------------------------------------------------


def notice_acknowledge(*, notices: Iterable[Notice], user) -> int:
    """Mark unacknowledged notices acknowledged by ``user``; returns how many changed."""
    ids = [n.pk for n in notices]
    with transaction.atomic():
        return Notice.objects.filter(pk__in=ids, acknowledged_at__isnull=True).update(
            acknowledged_at=timezone.now(), acknowledged_by=user
        )
