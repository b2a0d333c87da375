"""The turn runner: resume-or-rotate a thread on one app-server, then drive one turn to its end.

Wire sequences before ``turn/start`` (``docs/contract.md`` §3, pinned by tests):

    no binding                                   ["thread/start"]
    binding, thread alive                        ["thread/resume"]
    binding, codex answers -32600 "no rollout…"  ["thread/resume", "thread/start"]   (rotation)

Re-runs after a lost worker add ``thread/turns/list`` (adopt the turn if codex completed it) and,
when that worker had started a fresh thread, first try ``thread/resume`` of that thread.

Decisions are made on the error's type (the table in ``errors.py``): only ``ThreadGone`` on the bound
thread rotates, and only when ``TurnSpec.rollout_restored`` is False (PostgreSQL held no rollout for
it: the thread truly is gone — with a restored rollout, codex's "no rollout found" is an
infrastructure failure and the turn fails, binding kept); ``ThreadNotLoaded`` on ``turn/start``
resumes and retries once; every other failure ends the run with ``TurnRunError`` — its ``cause`` the
typed error, ``before_turn_start`` whether codex can have run the input — and leaves the binding alone.
The runner never retries or sleeps: the caller applies the one retry policy
(``worker/retry_policy.py``). It touches no database: it returns a ``TurnOutcome`` that
``hermes_sessions.services`` commits in one transaction.

Notifications are read only after ``turn/start`` answers: the client queues those that arrive
earlier (codex may send ``turn/started``, the items and even ``turn/completed`` before its response),
and they are then matched against the turn id from the response; a stdout EOF after
``turn/completed`` cannot fail a turn that has already ended.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..latency_marks import mark
from .client import AppServerClient, PendingRequest
from .errors import CodexError, JsonRpcError, ThreadGone, ThreadNotLoaded, TransportError, TurnTimeout, turn_error_text
from .projection import ItemProjector
from .rollout_files import RolloutDelta

logger = logging.getLogger(__name__)

INTERRUPT_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.25

# No legacy ``sandbox`` (thread/start) or ``sandboxPolicy`` (turn/start) is ever sent: on codex 0.171.0
# a legacy field replaces the configured permission profile with the legacy sandbox, which reads
# everything (openai/codex#46252, measured: docs/codex.md §10). The sandbox is the app-server's
# permission profile (``launch.permission_overrides``), checked after every thread/start and thread/resume.
BWRAP_PREFIX = "bwrap:"


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
    # The permission profile the app-server was launched with (``launch.permission_profile``); when set,
    # every thread/start and thread/resume answer must report it as ``activePermissionProfile.id``.
    permission_profile: str = ""
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
    # The bound thread's rollout was restored from PostgreSQL into this app-server's CODEX_HOME: codex's
    # "no rollout found" then cannot mean the thread is gone, and fails the turn instead of rotating.
    rollout_restored: bool = False
    # The bound thread is already loaded in this app-server, whose connection started or resumed it (a
    # thread kept loaded since the session's last turn, ``worker/warm/kept.py``): no ``thread/resume`` is sent —
    # its answer (and permission profile, checked then) is that of the last one. Should codex have
    # unloaded it meanwhile, ``turn/start`` answers ``thread not found`` and ``_start_turn`` resumes it.
    thread_loaded: bool = False
    # Re-runs only: the fresh thread a lost worker started for this turn (not bound: I1).
    previous_thread_id: str | None = None
    # Called with a freshly started thread's id before turn/start, so a re-run can find it.
    on_thread_started: Callable[[str], None] | None = None
    # Called on the reading thread, in codex's order, with what the turn streams (docs/contract.md §8):
    # ("delta", {"item_id", "text"}) per agent-message delta (item/agentMessage/delta), and
    # ("item", {"item_id", "item_type", "messages"}) per completed item that projects into transcript
    # rows (the rows as in TurnOutcome.messages). It must not raise; the services write the rows.
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    # Called on the reading thread between notifications (and at least every POLL_SECONDS); returns the
    # seconds until it wants to be called again, or None (the event writer's deadline, services/events.py).
    on_tick: Callable[[], float | None] | None = None
    # ``turn/start`` was sent already on the kept thread (``thread_loaded``), with
    # ``kept_turn_start_params``, while the worker claimed the turn (``worker/warm/early_start.py``): its answer
    # is awaited instead of sending one.
    turn_start: PendingRequest | None = None


class TurnControl:
    """Signals from outside the runner (the lease heartbeat, the worker's time limits): ``interrupt``
    asks codex to stop the turn (``turn/interrupt``; it then ends ``interrupted``); ``abandon`` means
    this worker no longer holds the turn — stop at once and commit nothing; ``time_limit`` (a reason,
    ``""`` while within it) means the worker's time limit ended the turn: ``out_of_time`` ends the
    app-server the turn runs on (``attach``), so whatever read of it is blocked raises
    ``TransportError``, and the worker fails the turn with that reason (``worker/time_limits.py``)."""

    def __init__(self) -> None:
        self.interrupt = threading.Event()
        self.abandon = threading.Event()
        self.running: tuple[str, str] | None = None  # (thread id, codex turn id) once turn/start answered
        self.thread_id = ""  # the thread the turn runs on, once opened (before turn/start is sent)
        # fileChange items codex started in this turn, by item id (their ``changes``: the diff an approval
        # of that item is about; codex 0.171.0 sends it on item/started, not in the request).
        self.file_changes: dict[str, list[Any]] = {}
        self.time_limit = ""
        self._end_codex: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._waiting = 0  # requests waiting for a person now
        self._waiting_since = 0.0
        self._waited = 0.0

    def person_waits(self, waiting: bool) -> None:
        """A request starts (``True``) or stops (``False``) waiting for a person: the time during which
        at least one waits is not counted against the turn's ``turn_timeout`` (``waited_seconds``)."""
        with self._lock:
            now = time.monotonic()
            if waiting:
                if not self._waiting:
                    self._waiting_since = now
                self._waiting += 1
            elif self._waiting:
                self._waiting -= 1
                if not self._waiting:
                    self._waited += now - self._waiting_since

    def waited_seconds(self) -> float:
        """Seconds this turn spent waiting for a person so far (monotonic clock), the current wait included."""
        with self._lock:
            return self._waited + (time.monotonic() - self._waiting_since if self._waiting else 0.0)

    def waiting_for_person(self) -> bool:
        """Whether a request of the turn waits for a person now (``person_waits``)."""
        with self._lock:
            return bool(self._waiting)

    def stopping(self) -> bool:
        """True once a signal is set or the time limit passed: no point retrying."""
        return self.interrupt.is_set() or self.abandon.is_set() or bool(self.time_limit)

    def attach(self, end_codex: Callable[[], None] | None) -> None:
        """``end_codex`` ends the app-server the turn runs on from now (``None``: none any more); called at
        once when the time limit passed already. Must not block (a scheduler job calls it)."""
        with self._lock:
            self._end_codex = end_codex
            late = end_codex if self.time_limit else None
        if late is not None:
            late()

    def give_up(self) -> None:
        """This worker gives the turn up (``worker/runners.py``, its stop): end the attached app-server
        first — no answer reaches a codex that could act on it —, then set ``abandon``. Must not block."""
        with self._lock:
            end = self._end_codex
        if end is not None:
            end()
        self.abandon.set()

    def out_of_time(self, reason: str) -> None:
        """The worker's time limit passed: record ``reason`` and end the attached app-server, if any."""
        with self._lock:
            self.time_limit = reason
            end = self._end_codex
        if end is not None:
            end()


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
    # What codex appended to the thread's rollout (read after the app-server exited), stored with the
    # turn (services/rollouts.py); None when the thread has no rollout (it ran no turn).
    rollout: RolloutDelta | None = None
    codex_version: str = ""  # from initialize's userAgent
    # Streamed events (``(kind, data)``, codex's order) not yet written when the turn ended; the service
    # that commits the turn writes them in the same transaction, before its last events.
    stream_tail: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # Approvals this claim recorded (worker/approvals.py): when non-zero, the commit that ends the turn
    # closes those still pending (services/approvals.py); zero costs that commit nothing.
    approvals: int = 0


class TurnRunError(CodexError):
    """The turn could not be run to ``turn/completed``. ``outcome`` holds what was learnt before
    the failure (notably ``rotated_from``); ``cause`` is the typed error (``errors.py``), or ``None``;
    ``before_turn_start`` is True when codex cannot have run the input (``turn/start`` was never sent,
    or codex answered it with an error), so the whole run may be tried again."""

    def __init__(
        self,
        reason: str,
        outcome: TurnOutcome,
        cause: BaseException | None = None,
        *,
        before_turn_start: bool = True,
    ) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.cause = cause
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


def drive_turn(client: AppServerClient, spec: TurnSpec) -> TurnOutcome:
    """Resume or start the thread on ``client`` (already initialized), run one turn, return the
    outcome (``status`` completed | failed | interrupted). Raises ``TurnRunError`` for anything short
    of ``turn/completed``; it never retries (the caller's ``RetryPolicy`` does)."""
    out = TurnOutcome()
    first = len(client.sent_methods)
    t0 = time.monotonic()
    text, reused = _open_thread(client, spec, out, first)
    out.methods = client.sent_methods[first:]
    if spec.control is not None:
        spec.control.thread_id = out.thread_id  # an approval codex sends is matched to this turn by it
    if (out.thread_action == "resumed" or reused) and spec.adopt_completed and spec.client_turn_id:
        try:
            if _adopt_completed_turn(client, spec, out):
                out.timings["thread_ms"] = _ms(t0)
                return out
        except CodexError as exc:
            raise TurnRunError(_describe("thread/turns/list", exc), out, exc) from exc
    out.timings["thread_ms"] = _ms(t0)
    if spec.control is not None and spec.control.interrupt.is_set() and spec.turn_start is None:
        out.status = "interrupted"  # cancelled before codex saw the input: nothing ran
        return out  # (an early turn/start has been sent: the turn is interrupted once codex answers it)
    t1 = time.monotonic()
    try:
        _start_turn(client, spec, out, text)
        try:
            _drive(client, spec, out)
        except CodexError as exc:  # codex has the input: never run it again
            raise TurnRunError(_describe("turn", exc), out, exc, before_turn_start=False) from exc
        _fail_on_sandbox_error(out)
    finally:
        out.timings["turn_ms"] = _ms(t1)
    return out


class PermissionProfileMismatch(CodexError):
    """codex reports a permission profile other than the one the app-server was launched with (e.g. a
    resume that came back under the default profile, openai/codex#25590): no command may run."""


class SandboxFailure(CodexError):
    """A command's output starts with ``bwrap:``: codex's sandbox could not run on this host. An
    infrastructure failure, not the model's: the turn fails (nothing is ever run unsandboxed)."""


def _check_profile(spec: TurnSpec, out: TurnOutcome, method: str, result: dict[str, Any]) -> None:
    """Fail the run (before ``turn/start``) when ``result`` names another profile than ``spec``'s."""
    if not spec.permission_profile:
        return
    active = result.get("activePermissionProfile")
    got = active.get("id") if isinstance(active, dict) else None
    if got != spec.permission_profile:
        exc = PermissionProfileMismatch(
            f"codex {method} reported permission profile {got!r}, not {spec.permission_profile!r}; "
            "no command was run — the binding is kept"
        )
        raise TurnRunError(str(exc), out, exc)


def _fail_on_sandbox_error(out: TurnOutcome) -> None:
    """A command whose output starts with ``bwrap:`` never ran: the sandbox failed on this host
    (openai/codex#29908, #15057). The turn ends ``failed`` with that reason (its items are kept),
    whatever codex's own status."""
    for message in out.messages:
        if message.get("role") != "tool" or not str(message.get("tool_call_id", "")).startswith("codex_exec_"):
            continue
        lines = str(message.get("content") or "").lstrip().splitlines()
        if lines and lines[0].startswith("[") and lines[0].endswith("]"):
            lines = lines[1:]  # the projection's "[exit N]" / "[status]" prefix
        first = lines[0].strip() if lines else ""
        if first.startswith(BWRAP_PREFIX):
            out.status = "failed"
            out.error = f"codex sandbox unavailable on this host: {first[:300]} — the command did not run"
            return


def _thread_params(spec: TurnSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"cwd": spec.cwd, "approvalPolicy": spec.approval_policy}
    if spec.model:
        params["model"] = spec.model
    if spec.developer_instructions:
        params["developerInstructions"] = spec.developer_instructions
    return params


def kept_turn_start_params(*, thread_id: str, text: str, client_turn_id: str | None) -> dict[str, Any]:
    """``turn/start``'s params on a thread kept loaded in its app-server (no overrides, ``_turn_params``):
    ``{"threadId", "input": [one text element], "clientUserMessageId"?}``."""
    params: dict[str, Any] = {
        "threadId": thread_id,
        "input": [{"type": "text", "text": text, "text_elements": []}],
    }
    if client_turn_id:
        params["clientUserMessageId"] = client_turn_id
    return params


def _turn_params(spec: TurnSpec, thread_id: str, text: str, *, overrides: bool) -> dict[str, Any]:
    """``turn/start``'s params. ``overrides``: also the session's ``cwd``, ``approvalPolicy`` and
    ``model``, which stick for the thread's later turns in this app-server (``protocol.md`` §3.4) — sent
    on the first turn after a ``thread/start`` / ``thread/resume`` in this process, not on a kept
    thread's (``spec.thread_loaded``: its previous ``turn/start`` here set them, and a kept thread is
    only used while the session's config is unchanged, ``kept.KeptThread.usable_for``). codex 0.169
    under the read-only profile spends ~5 ms more on a turn that carries ``cwd`` and ``approvalPolicy``
    again, same values or not (25 alternating turns on one loaded thread: 62.7 ms without, 67.7 with)."""
    params = kept_turn_start_params(thread_id=thread_id, text=text, client_turn_id=spec.client_turn_id)
    if overrides:
        params["cwd"] = spec.cwd
        params["approvalPolicy"] = spec.approval_policy
        if spec.model:
            params["model"] = spec.model
    return params


def _start_turn(client: AppServerClient, spec: TurnSpec, out: TurnOutcome, text: str) -> None:
    """Send ``turn/start`` and record codex's turn id. A ``ThreadNotLoaded`` answer (codex 0.169.0:
    ``thread not found: <id>`` when the thread is not loaded in this process, e.g. unloaded since the
    resume) resumes the thread and sends ``turn/start`` once more."""
    kept = _kept_thread(spec)
    try:
        try:
            if spec.turn_start is not None:  # sent early, on the kept thread, beside the claim (``TurnSpec.turn_start``)
                started = spec.turn_start.result()
            else:
                mark("codex.turn_start.sent", spec.client_turn_id)
                started = client.request("turn/start", _turn_params(spec, out.thread_id, text, overrides=not kept))
            mark("codex.turn_start.answered", spec.client_turn_id)
        except ThreadNotLoaded:
            resumed = client.request("thread/resume", {"threadId": out.thread_id, "excludeTurns": True})
            _check_profile(spec, out, "thread/resume", resumed)
            started = client.request("turn/start", _turn_params(spec, out.thread_id, text, overrides=True))
    except JsonRpcError as exc:
        # codex refused turn/start: it never ran the input, so the run may be tried again.
        raise TurnRunError(_describe("turn", exc), out, exc, before_turn_start=True) from exc
    except TransportError as exc:
        # No answer: codex may have started the turn; running the input again could repeat it — unless
        # turn/start provably never reached it (the connection had failed already, or the write failed:
        # a kept app-server that died between turns, turn/start being its first request then).
        raise TurnRunError(_describe("turn", exc), out, exc, before_turn_start=not exc.sent) from exc
    out.codex_turn_id = str((started.get("turn") or {}).get("id") or "")
    if spec.control is not None:
        spec.control.running = (out.thread_id, out.codex_turn_id)


def _kept_thread(spec: TurnSpec) -> bool:
    """Whether the turn runs on the thread kept loaded in this app-server as it is: no ``thread/resume``
    before ``turn/start``, and no overrides on it."""
    return bool(spec.thread_id) and spec.thread_loaded and not spec.adopt_completed


def _open_thread(client: AppServerClient, spec: TurnSpec, out: TurnOutcome, first: int) -> tuple[str, bool]:
    """Resume the bound thread, or rotate, or (on a re-run) reuse the lost worker's fresh thread, or
    start one. Fills ``out.thread_action``/``thread_id``/``rotated_from``; returns the input text to
    send (seeded for a fresh thread) and whether the lost worker's thread was reused."""
    if spec.thread_id and _kept_thread(spec):
        out.thread_action, out.thread_id = "resumed", spec.thread_id
        return spec.text, False
    try:
        if spec.thread_id:
            _resume_bound(client, spec, out)
        reused = not out.thread_action and bool(spec.previous_thread_id) and _resume_previous(client, spec, out)
        if out.thread_action:
            return spec.text, reused
        result = _request_step(client, out, "thread/start", _thread_params(spec))
        _check_profile(spec, out, "thread/start", result)
    except TurnRunError:
        out.methods = client.sent_methods[first:]
        raise
    out.thread_action = "rotated" if out.rotated_from else "started"
    out.thread_id = _thread_id(result)
    if spec.on_thread_started is not None:
        spec.on_thread_started(out.thread_id)
    text = spec.fresh_input() if spec.fresh_input is not None else spec.text
    return text, False


def _resume_bound(client: AppServerClient, spec: TurnSpec, out: TurnOutcome) -> None:
    """``thread/resume`` the bound thread. ``ThreadGone`` marks the rotation in ``out`` (the caller then
    starts a fresh thread) unless ``spec.rollout_restored``: then codex lost a file we just wrote and
    verified, which is no proof the thread is gone — the turn fails and the binding is kept."""
    assert spec.thread_id  # the caller checks: only a bound thread is resumed
    try:
        # A plain resume (no overrides) writes nothing to the rollout (docs/codex.md §7);
        # excludeTurns: our transcript is the source of truth (I5), and it is faster.
        resumed = client.request("thread/resume", {"threadId": spec.thread_id, "excludeTurns": True})
    except ThreadGone as exc:
        if spec.rollout_restored:
            reason = (f"codex found no rollout for thread {spec.thread_id} although it was restored from "
                      f"PostgreSQL into this turn's CODEX_HOME ({exc.message}); not rotating — the binding is kept")
            raise TurnRunError(reason, out, exc) from exc
        out.rotated_from, out.rotation_reason = spec.thread_id, exc.message
        return
    except CodexError as exc:
        raise TurnRunError(_describe("thread/resume", exc), out, exc) from exc
    _check_profile(spec, out, "thread/resume", resumed)
    # codex's own spelling of the id from here on: notifications are matched against it.
    out.thread_action, out.thread_id = "resumed", _thread_id(resumed) or spec.thread_id


def _resume_previous(client: AppServerClient, spec: TurnSpec, out: TurnOutcome) -> bool:
    """A re-run after a lost worker that had already started a fresh thread for this turn: that
    thread has a rollout only if codex saw our ``turn/start``, so resume it (and adopt the turn if it
    completed) rather than start a second thread and run the input twice. False: no rollout, the lost
    worker never reached ``turn/start`` — start afresh."""
    assert spec.previous_thread_id  # the caller checks
    try:
        resumed = client.request("thread/resume", {"threadId": spec.previous_thread_id, "excludeTurns": True})
    except ThreadGone:
        return False
    except CodexError as exc:
        raise TurnRunError(_describe("thread/resume", exc), out, exc) from exc
    _check_profile(spec, out, "thread/resume", resumed)
    out.thread_action = "rotated" if out.rotated_from else "started"
    out.thread_id = _thread_id(resumed) or spec.previous_thread_id
    return True


def _request_step(client: AppServerClient, out: TurnOutcome, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """``client.request`` for a step before ``turn/start``: any codex failure becomes ``TurnRunError``."""
    try:
        return client.request(method, params)
    except CodexError as exc:
        raise TurnRunError(_describe(method, exc), out, exc) from exc


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
    page = client.request("thread/turns/list", {"threadId": out.thread_id, "limit": 10, "itemsView": "full"})
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


def _as_dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _scope(params: dict[str, Any]) -> tuple[str | None, str | None]:
    """(threadId, turnId) a notification belongs to, as hermes-agent reads them (``docs/contract.md`` §7)."""
    turn, item = _as_dict(params.get("turn")), _as_dict(params.get("item"))
    thread_id = params.get("threadId") or turn.get("threadId") or item.get("threadId")
    turn_id = params.get("turnId") or turn.get("id") or item.get("turnId")
    return thread_id, turn_id


def _usage(token_usage: dict[str, Any]) -> dict[str, Any]:
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


class _TurnReader:
    """Folds this turn's notifications into ``out`` (items, usage, final status)."""

    def __init__(self, out: TurnOutcome, on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 control: TurnControl | None = None) -> None:
        self.out = out
        self.projector = ItemProjector()
        self.last_error = ""
        self.on_event = on_event
        self.control = control

    def ours(self, params: dict[str, Any]) -> bool:
        """A notification of another thread, or of another turn once ours is known, is skipped."""
        thread_id, turn_id = _scope(params)
        if thread_id and thread_id != self.out.thread_id:
            return False
        return not (turn_id and self.out.codex_turn_id and turn_id != self.out.codex_turn_id)

    def add(self, note: dict[str, Any]) -> bool:
        """Apply one notification; True once it was this turn's ``turn/completed``."""
        method, params = note.get("method"), _as_dict(note.get("params"))
        if not self.ours(params):
            return False
        if method == "item/completed":
            self._completed(_as_dict(params.get("item")))
        elif method == "item/started":
            self._started(_as_dict(params.get("item")))
        elif method == "item/agentMessage/delta":
            if self.on_event is not None and isinstance(params.get("delta"), str):
                self.on_event("delta", {"item_id": str(params.get("itemId") or ""), "text": params["delta"]})
        elif method == "thread/tokenUsage/updated":
            self.out.usage = _usage(_as_dict(params.get("tokenUsage")))
        elif method == "error" and not params.get("willRetry"):
            self.last_error = turn_error_text(params.get("error"))  # names the model call's HTTP status
        elif method == "turn/completed":
            turn = _as_dict(params.get("turn"))
            self.out.status = str(turn.get("status") or "failed")
            if self.out.status != "completed":
                self.out.error = turn_error_text(turn.get("error")) or self.last_error
            return True
        return False

    def _started(self, item: dict[str, Any]) -> None:
        """Keep a fileChange item's ``changes`` for the approval codex may ask about it (``TurnControl.file_changes``)."""
        if self.control is not None and item.get("type") == "fileChange" and isinstance(item.get("changes"), list):
            self.control.file_changes[str(item.get("id") or "")] = item["changes"]

    def _completed(self, item: dict[str, Any]) -> None:
        before = len(self.projector.messages)
        self.projector.add(item)
        rows = self.projector.messages[before:]
        if self.on_event is not None and rows:
            self.on_event("item", {"item_id": str(item.get("id") or rows[0].get("codex_item_id") or ""),
                                   "item_type": str(item.get("type") or ""), "messages": rows})

    def flush(self) -> None:
        self.out.messages = self.projector.messages
        self.out.final_text = self.projector.final_text


def _drive(client: AppServerClient, spec: TurnSpec, out: TurnOutcome) -> None:
    """Read notifications until this turn's ``turn/completed`` or the deadline. Raises
    ``TurnAbandoned`` (claim lost), ``TurnTimeout``, or ``TransportError`` once the connection failed
    and every queued notification was read."""
    reader = _TurnReader(out, spec.on_event, spec.control)
    deadline = time.monotonic() + spec.turn_timeout
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
            # Time a person took to decide does not count against turn_timeout (it has its own
            # bound, HERMES_APPROVAL_TIMEOUT_SECONDS: worker/approvals.py).
            left = deadline + (control.waited_seconds() if control is not None else 0.0) - time.monotonic()
            if left <= 0:
                stopped = _interrupt_after_timeout(client, out, reader.projector)
                raise TurnTimeout(
                    f"turn/completed did not arrive within {spec.turn_timeout:g} s; "
                    + ("the turn was interrupted" if stopped else "turn/interrupt got no answer either; the app-server was stopped")
                )
            wait = min(left, POLL_SECONDS)
            if spec.on_tick is not None:
                due = spec.on_tick()
                wait = min(wait, due) if due is not None else wait
            note = client.next_notification(timeout=max(wait, 0.0))
            if note is not None and reader.add(note):
                mark("codex.turn_completed", spec.client_turn_id)
                return
    finally:
        reader.flush()


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
