"""Running a claimed turn on a fresh ``codex app-server`` process: claim → codex → finalize.

No transaction is open while codex works. A heartbeat thread renews the claim's lease and relays
cancel requests; if the claim is lost (the sweep took the turn back after the lease expired), the
run stops and commits nothing.

Retries follow the one ``RetryPolicy`` (``retry_policy.py``; its docstring has the worst case). A
failure before codex can have run the input whose type ``codex.errors.retryable`` accepts —
``ThreadBusy`` (the dead worker's app-server still holds the thread), ``Overloaded``, a
``TransportError`` while spawning or resuming — is retried on a new app-server after the policy's
next delay; once the claim's budget is spent the turn goes back to the queue (at most
``max_claims`` claims). These never rotate the thread. An app-server that cannot start is retried the
same way and then fails. Everything else ends the turn with a reason.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
)

from .. import policy
from ..codex.client import AppServerClient
from ..codex.errors import TransportError, retryable
from ..codex.launch import (
    app_server_argv,
    app_server_env,
    permission_profile,
    prepare_session_home,
    session_home,
    write_home_config,
)
from ..codex.rollout_files import RolloutBase, RolloutDiverged, read_delta, read_leftover, write_leftover
from ..codex.runner import TurnAbandoned, TurnControl, TurnOutcome, TurnRunError, TurnSpec, drive_turn
from ..codex.sandbox_check import SandboxUnavailable, check_sandbox
from ..codex.server_requests import make_server_request_handler
from ..codex.warm import Spare, spare_pool
from ..history_seed import seeded_input
from ..models import Turn
from .events import RETRYING, TurnEventWriter
from .retry_policy import RetryPolicy, retry_policy
from .rollouts import RolloutFenced, rollout_restore
from .turn_log import delivery
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

STDERR_TAIL_LINES = 12  # what goes into a failed turn's error text
T = TypeVar("T")


def turn_execute(*, turn_id: uuid.UUID | str, task_id: str | None = None) -> Turn | None:
    """Run one queued turn end to end. Returns the finished turn, or ``None`` when the turn was not
    this call's to run (not the session's next turn, already running or finished — a duplicate
    delivery changes nothing), when it went back to the queue, or when this worker lost its claim
    mid-run. Every codex failure ends the turn ``failed`` (or requeued) with a readable reason;
    none escapes. ``task_id``: the Celery task delivering it, named in the turn's end line
    (``turn_log.py``)."""
    with delivery(task_id):
        claim = turn_claim(turn_id=turn_id)
        if claim is None:
            return None
        control = TurnControl()
        stream = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                                 attempt=claim.attempt)
        beat = _Heartbeat(claim, control)
        beat.start()
        try:
            return _run_with_retries(claim, control, retry_policy(), stream)
        finally:
            beat.stop()


def _run_with_retries(claim: TurnClaim, control: TurnControl, budget: RetryPolicy,
                      stream: TurnEventWriter) -> Turn | None:
    started = time.monotonic()
    retries = 0
    while True:
        try:
            outcome = _run_once(claim, control, stream)
        except TurnRunError as exc:
            if not _backoff(claim, control, budget, exc, retries=retries, started=started, stream=stream):
                return _after_run_error(claim, control, budget, exc)
        except _StartupError as exc:
            if not _backoff(claim, control, budget, exc, retries=retries, started=started, stream=stream):
                return _commit(budget, turn_fail, turn_id=claim.turn_id, token=claim.token, reason=str(exc))
        except SoftTimeLimitExceeded:
            # Celery's soft limit (a backstop behind CODEX_TURN_TIMEOUT): the app-server is already
            # closed (``_run_once``'s finally), so codex has stopped; end the turn with the reason.
            return _commit(budget, turn_fail, turn_id=claim.turn_id, token=claim.token,
                           reason="the turn exceeded the worker's time limit; codex was stopped — the binding is kept")
        else:
            return _commit(budget, turn_finalize, turn_id=claim.turn_id, token=claim.token, result=outcome)
        retries += 1


def _may_retry(exc: TurnRunError | _StartupError) -> bool:
    """Retrying is safe and useful: codex cannot have run the input, and the cause is transient (for a
    start-up error also a lost database connection while restoring the rollout: a blip of a few
    seconds is retried by the policy, not a failed turn — found by ``make faults``' db-down-during-restore)."""
    if isinstance(exc, TurnRunError):
        return exc.before_turn_start and retryable(exc.cause)
    return retryable(exc.cause) or isinstance(exc.cause, (OperationalError, InterfaceError))


def _backoff(claim: TurnClaim, control: TurnControl, budget: RetryPolicy, exc: TurnRunError | _StartupError,
             *, retries: int, started: float, stream: TurnEventWriter) -> bool:
    """Wait the policy's next delay and return True when ``exc`` is to be retried in this claim."""
    if control.stopping() or not _may_retry(exc):
        return False
    delay = budget.next_delay(retries=retries, elapsed=time.monotonic() - started)
    if delay is None:
        return False
    logger.info("turn %s: %s — retrying in %.1f s", claim.turn_id, exc, delay)
    stream.add(RETRYING, {"reason": str(exc), "delay_seconds": delay, "retry": retries + 1, "requeued": False})
    _wait(control, delay)  # a cancel or a lost claim cuts the backoff short
    return True


def _wait(control: TurnControl, delay: float) -> None:
    """Sleep ``delay`` seconds, or less once ``control`` is stopping (the heartbeat set a signal)."""
    end = time.monotonic() + delay
    while not control.stopping():
        left = end - time.monotonic()
        if left <= 0:
            return
        control.interrupt.wait(min(left, 0.1))


def _after_run_error(claim: TurnClaim, control: TurnControl, budget: RetryPolicy, exc: TurnRunError) -> Turn | None:
    """End a run the policy does not (or no longer) retry: nothing (claim lost), cancelled, back to
    the queue (a retryable cause with the claim's budget spent), or failed."""
    ids = {"turn_id": claim.turn_id, "token": claim.token}
    if isinstance(exc.cause, TurnAbandoned):
        logger.warning("turn %s: claim lost mid-run; committing nothing", claim.turn_id)
        return None
    if exc.before_turn_start and control.interrupt.is_set():
        # Cancelled while codex was not yet running it: end cancelled, not failed.
        exc.outcome.status, exc.outcome.error = "interrupted", f"cancelled before codex ran it ({exc})"
        return _commit(budget, turn_finalize, **ids, result=exc.outcome)
    if _may_retry(exc) and not control.stopping():
        # Still failing after this claim's retries (e.g. a hung worker's app-server holds the thread):
        # back to the queue, within max_claims, rather than fail a live conversation.
        return _commit(budget, turn_requeue, **ids, reason=str(exc))
    return _commit(budget, turn_fail, **ids, reason=str(exc), result=exc.outcome)


def _commit(budget: RetryPolicy, write: Callable[..., T], **kwargs: object) -> T | Turn | None:
    """Run a worker's commit (finalize, fail, requeue), retrying a lost database connection by the
    policy: codex's work is done and must not wait for the sweep (which would still recover it, by
    adopting the codex turn). Raises the database error once the policy gives up.

    When the database refuses what codex produced (``IntegrityError``, ``DataError``: a constraint, a
    value PostgreSQL cannot store), the turn ends failed with that reason and without the refused rows
    (what codex proved — a rotation — still commits): left running, it would only fail the same way
    on every re-run until the attempts ran out, under the wrong reason."""
    started = time.monotonic()
    retries = 0
    while True:
        try:
            return write(**kwargs)
        except (IntegrityError, DataError) as exc:
            outcome = kwargs.get("result")
            if write is turn_fail and (not isinstance(outcome, TurnOutcome) or not outcome.messages):
                raise  # nothing left to leave out
            logger.exception("turn %s: the database refused the turn's results", kwargs.get("turn_id"))
            bare = replace(outcome, messages=[], final_text="") if isinstance(outcome, TurnOutcome) else None
            return _commit(budget, turn_fail, turn_id=kwargs["turn_id"], token=kwargs["token"], result=bare,
                           reason=f"the database refused this turn's results ({type(exc).__name__}: {exc}); "
                                  "none of its items was stored")
        except (OperationalError, InterfaceError):
            delay = budget.next_delay(retries=retries, elapsed=time.monotonic() - started)
            if delay is None:
                raise
            logger.warning("database connection lost while committing a turn; retrying in %.1f s", delay, exc_info=True)
            time.sleep(delay)
            close_old_connections()
            connection.close()
            retries += 1


class _StartupError(Exception):
    """The app-server could not be started or initialized (binary missing, process died, …);
    ``cause`` is the error ``AppServerClient.start`` raised."""

    def __init__(self, reason: str, *, cause: BaseException) -> None:
        super().__init__(reason)
        self.cause = cause


def _confirm_claim(claim: TurnClaim, control: TurnControl) -> None:
    """Renew the claim's lease just before the session's home is wiped, or raise ``TurnRunError``
    (``TurnAbandoned``) when this worker no longer holds the turn. The home is shared by every run of
    the session on this host: a worker whose claim the sweep took back while its database was down
    (``make faults``' db-down-during-restore: the outage outlasts the lease) must not wipe the home under
    the codex of the worker that now runs the session (docs/contract.md §2 "home", I3) — it found, on
    retrying its restore, a rollout gone after the turn or codex's ``invalid paginated history lineage
    … missing source rollout``. Renewed now, no other worker can claim the turn (nor run the session's
    next one) before the lease expires, and the heartbeat keeps renewing it from here."""
    beat = turn_heartbeat(turn_id=claim.turn_id, token=claim.token)
    if not beat.held:
        control.abandon.set()
        reason = "the claim was taken back before the session's CODEX_HOME was prepared; the home is left alone"
        raise TurnRunError(reason, TurnOutcome(), TurnAbandoned(reason))


def _restore(claim: TurnClaim, control: TurnControl | None = None,
             spare: Spare | None = None) -> tuple[Path, RolloutBase | None]:
    """Confirm the claim (``_confirm_claim``), then wipe and recreate the session's ``CODEX_HOME`` and
    restore the bound thread's rollout from PostgreSQL into it (``services/rollouts.py``). A generation
    that moved on since the claim means another writer has the thread: this run commits nothing (as a
    lost claim). Stored bytes that do not verify fail the turn. With ``spare`` (first attempts only):
    the session's config and rollout go into the spare's already running home instead
    (``codex/warm.py``)."""
    try:
        _confirm_claim(claim, control or TurnControl())
        if spare is not None:
            workdir = policy.session_workdir(claim.session_id)
            write_home_config(spare.home.home, sandbox=claim.config["sandbox"], workdir=workdir)
            base = rollout_restore(session_id=claim.session_id, thread_id=claim.thread_id,
                                   generation=claim.rollout_generation, home=spare.home.home)
            return spare.home.home, base
        # A re-run after a lost worker on this host: that worker's rollout of this turn's thread may hold
        # the turn codex completed (to adopt, not run twice); kept only if it extends what PostgreSQL has.
        old = session_home(claim.session_id).home
        leftovers = [read_leftover(old, t) for t in (claim.thread_id, claim.previous_thread_id)] if claim.attempt > 1 else []
        paths = prepare_session_home(claim.session_id, sandbox=claim.config["sandbox"],
                                     workdir=policy.session_workdir(claim.session_id))
        base = rollout_restore(session_id=claim.session_id, thread_id=claim.thread_id,
                               generation=claim.rollout_generation, home=paths.home)
        for leftover in filter(None, leftovers):
            bound = leftover.thread_id == claim.thread_id
            # The bound thread: only an extension of the stored rollout (none stored: nothing to extend);
            # the lost worker's unbound fresh thread: PostgreSQL never had it.
            if not bound or (base is not None and leftover.extends(base)):
                write_leftover(paths.home, leftover)
    except RolloutFenced as exc:
        raise TurnRunError(str(exc), TurnOutcome(), TurnAbandoned(str(exc))) from exc
    except RolloutDiverged as exc:
        raise TurnRunError(f"{exc} — the binding is kept", TurnOutcome(), exc) from exc
    except (OSError, DatabaseError) as exc:  # a full disk, a lost database connection: fail (or retry) the turn
        if isinstance(exc, (OperationalError, InterfaceError)):
            connection.close()  # the next try opens a fresh connection instead of reusing the broken one
        raise _StartupError(f"the session's CODEX_HOME could not be prepared: {exc}", cause=exc) from exc
    return paths.home, base


def _codex_version(init: object) -> str:
    """``"0.171.0"`` from initialize's ``userAgent`` (``"<client>/<version> (…)"``, ``docs/codex.md`` §2)."""
    agent = str(init.get("userAgent") or "") if isinstance(init, dict) else ""
    return agent.split("/", 1)[-1].split(" ", 1)[0] if "/" in agent else ""


def _run_once(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter | None = None) -> TurnOutcome:
    """One try: fresh home + restore, spawn, drive the turn, close (codex exits: the rollout file is
    complete), then read what codex appended to the rollout (checked against the stored prefix).
    ``stream`` receives what codex streams (a writer of the claim's own when not given)."""
    if stream is None:
        stream = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                                 attempt=claim.attempt)
    try:
        check_sandbox()  # cached per process; never run commands on a host whose sandbox fails
    except SandboxUnavailable as exc:
        raise _StartupError(str(exc), cause=exc) from exc
    t0 = time.monotonic()
    spare = _take_spare(claim)
    try:
        return _run_on(claim, control, stream, spare, t0)
    finally:
        if spare is not None:
            spare.discard()  # one turn per spare: its home and process go (after the rollout was read)


