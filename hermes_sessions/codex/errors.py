"""Errors raised while talking to ``codex app-server``, as types.

:func:`error_from_response` is the only code in the project that reads codex's JSON-RPC error codes and
message texts; :class:`~.client.AppServerClient` raises what it returns. Everyone else — the turn runner
(``runner.py``) and the services — decides by ``isinstance``, never by message text.

Observed on codex 0.169.0 and 0.171.0 (``docs/codex.md`` §3 and §6; the same table is ``docs/contract.md``
§4). Nearly every refusal is JSON-RPC code ``-32600`` (invalid request); the message tells them apart, so a
type is chosen on code **and** message prefix:

=======================  =====================================================  ==========================================
type                     codex answer                                           what happens (runner, then services)
=======================  =====================================================  ==========================================
:class:`ThreadGone`      ``-32600`` ``no rollout found for thread id <id>``     **rotate**: start a fresh, seeded thread; the
                         (resume of an unknown thread, of one that never ran    old binding ends with one notice — only when
                         a turn, or whose rollout file is gone)                 PostgreSQL holds no rollout for it; one
                                                                                restored from it: **fail**, binding kept
:class:`ThreadBusy`      ``-32600`` ``thread <id> already has an active         **retry** the whole run on a new app-server
                         writer`` (another live app-server holds the thread)    (``RetryPolicy``), then requeue, then fail
:class:`Overloaded`      ``-32001`` (any message; codex sends ``Server          **retry**, as ``ThreadBusy``
                         overloaded; retry later.``)
:class:`CodexStateDamaged` ``-32603`` naming a damaged SQLite file (``database    **retry** after dropping codex's state
                         disk image is malformed``, ``file is not a database``)  files from the session's home
:class:`TransportError`  process died, stdout EOF, frame too large, non-JSON    **retry** when it happened before
                         line, broken stdin pipe                                ``turn/start`` was sent; after it, **fail**
                                                                                (codex may have run the input)
:class:`RequestTimeout`  no answer within the request deadline                  as ``TransportError``
:class:`ThreadNotLoaded` ``-32600`` ``thread not found: <id>`` (seen on         ``turn/start``: **resume and retry once**;
                         ``turn/start`` for a thread not loaded in this         a second one **fails**, binding kept
                         process)
:class:`ThreadArchived`  ``-32600`` ``session <id> is archived. Run `codex       **fail**, binding kept
                         unarchive <id>` to unarchive it first.``
:class:`InvalidThreadId` ``-32600`` ``invalid session id: invalid character:    **fail**, binding kept
                         …`` (a non-UUID thread id)
:class:`JsonRpcError`    anything else (unknown codes and messages)             **fail**, binding kept
:class:`CodexError`      the app-server could not be spawned (missing binary,   **fail**, binding kept
                         bad cwd); the runner's ``TurnTimeout``
=======================  =====================================================  ==========================================

:func:`retryable` is the **retry** column by type; the runner reports whether ``turn/start`` had been sent.

A turn that codex ran but could not finish (the model call failed) is not a JSON-RPC error: codex sends
an ``error`` notification and ``turn/completed`` with ``status: failed``, both carrying a ``TurnError``
``{message, codexErrorInfo, additionalDetails}``. :func:`turn_error_text` is the only code that reads it
(``docs/codex.md`` §4).
"""

from __future__ import annotations

from typing import Any

#: JSON-RPC code codex uses for almost every refusal (``codex-rs/app-server/src/error_code.rs``).
INVALID_REQUEST = -32600
#: ``OVERLOADED_ERROR_CODE`` in ``codex-rs/app-server/src/error_code.rs``: "Server overloaded; retry later."
OVERLOADED = -32001
#: JSON-RPC "internal error": codex's answer when its own machinery fails (e.g. its SQLite state).
INTERNAL_ERROR = -32603
#: SQLite's words for a damaged database file (SQLITE_CORRUPT, code 11; SQLITE_NOTADB, code 26).
_SQLITE_DAMAGE = ("database disk image is malformed", "file is not a database")
#: What we answer to a server-initiated request we do not handle (JSON-RPC "method not found").
METHOD_NOT_FOUND = -32601


class CodexError(Exception):
    """Base of every codex failure; ``str(exc)`` is a reason an operator can act on."""


