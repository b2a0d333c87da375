"""Domain operations — the only code that writes sessions, turns, messages, bindings and notices.

``sessions`` (create), ``bindings`` (codex bindings and notices), ``turns`` (the turn lifecycle in
short transactions), ``routing`` (where a session's next turn goes), ``dispatch`` (telling a worker
that a turn is its session's next, after commit), ``rollouts`` (stored rollouts), ``events`` (stream events), ``approvals`` (what codex asks a person), ``locks`` (row and
advisory locks), ``idempotency`` (Idempotency-Key). Callers import from here. What runs a claimed turn
is ``hermes_sessions.worker``.
"""
from .approvals import (
    ApprovalClosed,
    InvalidDecision,
    approval_answered,
    approval_close,
    approval_decide,
    approval_request,
)
from .bindings import (
    NOTICE_BINDING_ENDED,
    NOTICE_THREAD_ROTATED,
    binding_end,
    binding_publish,
    binding_rotate,
    notice_acknowledge,
)
from .dispatch import session_dispatch_next_on_commit, turn_dispatch_on_commit, turn_undispatched
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
from .idempotency import idempotent
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
from .webhooks import (
    WebhookRefused,
    webhook_attempt_record,
    webhook_deliveries_claim,
    webhook_delivery_send_again,
    webhook_endpoint_create,
    webhook_endpoint_delete,
    webhook_endpoint_enable,
    webhook_endpoint_update,
)

__all__ = [
    "ApprovalClosed", "InvalidDecision", "approval_answered", "approval_close", "approval_decide", "approval_request",
    "IdempotencyKeyInUse", "IdempotencyMismatch", "InvalidIdempotencyKey", "InvalidInput", "ServiceError", "SessionBusy", "SessionIdTaken", "SessionLocked",
    "NOTICE_BINDING_ENDED", "NOTICE_THREAD_ROTATED", "binding_end", "binding_publish", "binding_rotate",
    "notice_acknowledge", "session_dispatch_next_on_commit", "turn_dispatch_on_commit",
    "idempotent", "session_create",
    "MAX_INPUT_CHARS", "ON_BUSY", "TurnClaim", "history_seed", "turn_cancel",
    "turn_claim", "turn_enqueue", "turn_fail", "turn_finalize", "turn_heartbeat", "turn_note_thread", "turn_requeue",
    "turn_undispatched",
    "WebhookRefused", "webhook_attempt_record", "webhook_deliveries_claim", "webhook_delivery_send_again",
    "webhook_endpoint_create", "webhook_endpoint_delete", "webhook_endpoint_enable", "webhook_endpoint_update",
]