def _take_spare(claim: TurnClaim) -> Spare | None:
    """A ready spare app-server (``HERMES_WARM_POOL`` > 0), for a claim's first attempt only: a re-run
    after a lost worker looks for that worker's rollout in the session's own home (``_restore``)."""
    pool = spare_pool() if claim.attempt == 1 else None
    return pool.take() if pool is not None else None


def _run_on(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter, spare: Spare | None,
            t0: float) -> TurnOutcome:
    config = claim.config
    home, base = _restore(claim, control, spare)
    restore_ms = round((time.monotonic() - t0) * 1000, 1)
    try:
        workdir = policy.session_workdir(claim.session_id)
        workdir.mkdir(parents=True, exist_ok=True)
        if spare is not None:
            spare.handler = make_server_request_handler(approval_policy=config["approval_policy"])
            client, version = spare.client, _codex_version(spare.init)
            if not client.alive():
                raise _StartupError("the spare codex app-server died before the turn", cause=TransportError("spare gone"))
        else:
            client, version = _spawn(claim, workdir)
    except _StartupError:
        raise
    except Exception as exc:  # noqa: BLE001 — any start-up trouble fails (or retries) the turn, not the worker
        logger.warning("turn %s: codex app-server did not start: %s", claim.turn_id, exc)
        raise _StartupError(f"codex app-server could not be started: {exc}", cause=exc) from exc
    initialize_ms = round((time.monotonic() - t0) * 1000, 1) - restore_ms
    return _drive(claim, control, stream, client, version, workdir, home, base, t0,
                  restore_ms=restore_ms, initialize_ms=initialize_ms, spare=spare is not None)