class TransportError(CodexError):
    """The app-server connection is unusable: process died, stdout EOF, frame too large, non-JSON
    stdout line, broken stdin pipe, or (subclass) a request past its deadline.

    ``stderr_tail`` holds the last lines codex wrote to stderr (its logs); they are also part of
    ``str(exc)`` because they usually name the cause (e.g. ``Error: CODEX_HOME points to "…", but that
    path does not exist``). ``sent``: whether the request it is about reached codex's stdin (False only
    when it provably did not: a ``turn/start`` that was never sent cannot have run the input).
    """

    def __init__(self, reason: str, *, stderr_tail: str = "", sent: bool = True) -> None:
        self.reason = reason
        self.stderr_tail = stderr_tail
        # False: the request this error is about was never written to codex (the connection had failed
        # already, or the write itself failed): codex cannot have acted on it. True: it may have.
        self.sent = sent
        message = reason
        if stderr_tail:
            message = f"{reason}\n--- codex app-server stderr (tail) ---\n{stderr_tail}"
        super().__init__(message)


class RequestTimeout(TransportError):
    """No response to ``method`` within ``timeout`` seconds. The process may still be alive."""

    def __init__(self, method: str, timeout: float, *, stderr_tail: str = "") -> None:
        self.method = method
        self.timeout = timeout
        super().__init__(
            f"codex app-server did not answer {method!r} within {timeout:g} s; "
            "the process is stuck or overloaded; retry the turn with a fresh app-server",
            stderr_tail=stderr_tail,
        )


