"""Domain operations — the only code that writes sessions, turns, messages, bindings and notices.

``sessions`` (create, notices), ``turns`` (the turn lifecycle in short transactions),
``execution`` (running a claimed turn through codex), ``recovery`` (the periodic sweep),
``idempotency`` (Idempotency-Key). Callers import from here.
"""
from .errors import IdempotencyMismatch, InvalidIdempotencyKey, InvalidInput, ServiceError, SessionBusy, SessionIdTaken
from .execution import turn_execute
from .idempotency import idempotent
from .recovery import SweepReport, turns_sweep
from .sessions import NOTICE_BINDING_ENDED, binding_end, notice_acknowledge, session_create
from .turns import (
    MAX_INPUT_CHARS,
    NOTICE_THREAD_ROTATED,
    ON_BUSY,
    TurnClaim,
    history_seed,
    turn_cancel,
    turn_claim,
    turn_enqueue,
    turn_fail,
    turn_finalize,
    turn_heartbeat,
    turn_note_thread,
    turn_requeue,
)

__all__ = [
    "IdempotencyMismatch", "InvalidIdempotencyKey", "InvalidInput", "ServiceError", "SessionBusy", "SessionIdTaken",
    "turn_execute", "idempotent", "NOTICE_BINDING_ENDED", "binding_end", "SweepReport", "turns_sweep", "notice_acknowledge", "session_create",
    "MAX_INPUT_CHARS", "NOTICE_THREAD_ROTATED", "ON_BUSY", "TurnClaim", "history_seed", "turn_cancel",
    "turn_claim", "turn_enqueue", "turn_fail", "turn_finalize", "turn_heartbeat", "turn_note_thread", "turn_requeue",
]