def _spawn(claim: TurnClaim, workdir: Path) -> tuple[AppServerClient, str]:
    """A fresh app-server for the claim's session, started and initialized; and codex's version."""
    config = claim.config
    client = AppServerClient(
        app_server_argv(sandbox=config["sandbox"], workdir=workdir),
        env=app_server_env(session_home(claim.session_id)),
        cwd=str(workdir),
        request_timeout=settings.CODEX_REQUEST_TIMEOUT,
        max_frame_bytes=settings.CODEX_MAX_FRAME_BYTES,
        stderr_tail_lines=STDERR_TAIL_LINES,
        server_request_handler=make_server_request_handler(approval_policy=config["approval_policy"]),
    )
    return client, _codex_version(client.start())


def _drive(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter, client: AppServerClient, version: str,
           workdir: Path, home: Path, base: RolloutBase | None, t0: float, *, restore_ms: float,
           initialize_ms: float, spare: bool) -> TurnOutcome:
    """Drive the claim's turn on ``client`` (started), close it, and read what codex appended."""
    config = claim.config
    spec = TurnSpec(
        text=claim.input_text,
        thread_id=claim.thread_id,
        cwd=str(workdir),
        sandbox=config["sandbox"],
        permission_profile=permission_profile(config["sandbox"]),
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
        rollout_restored=base is not None,
        previous_thread_id=claim.previous_thread_id,
        on_thread_started=lambda thread_id: turn_note_thread(turn_id=claim.turn_id, token=claim.token, thread_id=thread_id),
        on_event=stream.add,
    )
    try:
        outcome = drive_turn(client, spec)
    except TurnRunError as exc:
        exc.outcome.timings.update(initialize_ms=initialize_ms, restore_ms=restore_ms)
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
        # Close before reading the rollout and committing: codex has exited, so the file is complete
        # and the thread's writer lock is free (docs/codex.md §1, §7).
        client.close()
        stream.flush()  # the streamed deltas and items commit before the turn's last events
    outcome.timings.update(initialize_ms=initialize_ms, restore_ms=restore_ms)
    if spare:
        outcome.timings["spare"] = 1  # the app-server came from the warm pool (initialize_ms: ~0)
    t1 = time.monotonic()
    _capture_rollout(outcome, home, base, version)
    outcome.timings["capture_ms"] = round((time.monotonic() - t1) * 1000, 1)  # read + check the appended bytes
    outcome.timings["codex_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return outcome


def _capture_rollout(outcome: TurnOutcome, home: Path, base: RolloutBase | None, version: str) -> None:
    """Fill ``outcome.rollout`` with what codex appended to the thread's rollout. A file that no longer
    starts with the stored bytes fails the turn (fail closed: a diverged copy is never stored)."""
    if not outcome.thread_id:
        return
    extends = base if base is not None and base.thread_id == outcome.thread_id else None
    try:
        outcome.rollout = read_delta(home, outcome.thread_id, extends)
    except RolloutDiverged as exc:
        raise TurnRunError(f"{exc} — the binding is kept", outcome, exc, before_turn_start=False) from exc
    outcome.codex_version = version


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

