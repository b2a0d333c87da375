"""The turn runner: resume-or-rotate a thread on one app-server, then drive one turn to its end.

Wire sequences before ``turn/start`` (design §3, pinned by tests):

    no binding                                   ["thread/start"]
    binding, thread alive                        ["thread/resume"]
    binding, codex answers -32600 "no rollout…"  ["thread/resume", "thread/start"]   (rotation)

Re-runs after a lost worker add ``thread/turns/list`` (adopt the turn if codex completed it) and,
when that worker had started a fresh thread, first try ``thread/resume`` of that thread.

Only that one answer rotates (``errors.is_thread_gone``); every other failure ends the run with
``TurnRunError`` and leaves the binding alone. The runner touches no database: it returns a
``TurnOutcome`` that ``hermes_sessions.services`` commits in one transaction.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .client import AppServerClient
from .errors import (
    OVERLOADED,
    CodexError,
    ErrorClass,
    JsonRpcError,
    TransportError,
    TurnTimeout,
    classify,
    is_thread_gone,
)
from .projection import ItemProjector

logger = logging.getLogger(__name__)

INTERRUPT_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.25
# codex answers -32001 "Server overloaded; retry later." when its queue is full: back off and retry.
OVERLOAD_BACKOFF_SECONDS = (0.2, 0.5, 1.0, 2.0, 4.0)
THREAD_NOT_FOUND_PREFIX = "thread not found: "

_SANDBOX_POLICY = {
    "read-only": lambda cwd: {"type": "readOnly"},
    # Only the session's own directory is writable: not /tmp, not $TMPDIR (shared with other sessions).
    "workspace-write": lambda cwd: {
        "type": "workspaceWrite", "writableRoots": [cwd], "networkAccess": False,
        "excludeTmpdirEnvVar": True, "excludeSlashTmp": True,
    },
    "danger-full-access": lambda cwd: {"type": "dangerFullAccess"},
}


@dataclass
class TurnSpec:
    """One turn to run. ``thread_id`` is the bound thread (``None``: start one). ``fresh_input``
    returns the text to send when a fresh thread is started (the user's text behind the history
    seed); it is only called then. ``turn_timeout`` is seconds from ``turn/start`` to
    ``turn/completed``."""

    text: str
    thread_id: str | None
    cwd: str
    sandbox: str = "read-only"
    approval_policy: str = "never"
    model: str | None = None
    developer_instructions: str | None = None
    fresh_input: Callable[[], str] | None = None
    turn_timeout: float = 600.0
    # Our turn id, sent as turn/start's clientUserMessageId; codex keeps it on the turn's
    # userMessage item (``clientId``), so a re-run after a crash can find the turn codex already ran.
    client_turn_id: str | None = None
    adopt_completed: bool = False
    control: TurnControl | None = None
    # Set when the bound thread's rollout was written under another CODEX_HOME (another host): its
    # absence here proves nothing, so "no rollout found" must not rotate.
    thread_elsewhere: str = ""
    # Re-runs only: the fresh thread a lost worker started for this turn (not bound: I1).
    previous_thread_id: str | None = None
    # Called with a freshly started thread's id before turn/start, so a re-run can find it.
    on_thread_started: Callable[[str], None] | None = None


class TurnControl:
    """Signals from outside the runner (the lease heartbeat): ``interrupt`` asks codex to stop the
    turn (``turn/interrupt``; it then ends ``interrupted``); ``abandon`` means this worker no longer
    holds the turn — stop at once and commit nothing."""

    def __init__(self) -> None:
        self.interrupt = threading.Event()
        self.abandon = threading.Event()
        self.running: tuple[str, str] | None = None  # (thread id, codex turn id) once turn/start answered

    def stopping(self) -> bool:
        """True once either signal is set: no point retrying."""
        return self.interrupt.is_set() or self.abandon.is_set()


class TurnAbandoned(CodexError):
    """The worker lost its claim on the turn (lease expired, turn taken back); nothing is committed."""


@dataclass
class TurnOutcome:
    """What happened, in the app's words. ``status`` is codex's ``turn/completed`` status
    (``completed`` | ``failed`` | ``interrupted``) or ``None`` if the turn never completed.
    ``rotated_from``/``rotation_reason``: the bound thread codex proved gone, and its error text.
    ``messages``: projected rows (see ``projection.ItemProjector``). ``usage``: codex's last
    ``thread/tokenUsage/updated`` in snake_case. ``methods``: requests sent before ``turn/start``.
    ``timings``: milliseconds per phase."""

    thread_action: str = ""
    thread_id: str = ""
    codex_turn_id: str = ""
    status: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    final_text: str = ""
    error: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)
    rotated_from: str | None = None
    rotation_reason: str = ""
    adopted: bool = False  # codex had already completed this turn (a re-run after a crash)


class TurnRunError(CodexError):
    """The turn could not be run to ``turn/completed``. ``outcome`` holds what was learnt before
    the failure (notably ``rotated_from``); ``error_class`` is ``errors.classify`` of the cause."""

    def __init__(self, reason: str, outcome: TurnOutcome, cause: BaseException | None = None, *, before_turn_start: bool = True):
        super().__init__(reason)
        self.outcome = outcome
        self.cause = cause
        self.error_class = classify(cause) if cause is not None else ErrorClass.FAIL
        # True when codex never saw turn/start: the whole run can be retried without running the input twice.
        self.before_turn_start = before_turn_start


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)


def _thread_id(result: dict) -> str:
    thread = result.get("thread") or {}
    return str(thread.get("id") or thread.get("sessionId") or result.get("threadId") or "")


def _describe(step: str, exc: BaseException) -> str:
    if isinstance(exc, JsonRpcError):
        text = f"codex {step} failed ({exc.code}): {exc.message}"
    else:
        text = f"codex {step} failed: {exc}"
    return f"{text} — the binding is kept"


def run_turn(client: AppServerClient, spec: TurnSpec) -> TurnOutcome:
    """Resume or start the thread on ``client`` (already initialized), run one turn, return the
    outcome. Raises ``TurnRunError`` for anything short of ``turn/completed``."""
    out = TurnOutcome()
    first = len(client.sent_methods)
    t0 = time.monotonic()
    thread_params: dict[str, Any] = {
        "cwd": spec.cwd,
        "sandbox": spec.sandbox,
        "approvalPolicy": spec.approval_policy,
    }
    if spec.model:
        thread_params["model"] = spec.model
    if spec.developer_instructions:
        thread_params["developerInstructions"] = spec.developer_instructions

    text, reused = _open_thread(client, spec, out, thread_params, first)
    out.methods = client.sent_methods[first:]
    if (out.thread_action == "resumed" or reused) and spec.adopt_completed and spec.client_turn_id:
        try:
            if _adopt_completed_turn(client, spec, out):
                out.timings["thread_ms"] = _ms(t0)
                return out
        except CodexError as exc:
            raise TurnRunError(_describe("thread/turns/list", exc), out, exc) from exc
    out.timings["thread_ms"] = _ms(t0)
    if spec.control is not None and spec.control.interrupt.is_set():
        out.status = "interrupted"  # cancelled before codex saw the input: nothing ran
        return out

    turn_params: dict[str, Any] = {
        "threadId": out.thread_id,
        "input": [{"type": "text", "text": text, "text_elements": []}],
        "cwd": spec.cwd,
        "approvalPolicy": spec.approval_policy,
        "sandboxPolicy": _SANDBOX_POLICY[spec.sandbox](spec.cwd),
    }
    if spec.model:
        turn_params["model"] = spec.model
    if spec.client_turn_id:
        turn_params["clientUserMessageId"] = spec.client_turn_id
    t1 = time.monotonic()
    try:
        try:
            started = _request(client, "turn/start", turn_params)
        except JsonRpcError as exc:
            # codex 0.169.0: "thread not found: <id>" when the thread is not loaded in this process
            # (e.g. unloaded since the resume): resume it, then retry once.
            if not exc.message.startswith(THREAD_NOT_FOUND_PREFIX):
                raise
            _request(client, "thread/resume", {"threadId": out.thread_id, "excludeTurns": True})
            started = _request(client, "turn/start", turn_params)
        out.codex_turn_id = str((started.get("turn") or {}).get("id") or "")
        if spec.control is not None:
            spec.control.running = (out.thread_id, out.codex_turn_id)
        _drive(client, spec, out)
    except TurnRunError:
        raise
    except CodexError as exc:
        raise TurnRunError(_describe("turn", exc), out, exc, before_turn_start=False) from exc
    finally:
        out.timings["turn_ms"] = _ms(t1)
    return out


def _open_thread(client: AppServerClient, spec: TurnSpec, out: TurnOutcome, thread_params: dict, first: int) -> tuple[str, bool]:
    """Resume the bound thread, or rotate, or (on a re-run) reuse the lost worker's fresh thread, or
    start one. Fills ``out.thread_action``/``thread_id``/``rotated_from``; returns the input text to
    send (seeded for a fresh thread) and whether the lost worker's thread was reused."""
    text = spec.text
    if spec.thread_id:
        try:
            # A plain resume (no overrides) writes nothing to the rollout (portability.md §4);
            # excludeTurns: our transcript is the source of truth (I5), and it is faster.
            resumed = _request(client, "thread/resume", {"threadId": spec.thread_id, "excludeTurns": True})
            # codex's own spelling of the id from here on: notifications are matched against it.
            out.thread_action, out.thread_id = "resumed", _thread_id(resumed) or spec.thread_id
        except CodexError as exc:
            if not is_thread_gone(exc):
                out.methods = client.sent_methods[first:]
                raise TurnRunError(_describe("thread/resume", exc), out, exc) from exc
            if spec.thread_elsewhere:
                out.methods = client.sent_methods[first:]
                raise TurnRunError(
                    f"codex has no rollout for thread {spec.thread_id} in this worker's CODEX_HOME, but the thread "
                    f"was bound in {spec.thread_elsewhere!r}; not rotating — run this session's turns on workers "
                    "that share that CODEX_HOME (CODEX_HOME_ID) — the binding is kept",
                    out,
                ) from exc
            out.rotated_from, out.rotation_reason = spec.thread_id, exc.message  # type: ignore[attr-defined]
    reused = False
    if not out.thread_action and spec.previous_thread_id:
        # A re-run after a lost worker that had already started a fresh thread for this turn: that
        # thread has a rollout only if codex saw our turn/start, so resume it (and adopt the turn if
        # it completed) rather than start a second thread and run the input twice.
        try:
            resumed = _request(client, "thread/resume", {"threadId": spec.previous_thread_id, "excludeTurns": True})
            out.thread_action = "rotated" if out.rotated_from else "started"
            out.thread_id, reused = _thread_id(resumed) or spec.previous_thread_id, True
        except CodexError as exc:
            if not is_thread_gone(exc):
                out.methods = client.sent_methods[first:]
                raise TurnRunError(_describe("thread/resume", exc), out, exc) from exc
            # no rollout: the lost worker never reached turn/start; start afresh below
    if not out.thread_action:
        try:
            result = _request(client, "thread/start", thread_params)
        except CodexError as exc:
            out.methods = client.sent_methods[first:]
            raise TurnRunError(_describe("thread/start", exc), out, exc) from exc
        out.thread_action = "rotated" if out.rotated_from else "started"
        out.thread_id = _thread_id(result)
        if spec.on_thread_started is not None:
            spec.on_thread_started(out.thread_id)
        if spec.fresh_input is not None:
            text = spec.fresh_input()
    return text, reused

