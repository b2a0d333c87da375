"""Domain operations — the only code that writes sessions, turns, messages, bindings and notices.

``sessions`` (create), ``bindings`` (codex bindings and notices), ``turns`` (the turn lifecycle in
short transactions), ``execution`` (running a claimed turn through codex), ``retry_policy`` (the one
retry budget), ``dispatch`` (sending the Celery task after commit), ``recovery`` (the periodic sweep),
``locks`` (row and advisory locks), ``idempotency`` (Idempotency-Key). Callers import from here.
"""
from .bindings import (
    NOTICE_BINDING_ENDED,
    NOTICE_THREAD_ROTATED,
    binding_end,
    binding_publish,
    binding_rotate,
    notice_acknowledge,
)
from .dispatch import session_dispatch_next_on_commit, turn_dispatch_on_commit, turn_pass_on
from .errors import (
    IdempotencyKeyInUse,
    IdempotencyMismatch,
    InvalidIdempotencyKey,
    InvalidInput,
    ServiceError,
    SessionBusy,
    SessionIdTaken,
    SessionLocked,
)
from .execution import turn_execute
from .idempotency import idempotent
from .recovery import SweepReport, turns_sweep
from .retry_policy import RetryPolicy, retry_policy
from .sessions import session_create
from .turns import (
    MAX_INPUT_CHARS,
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
from .wake import delivery_slot, wake_listening

__all__ = [
    "IdempotencyKeyInUse", "IdempotencyMismatch", "InvalidIdempotencyKey", "InvalidInput", "ServiceError", "SessionBusy", "SessionIdTaken", "SessionLocked",
    "NOTICE_BINDING_ENDED", "NOTICE_THREAD_ROTATED", "binding_end", "binding_publish", "binding_rotate",
    "notice_acknowledge", "session_dispatch_next_on_commit", "turn_dispatch_on_commit",
    "turn_execute", "idempotent", "SweepReport", "turns_sweep", "RetryPolicy", "retry_policy", "session_create",
    "MAX_INPUT_CHARS", "ON_BUSY", "TurnClaim", "history_seed", "turn_cancel",
    "turn_claim", "turn_enqueue", "turn_fail", "turn_finalize", "turn_heartbeat", "turn_note_thread", "turn_requeue",
    "delivery_slot", "wake_listening", "turn_pass_on",
]