class TurnTimeout(CodexError):
    """Raised by the turn runner when ``turn/completed`` never arrives within its deadline."""

    def __init__(
        self,
        message: str,
        *,
        thread_id: str | None = None,
        turn_id: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.timeout = timeout
        super().__init__(message)


class JsonRpcError(CodexError):
    """Codex answered ``method`` with a JSON-RPC error object ``{code, message, data?}``.

    ``code`` and ``message`` are verbatim; codex 0.169.0 sent no ``data`` in any error observed. The
    subclasses below name the answers the runner acts on; build them with :func:`error_from_response`.
    """

    def __init__(self, method: str, code: int, message: str, data: Any = None) -> None:
        self.method = method
        self.code = code
        self.message = message
        self.data = data
        super().__init__(f"codex {method} failed: JSON-RPC error {code}: {message}")


class ThreadGone(JsonRpcError):
    """``-32600 no rollout found for thread id <id>``: codex cannot hand the thread back, ever (unknown
    id, a thread that never ran a turn, or a deleted rollout file — codex 0.169.0). The one answer that
    rotates."""


class ThreadBusy(JsonRpcError):
    """``-32600 thread <id> already has an active writer``: another live app-server on this
    ``CODEX_HOME`` holds the thread (codex releases it as soon as that process dies or closes stdin)."""


class ThreadNotLoaded(JsonRpcError):
    """``-32600 thread not found: <id>``: ``turn/start`` on a thread this process has not resumed
    (codex 0.169.0 answers so even when the rollout exists on disk)."""


class ThreadArchived(JsonRpcError):
    """``-32600 session <id> is archived. Run `codex unarchive <id>` …``: an operator must unarchive it."""


class InvalidThreadId(JsonRpcError):
    """``-32600 invalid session id: …``: the stored thread id is not a UUID codex can parse."""


class Overloaded(JsonRpcError):
    """``-32001 Server overloaded; retry later.``: codex's request queue is full."""


class CodexStateDamaged(JsonRpcError):
    """``-32603`` naming a damaged SQLite database of codex's own (seen on codex 0.171.0's ``thread/resume``
    with a truncated ``thread_history_1.sqlite``: ``failed to list thread history: … failed to open thread
    history DB at <path>: error returned from database: (code: 11) database disk image is malformed``).
    Those files are codex's projection of the rollout, a cache it rebuilds (``docs/codex.md`` §7): the
    worker drops them and tries again (``worker/execution.py``)."""


# (prefix, suffix, type) for code -32600; the first match wins. Exact texts: docs/codex.md §6.
_INVALID_REQUEST_TYPES: tuple[tuple[str, str, type[JsonRpcError]], ...] = (
    ("no rollout found for thread id ", "", ThreadGone),
    ("thread not found: ", "", ThreadNotLoaded),
    ("invalid session id: ", "", InvalidThreadId),
    ("thread ", " already has an active writer", ThreadBusy),
    ("session ", " to unarchive it first.", ThreadArchived),
)


def error_from_response(method: str, error: object) -> JsonRpcError:
    """The typed exception for codex's JSON-RPC ``error`` member answering ``method``.

    ``error`` is the raw member: normally ``{"code": int, "message": str, "data"?: any}``; anything else
    (a bare string, a non-integer code) still gives a :class:`JsonRpcError` (code 0 when missing) rather
    than a crash. ``-32001`` is :class:`Overloaded` whatever its message; the ``-32600`` subclasses need
    the message's exact prefix (and suffix); every other answer is a plain :class:`JsonRpcError`.
    """
    fields = error if isinstance(error, dict) else {"message": error}
    raw_code = fields.get("code")
    code = raw_code if isinstance(raw_code, int) and not isinstance(raw_code, bool) else 0
    message = str(fields.get("message", ""))
    return _error_type(code, message)(method, code, message, fields.get("data"))


def _error_type(code: int, message: str) -> type[JsonRpcError]:
    if code == OVERLOADED:
        return Overloaded
    if code == INTERNAL_ERROR and any(sign in message for sign in _SQLITE_DAMAGE):
        return CodexStateDamaged
    if code == INVALID_REQUEST:
        for prefix, suffix, error_type in _INVALID_REQUEST_TYPES:
            if message.startswith(prefix) and message.endswith(suffix):
                return error_type
    return JsonRpcError


#: The failures worth another try on a new app-server (the thread still exists; only the process or
#: codex's capacity was in the way). The table's **retry** column.
RETRYABLE: tuple[type[CodexError], ...] = (TransportError, ThreadBusy, Overloaded, CodexStateDamaged)


def retryable(exc: object) -> bool:
    """True for :data:`RETRYABLE` types — a transient failure that keeps the thread. Whether a retry is
    safe also needs ``turn/start`` not to have been sent; the runner reports that."""
    return isinstance(exc, RETRYABLE)


#: ``codexErrorInfo`` variants that carry the HTTP status codex saw, ``{<variant>: {"httpStatusCode": N}}``
#: (``CodexErrorInfo`` in the pinned schema; measured on codex 0.171.0: 401, 403 and 503 as
#: ``httpConnectionFailed``, 429 with retries off as ``responseTooManyFailedAttempts``; docs/codex.md §4).
STATUS_VARIANTS = ("httpConnectionFailed", "responseStreamConnectionFailed", "responseStreamDisconnected",
                   "responseTooManyFailedAttempts")
#: Bare-string ``codexErrorInfo`` values that stand for one HTTP status, measured on codex 0.171.0 against
#: the model stand-in: an HTTP 500 arrives as ``internalServerError`` with codex's generic text ("We’re
#: currently experiencing high demand, …") and no status anywhere; a 404 as ``modelNotFound``.
IMPLIED_STATUS = {"internalServerError": 500, "modelNotFound": 404}


def model_error_info(info: object) -> tuple[str, int | None]:
    """``(kind, http status)`` of a ``TurnError.codexErrorInfo``: ``("internalServerError", 500)``,
    ``("httpConnectionFailed", 401)``, ``("other", None)``; ``("", None)`` for a missing or unknown shape."""
    if isinstance(info, str):
        return info, IMPLIED_STATUS.get(info)
    if isinstance(info, dict) and len(info) == 1:
        [(kind, body)] = info.items()
        status = body.get("httpStatusCode") if isinstance(body, dict) else None
        ok = isinstance(status, int) and not isinstance(status, bool) and kind in STATUS_VARIANTS
        return str(kind), status if ok else None
    return "", None


def turn_error_text(error: object) -> str:
    """The reason a failed codex turn gives, from a ``TurnError`` (``error`` notification's ``error``,
    ``turn/completed``'s ``turn.error``): codex's ``message`` (plus ``additionalDetails``), preceded by the
    HTTP status of the model call when codex reports one — ``"the model call failed with HTTP 500 (codex:
    internalServerError): We’re currently experiencing high demand, …"`` — so an operator sees what
    failed, not only codex's generic text. A bare string is taken as the message; ``None`` or an empty
    error gives ``""``."""
    fields = error if isinstance(error, dict) else {"message": error}
    message = str(fields.get("message") or "")
    details = fields.get("additionalDetails")
    if details and str(details) not in message:
        message = f"{message} ({details})" if message else str(details)
    kind, status = model_error_info(fields.get("codexErrorInfo"))
    if status is not None:
        return f"the model call failed with HTTP {status} (codex: {kind}): {message}"
    if kind and message:
        return f"{message} (codex: {kind})"
    return message
