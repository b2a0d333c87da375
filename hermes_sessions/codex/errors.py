"""Errors raised while talking to ``codex app-server``, and the one place that classifies them.

Callers branch on :func:`classify` (rotate / retry / fail), never on message strings.

Observed on codex 0.169.0 (and 0.171.0), ``shared/codex/protocol.md`` §3.2 and §6. Nearly every error a
client meets is JSON-RPC code ``-32600`` (invalid request); the message tells them apart:

========================================================  ======================================  =======
situation                                                 ``error.message``                       class
========================================================  ======================================  =======
resume/fork/archive of an unknown thread, of a thread     ``no rollout found for thread id <id>``  rotate
that never ran a turn, or whose rollout file is gone
another live app-server (same ``CODEX_HOME``) holds it    ``thread <id> already has an active      retry
                                                          writer``
server overloaded (code ``-32001``)                       ``Server overloaded; retry later.``      retry
resume of an archived thread                              ``session <id> is archived. Run           fail
                                                          `codex unarchive <id>` to unarchive it
                                                          first.``
resume with a non-UUID id                                 ``invalid session id: invalid             fail
                                                          character: …``
``turn/start`` on a thread not loaded in this process     ``thread not found: <id>``               fail
========================================================  ======================================  =======

Transport failures (the process died, stdout EOF, a frame too large, a non-JSON line, a broken pipe, a
request past its deadline) are retryable: the thread still exists, only the process is gone.
"""

from __future__ import annotations

import enum
from typing import Any

#: JSON-RPC code codex uses for almost every refusal (``codex-rs/app-server/src/error_code.rs``).
INVALID_REQUEST = -32600
#: ``OVERLOADED_ERROR_CODE`` in ``codex-rs/app-server/src/error_code.rs``: "Server overloaded; retry later."
OVERLOADED = -32001
#: What we answer to a server-initiated request we do not handle (JSON-RPC "method not found").
METHOD_NOT_FOUND = -32601

THREAD_GONE_PREFIX = "no rollout found for thread id "
ACTIVE_WRITER_SUFFIX = " already has an active writer"


class CodexError(Exception):
    """Base of every codex failure; ``str(exc)`` is a reason an operator can act on."""


class TransportError(CodexError):
    """The app-server connection is unusable: process died, stdout EOF, frame too large, non-JSON
    stdout line, broken stdin pipe, or (subclass) a request past its deadline.

    ``stderr_tail`` holds the last lines codex wrote to stderr (its logs); they are also part of
    ``str(exc)`` because they usually name the cause (e.g. ``Error: CODEX_HOME points to "…", but that
    path does not exist``).
    """

    def __init__(self, reason: str, *, stderr_tail: str = "") -> None:
        self.reason = reason
        self.stderr_tail = stderr_tail
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

    ``code`` and ``message`` are verbatim; codex 0.169.0 sent no ``data`` in any error observed.
    """

    def __init__(self, method: str, code: int, message: str, data: Any = None) -> None:
        self.method = method
        self.code = code
        self.message = message
        self.data = data
        super().__init__(f"codex {method} failed: JSON-RPC error {code}: {message}")


class ErrorClass(enum.Enum):
    """What a caller does about a failure."""

    ROTATE = "rotate"  # the thread is gone for good: start a new one (once, with a notice)
    RETRY = "retry"  # transient: keep the binding, try the turn again later
    FAIL = "fail"  # keep the binding, fail the turn with the reason


def is_thread_gone(exc: BaseException) -> bool:
    """True only for ``-32600`` ``no rollout found for thread id <id>``: codex cannot hand the thread back.

    That is the one answer that proves the thread is unrecoverable (codex 0.169.0: unknown id, a thread
    that never ran a turn, or a deleted rollout file). Everything else keeps the thread.
    """
    return (
        isinstance(exc, JsonRpcError)
        and exc.code == INVALID_REQUEST
        and isinstance(exc.message, str)
        and exc.message.startswith(THREAD_GONE_PREFIX)
    )


def _is_active_writer(exc: JsonRpcError) -> bool:
    # "thread <id> already has an active writer": another live process holds the thread lock.
    message = exc.message if isinstance(exc.message, str) else ""
    return (
        exc.code == INVALID_REQUEST
        and message.startswith("thread ")
        and message.endswith(ACTIVE_WRITER_SUFFIX)
    )


def classify(exc: BaseException) -> ErrorClass:
    """Classify a codex failure (table in the module docstring).

    ROTATE: :func:`is_thread_gone` only. RETRY: any :class:`TransportError` (timeouts included),
    ``-32001`` overloaded, ``-32600`` ``thread <id> already has an active writer``. FAIL: everything else,
    including archived sessions, invalid ids, ``thread not found``, unknown codes and non-codex exceptions.
    """
    if is_thread_gone(exc):
        return ErrorClass.ROTATE
    if isinstance(exc, TransportError):
        return ErrorClass.RETRY
    if isinstance(exc, JsonRpcError) and (exc.code == OVERLOADED or _is_active_writer(exc)):
        return ErrorClass.RETRY
    return ErrorClass.FAIL
