"""Running a claimed turn on a fresh ``codex app-server`` process: claim → codex → finalize.

No transaction is open while codex works. A heartbeat thread renews the claim's lease and relays
cancel requests; if the claim is lost (the sweep took the turn back after the lease expired), the
run stops and commits nothing.

Failures before codex saw ``turn/start`` that ``codex.errors.classify`` calls *retry* — the dead
worker's app-server still holding the thread (``thread <id> already has an active writer``), a
transport failure while spawning or resuming — are retried on a new app-server with backoff
(``HERMES_RETRY_DELAYS``); they never rotate the thread. Everything else ends the turn with a reason.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection

from .. import policy
from ..codex.client import AppServerClient
from ..codex.errors import ErrorClass, classify
from ..codex.launch import app_server_argv, app_server_env, codex_home_id, ensure_codex_home
from ..codex.runner import TurnAbandoned, TurnControl, TurnOutcome, TurnRunError, TurnSpec, run_turn
from ..codex.server_requests import make_server_request_handler
from ..history_seed import seeded_input
from ..models import Turn
from .turns import (
    TurnClaim,
    history_seed,
    turn_claim,
    turn_fail,
    turn_finalize,
    turn_heartbeat,
    turn_note_thread,
    turn_requeue,
)

logger = logging.getLogger(__name__)

DB_RETRY_DELAYS = (0.5, 1.0, 2.0)
STDERR_TAIL_LINES = 12  # what goes into a failed turn's error text


def turn_execute(*, turn_id: uuid.UUID | str) -> Turn | None:
    """Run one queued turn end to end. Returns the finished turn, or ``None`` when the turn was not
    this call's to run (not the session's next turn, already running or finished — a duplicate
    delivery changes nothing) or when this worker lost its claim mid-run. Every codex failure ends
    the turn ``failed`` with a readable reason; none escapes."""
    claim = turn_claim(turn_id=turn_id)
    if claim is None:
        return None
    control = TurnControl()
    beat = _Heartbeat(claim, control)
    beat.start()
    try:
        return _run_with_retries(claim, control)
    finally:
        beat.stop()


def _run_with_retries(claim: TurnClaim, control: TurnControl) -> Turn | None:
    delays = list(settings.HERMES_RETRY_DELAYS)
    while True:
        try:
            outcome = _run_once(claim, control)
        except TurnRunError as exc:
            if isinstance(exc.cause, TurnAbandoned):
                logger.warning("turn %s: claim lost mid-run; committing nothing", claim.turn_id)
                return None
            if exc.before_turn_start and control.interrupt.is_set():
                # Cancelled while codex was not yet running it: end cancelled, not failed.
                exc.outcome.status, exc.outcome.error = "interrupted", f"cancelled before codex ran it ({exc})"
                return _commit(turn_finalize, turn_id=claim.turn_id, token=claim.token, result=exc.outcome)
            if exc.error_class is ErrorClass.RETRY and exc.before_turn_start and delays and not control.stopping():
                delay = delays.pop(0)
                logger.info("turn %s: %s — retrying in %.1f s", claim.turn_id, exc, delay)
                control.interrupt.wait(delay)  # a cancel cuts the backoff short
                continue
            if exc.error_class is ErrorClass.RETRY and exc.before_turn_start and not control.stopping():
                # Still busy after every retry (e.g. a hung worker's app-server holds the thread):
                # back to the queue, within the attempt budget, rather than fail a live conversation.
                return _commit(turn_requeue, turn_id=claim.turn_id, token=claim.token, reason=str(exc))
            return _commit(turn_fail, turn_id=claim.turn_id, token=claim.token, reason=str(exc), result=exc.outcome)
        except SoftTimeLimitExceeded:
            # Celery's soft limit (a backstop behind CODEX_TURN_TIMEOUT): the app-server is already
            # closed (``_run_once``'s finally), so codex has stopped; end the turn with the reason.
            return _commit(turn_fail, turn_id=claim.turn_id, token=claim.token,
                           reason="the turn exceeded the worker's time limit; codex was stopped — the binding is kept")
        except _StartupError as exc:
            if exc.retryable and delays and not control.stopping():
                delay = delays.pop(0)
                logger.info("turn %s: %s — retrying in %.1f s", claim.turn_id, exc, delay)
                control.interrupt.wait(delay)
                continue
            return _commit(turn_fail, turn_id=claim.turn_id, token=claim.token, reason=str(exc))
        return _commit(turn_finalize, turn_id=claim.turn_id, token=claim.token, result=outcome)


def _commit(write, **kwargs):
    """Run a finalize write, retrying a lost database connection a few times: codex's work is done
    and must not wait for the sweep (which would still recover it, by adopting the codex turn)."""
    for delay in (*DB_RETRY_DELAYS, None):
        try:
            return write(**kwargs)
        except (OperationalError, InterfaceError):
            if delay is None:
                raise
            logger.warning("database connection lost while committing a turn; retrying in %.1f s", delay, exc_info=True)
            time.sleep(delay)
            close_old_connections()
            connection.close()
    raise AssertionError("unreachable")


class _StartupError(Exception):
    """The app-server could not be started or initialized (binary missing, process died, …)."""

    def __init__(self, reason: str, *, retryable: bool):
        super().__init__(reason)
        self.retryable = retryable


def _run_once(claim: TurnClaim, control: TurnControl) -> TurnOutcome:
    config = claim.config
    t0 = time.monotonic()
    try:
        ensure_codex_home()
        workdir = policy.session_workdir(claim.session_id)
        workdir.mkdir(parents=True, exist_ok=True)
        client = AppServerClient(
            app_server_argv(),
            env=app_server_env(),
            cwd=str(workdir),
            request_timeout=settings.CODEX_REQUEST_TIMEOUT,
            max_frame_bytes=settings.CODEX_MAX_FRAME_BYTES,
            stderr_tail_lines=STDERR_TAIL_LINES,
            server_request_handler=make_server_request_handler(approval_policy=config["approval_policy"]),
        )
        client.start()
    except Exception as exc:  # noqa: BLE001 — any start-up trouble fails (or retries) the turn, not the worker
        logger.warning("turn %s: codex app-server did not start: %s", claim.turn_id, exc)
        raise _StartupError(
            f"codex app-server could not be started: {exc}", retryable=classify(exc) is ErrorClass.RETRY
        ) from exc
    initialize_ms = round((time.monotonic() - t0) * 1000, 1)
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
        client_turn_id=str(claim.turn_id),
        adopt_completed=claim.attempt > 1,
        control=control,
        thread_elsewhere=claim.thread_home if claim.thread_home and claim.thread_home != codex_home_id() else "",
        previous_thread_id=claim.previous_thread_id,
        on_thread_started=lambda thread_id: turn_note_thread(turn_id=claim.turn_id, token=claim.token, thread_id=thread_id),
    )
    try:
        outcome = run_turn(client, spec)
    except TurnRunError as exc:
        exc.outcome.timings["initialize_ms"] = initialize_ms
        raise
    except SoftTimeLimitExceeded:
        if control.running:  # Celery's soft limit: ask codex to stop the turn before the app-server goes
            thread_id, turn_id = control.running
            try:
                client.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id}, timeout=2.0)
            except Exception:  # noqa: BLE001 — best effort; closing the app-server stops it anyway
                logger.info("turn %s: turn/interrupt at the soft time limit got no answer", claim.turn_id)
        raise
    finally:
        # Close before committing: the thread's writer lock must be free before the next turn of
        # this session can be dispatched (codex allows one writer per thread).
        client.close()
    outcome.timings["initialize_ms"] = initialize_ms
    outcome.timings["codex_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return outcome


class _Heartbeat:
    """Renews the lease every ``HERMES_HEARTBEAT_SECONDS`` on its own database connection; sets
    ``control.interrupt`` on a cancel request and ``control.abandon`` when the claim is gone."""

    def __init__(self, claim: TurnClaim, control: TurnControl):
        self.claim, self.control = claim, control
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"turn-heartbeat-{claim.turn_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.wait(settings.HERMES_HEARTBEAT_SECONDS):
                try:
                    close_old_connections()
                    beat = turn_heartbeat(turn_id=self.claim.turn_id, token=self.claim.token)
                except Exception:  # noqa: BLE001 — a database blip must not kill the turn; the lease has slack
                    logger.exception("turn %s: heartbeat failed", self.claim.turn_id)
                    continue
                if not beat.held:
                    self.control.abandon.set()
                    return
                if beat.cancel_requested:
                    self.control.interrupt.set()
        finally:
            connection.close()