def _request(client: AppServerClient, method: str, params: dict) -> dict:
    """``client.request`` that backs off and retries on -32001 overload (codex's own advice)."""
    for delay in (*OVERLOAD_BACKOFF_SECONDS, None):
        try:
            return client.request(method, params)
        except JsonRpcError as exc:
            if exc.code != OVERLOADED or delay is None:
                raise
            logger.info("codex %s overloaded; retrying in %.1f s", method, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


# Items that only carry text: a turn cut off with nothing else in it did nothing in the world.
_TEXT_ONLY_ITEMS = {"userMessage", "agentMessage", "reasoning", "plan", "contextCompaction"}


def _adopt_completed_turn(client: AppServerClient, spec: TurnSpec, out: TurnOutcome) -> bool:
    """Look for this turn in codex's thread (its userMessage carries our ``clientId``) on a re-run
    after a lost worker. Returns True when ``out`` is now final, without running the input again:

    * codex completed it → adopted (``status`` completed, its items projected);
    * codex cut it off after it ran commands, file changes or tool calls → ``status`` failed with
      the reason and the items it completed: running the input again would repeat those actions.

    Returns False — run the input — when codex never saw it, or cut it off before it did
    anything but text."""
    page = _request(client, "thread/turns/list", {"threadId": out.thread_id, "limit": 10, "itemsView": "full"})
    for turn in page.get("data") or []:
        items = turn.get("items") or []
        ours = any(i.get("type") == "userMessage" and i.get("clientId") == spec.client_turn_id for i in items)
        if not ours:
            continue
        status = turn.get("status")
        acted = [i.get("type") for i in items if i.get("type") not in _TEXT_ONLY_ITEMS]
        if status != "completed" and not acted:
            return False  # cut off before doing anything: safe to run again
        projector = ItemProjector()
        for item in items:
            projector.add(item)
        out.codex_turn_id = str(turn.get("id") or "")
        out.messages, out.final_text, out.adopted = projector.messages, projector.final_text, True
        if status == "completed":
            out.status = "completed"
        else:
            out.status = "failed"
            out.error = (
                f"the worker running this turn was lost after codex had started it; codex's turn "
                f"{out.codex_turn_id} was cut off ({status}) after {', '.join(sorted(set(acted)))} — not run "
                "again, so nothing it did is repeated; its completed items are kept"
            )
        return True
    return False


def _scope(params: dict) -> tuple[str | None, str | None]:
    """(threadId, turnId) a notification belongs to, as hermes reads them (reference §2.2)."""
    turn = params.get("turn") if isinstance(params.get("turn"), dict) else {}
    item = params.get("item") if isinstance(params.get("item"), dict) else {}
    thread_id = params.get("threadId") or turn.get("threadId") or item.get("threadId")
    turn_id = params.get("turnId") or turn.get("id") or item.get("turnId")
    return thread_id, turn_id


def _usage(token_usage: dict) -> dict[str, Any]:
    last = token_usage.get("last") or {}
    total = token_usage.get("total") or {}
    usage = {
        "input_tokens": last.get("inputTokens"),
        "cached_input_tokens": last.get("cachedInputTokens"),
        "output_tokens": last.get("outputTokens"),
        "reasoning_output_tokens": last.get("reasoningOutputTokens"),
        "total_tokens": last.get("totalTokens"),
        "thread_total_tokens": total.get("totalTokens"),
        "model_context_window": token_usage.get("modelContextWindow"),
    }
    return {k: v for k, v in usage.items() if v is not None}


def _drive(client: AppServerClient, spec: TurnSpec, out: TurnOutcome) -> None:
    """Read notifications until this turn's ``turn/completed`` or the deadline."""
    projector = ItemProjector()
    deadline = time.monotonic() + spec.turn_timeout
    last_error = ""
    control = spec.control
    interrupt_sent = False
    try:
        while True:
            if control is not None:
                if control.abandon.is_set():
                    raise TurnAbandoned("this worker no longer holds the turn (lease lost); nothing was committed")
                if control.interrupt.is_set() and not interrupt_sent:
                    interrupt_sent = True
                    _interrupt(client, out)
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = _interrupt_after_timeout(client, out, projector)
                raise TurnTimeout(
                    f"turn/completed did not arrive within {spec.turn_timeout:g} s; "
                    + ("the turn was interrupted" if stopped else "turn/interrupt got no answer either; the app-server was stopped")
                )
            note = client.next_notification(timeout=min(left, POLL_SECONDS))
            if note is None:
                continue
            method = note.get("method")
            params = note.get("params") if isinstance(note.get("params"), dict) else {}
            thread_id, turn_id = _scope(params)
            if thread_id and thread_id != out.thread_id:
                continue
            if turn_id and out.codex_turn_id and turn_id != out.codex_turn_id:
                continue
            if method == "item/completed":
                projector.add(params.get("item") or {})
            elif method == "thread/tokenUsage/updated":
                out.usage = _usage(params.get("tokenUsage") or {})
            elif method == "error":
                err = params.get("error") or {}
                if not params.get("willRetry"):
                    last_error = str(err.get("message") or err)
            elif method == "turn/completed":
                turn = params.get("turn") or {}
                out.status = str(turn.get("status") or "failed")
                err = turn.get("error") or {}
                if out.status != "completed":
                    out.error = str((err.get("message") if isinstance(err, dict) else err) or last_error or "")
                return
    finally:
        out.messages = projector.messages
        out.final_text = projector.final_text


def _interrupt(client: AppServerClient, out: TurnOutcome) -> bool:
    """Send ``turn/interrupt``; codex 0.169.0 then ends the turn ``interrupted`` within ~12 ms.
    Returns False when codex refused (e.g. -32600 "no active turn to interrupt")."""
    try:
        client.request("turn/interrupt", {"threadId": out.thread_id, "turnId": out.codex_turn_id}, timeout=INTERRUPT_GRACE_SECONDS)
        return True
    except (CodexError, TransportError) as exc:
        logger.info("turn/interrupt of %s refused: %s", out.codex_turn_id, exc)
        return False


def _interrupt_after_timeout(client: AppServerClient, out: TurnOutcome, projector: ItemProjector) -> bool:
    """Best effort: ask codex to stop the turn and collect what it completed meanwhile.
    Returns whether codex acknowledged the interrupt."""
    if not _interrupt(client, out):
        return False
    end = time.monotonic() + INTERRUPT_GRACE_SECONDS
    while time.monotonic() < end:
        try:
            note = client.next_notification(timeout=POLL_SECONDS)
        except TransportError:
            return True
        if not note:
            continue
        params = note.get("params") or {}
        if note.get("method") == "item/completed":
            projector.add(params.get("item") or {})
        elif note.get("method") == "turn/completed":
            return True
    return True
