"""Running a claimed turn on a fresh ``codex app-server`` process: claim → codex → finalize.

No transaction is open while codex works. A heartbeat job (``heartbeats.py``) renews the claim's lease and relays
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

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
from ..codex.client import AppServerClient, PendingRequest
from ..codex.errors import CodexStateDamaged, TransportError, retryable
from ..codex.launch import (
    app_server_argv,
    app_server_env,
    permission_profile,
    prepare_session_home,
    session_home,
    write_home_config,
)
from ..codex.rollout_files import (
    RolloutBase,
    RolloutDiverged,
    drop_codex_state,
    file_identity,
    held_rollout,
    read_delta,
    read_leftover,
    write_leftover,
)
from ..codex.runner import TurnAbandoned, TurnControl, TurnOutcome, TurnRunError, TurnSpec, drive_turn
from ..codex.sandbox_check import SandboxUnavailable, check_sandbox
from ..codex.server_requests import make_server_request_handler
from ..history_seed import seeded_input
from ..latency_marks import mark
from ..metrics.process import phase_observed, turn_retried
from ..models import Turn
from ..services import routing
from ..services.dispatch import turn_undispatched
from ..services.events import RETRYING, TurnEventWriter
from ..services.rollouts import RolloutFenced, rollout_restore
from ..services.turn_log import delivery
from ..services.turns import (
    TurnClaim,
    history_seed,
    turn_claim,
    turn_fail,
    turn_finalize,
    turn_heartbeat,
    turn_note_thread,
    turn_requeue,
)
from . import affinity, approvals, wake
from .heartbeats import process_heartbeats
from .retry_policy import RetryPolicy, retry_policy
from .runners import Parked, TurnRun, runner_pool, session_runs
from .time_limits import TIME_LIMIT_REASON, TimeLimits, thread_time_limits, turn_time_limits
from .warm.early_start import EarlyStart, early_start
from .warm.kept import Keeper, KeptThread, keeper_if_made, keeper_make, rollout_stamp
from .warm.spares import Spare, die_with_parent, spare_pool

logger = logging.getLogger(__name__)

STDERR_TAIL_LINES = 12  # what goes into a failed turn's error text
T = TypeVar("T")
WOKEN_TASK_ID = "wake"  # the end line's task= of a turn run on its wake-up (turn_log.py)


def turn_execute(*, turn_id: uuid.UUID | str, task_id: str | None = None, woken: bool = False,
                 session_id: str = "", hint: routing.WakeHint | None = None,
                 limits: TimeLimits | None = None, parking: TurnRun | None = None) -> Turn | None:
    """Run one queued turn end to end. Returns the finished turn, or ``None`` when the turn was not
    this call's to run (not the session's next turn, already running or finished — a duplicate
    delivery changes nothing), when it went back to the queue, or when this worker lost its claim
    mid-run. Every codex failure ends the turn ``failed`` (or requeued) with a readable reason;
    none escapes. ``task_id``: the Celery task delivering it, named in the turn's end line
    (``turn_log.py``). ``woken``: run by the wake listener (``wake``), recorded as ``timings["woken"]``;
    with the wake's ``session_id`` and ``hint`` (``routing.WakeHint``), ``turn/start`` may go to the kept
    thread while the turn is claimed (``early_start.py``; recorded as ``timings["early_start"]``).
    ``limits``: the time limits of a turn run outside a Celery task (``time_limits.thread_time_limits``),
    which watch its control. ``parking``: the runner's handle of this turn (``runners.py``), which the
    approval desk parks once a request waits for a person (``_Handover.park``).

    A run of the same session still executing in this process (``runners.SessionRuns``: its finalize
    committed, its app-server not yet kept) is waited for — at most ``HERMES_AFFINITY_DEADLINE`` — before
    the kept thread is looked for: by a woken turn before its early start (a wait longer than
    ``wake.QUEUED_BEHIND_SECONDS`` costs the hint), by every turn once claimed."""
    runs = session_runs()
    deadline = float(settings.HERMES_AFFINITY_DEADLINE)
    with delivery(task_id):
        t0 = time.monotonic()
        early = None
        if session_id and runs.wait_idle(session_id, timeout=deadline) > wake.QUEUED_BEHIND_SECONDS:
            hint = None  # it waited for the session's last run here: not fresh (early_start.py)
        if hint is not None and session_id:
            early = early_start(turn_id=uuid.UUID(str(turn_id)), session_id=session_id, hint=hint)
        claim, early = _claim_with(turn_id, early)
        if claim is None:
            return None
        claim.timings["claim_ms"] = _ms_since(t0)
        if early is None:  # the session's last run here committed, and may not have kept its app-server yet
            runs.wait_idle(claim.session_id, timeout=deadline)
        if woken:
            claim.timings["woken"] = 1
        if early is not None:
            claim.timings["early_start"] = 1
            if early.paused:
                claim.timings["early_start_paused"] = 1  # the claim was late: codex waited for it
        try:
            control = TurnControl()
            if limits is not None:
                limits.watch(control)
            stream = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                                     attempt=claim.attempt)
            with runs.running(claim.session_id), process_heartbeats().beating(claim, control):
                return _run_with_retries(claim, control, retry_policy(), stream, early, parking)
        finally:
            if early is not None:
                early.abort_unless_taken()  # the run never reached its copy (e.g. a failure before it)


def _claim_with(turn_id: uuid.UUID | str, early: EarlyStart | None) -> tuple[TurnClaim | None, EarlyStart | None]:
    """``turn_claim``, then ``early``'s confirmation: the claim, and ``early`` if it stands (``None`` once
    aborted: no claim, a mismatch, or the claim raised — re-raised)."""
    try:
        mark("claim.start", turn_id)
        claim = turn_claim(turn_id=turn_id)
        mark("claim.end", turn_id)
    except BaseException:
        if early is not None:
            early.abort("the claim failed")
        raise
    if early is not None:
        why = early.confirm(claim)
        if why:
            early.abort(why)
            early = None
    return claim, early


def _run_with_retries(claim: TurnClaim, control: TurnControl, budget: RetryPolicy,
                      stream: TurnEventWriter, early: EarlyStart | None = None,
                      parking: TurnRun | None = None) -> Turn | None:
    handover = _Handover(parking=parking)
    try:
        return _run_with_retries_on(claim, control, budget, stream, handover, early)
    finally:
        handover.close()  # an app-server the keeper did not take is closed, whatever happened


def _run_with_retries_on(claim: TurnClaim, control: TurnControl, budget: RetryPolicy,
                         stream: TurnEventWriter, handover: _Handover, early: EarlyStart | None = None) -> Turn | None:
    started = time.monotonic()
    retries = 0
    while True:
        try:
            # An early turn/start belongs to the first try only: a retry runs cold (its copy is closed by then).
            if retries:
                claim.timings.pop("early_start", None)
                claim.timings.pop("early_start_paused", None)
            outcome = _run_once(claim, control, stream, handover, early=early if retries == 0 else None)
        except (TurnRunError, _StartupError) as exc:
            ids = {"turn_id": claim.turn_id, "token": claim.token}
            if control.time_limit:  # a woken turn's soft limit ended its codex (time_limits.py): no retry
                return _commit(budget, turn_fail, **ids, reason=control.time_limit, result=getattr(exc, "outcome", None))
            if not _backoff(claim, control, budget, exc, retries=retries, started=started, stream=stream):
                if isinstance(exc, TurnRunError):
                    return _after_run_error(claim, control, budget, exc)
                return _commit(budget, turn_fail, **ids, reason=str(exc))
        except SoftTimeLimitExceeded:
            # Celery's soft limit (a backstop behind CODEX_TURN_TIMEOUT): the app-server is already
            # closed (``_run_once``'s finally), so codex has stopped; end the turn with the reason.
            return _commit(budget, turn_fail, turn_id=claim.turn_id, token=claim.token, reason=TIME_LIMIT_REASON)
        else:
            mark("finalize.start", claim.turn_id)
            finalize_started = time.monotonic()
            turn = _commit(budget, turn_finalize, turn_id=claim.turn_id, token=claim.token, result=outcome,
                           warm_queue=handover.queue())
            mark("finalize.end", claim.turn_id)
            if turn is not None:
                phase_observed("finalize", time.monotonic() - finalize_started)
            handover.settle(claim, outcome, turn)
            return turn
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
    if isinstance(exc.cause, CodexStateDamaged):
        # Codex's projection of the rollout is a cache it rebuilds from the file: gone, the retry's codex
        # projects the rollout afresh (``tests/e2e/test_real_codex_faults.py``).
        drop_codex_state(session_home(claim.session_id).home)
    logger.info("turn %s: %s — retrying in %.1f s", claim.turn_id, exc, delay)
    stream.add(RETRYING, {"reason": str(exc), "delay_seconds": delay, "retry": retries + 1, "requeued": False})
    turn_retried("same_claim")
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
        requeued = _commit(budget, turn_requeue, **ids, reason=str(exc))
        if isinstance(requeued, Turn) and requeued.status == Turn.Status.QUEUED:  # not failed past the attempts
            turn_retried("requeued")
        return requeued
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
            bare = (replace(outcome, messages=[], final_text="", stream_tail=[])
                    if isinstance(outcome, TurnOutcome) else None)
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
    (``worker/warm/spares.py``)."""
    try:
        _confirm_claim(claim, control or TurnControl())
        if spare is not None:
            workdir = policy.session_workdir(claim.session_id)
            write_home_config(spare.home.home, sandbox=claim.config["sandbox"], workdir=workdir)
            base = rollout_restore(session_id=claim.session_id, thread_id=claim.thread_id,
                                   generation=claim.rollout_generation, home=spare.home.home)
            return spare.home.home, base
        # A re-run after a lost worker on this host: that worker's rollout of this turn's thread may hold
        # the turn codex completed or acted on (to adopt, not run twice); kept only if it extends what
        # PostgreSQL has and shows that work (``Leftover.shows_work``): a turn cut off while it only talked
        # runs again on the stored rollout, its input sent once.
        old = session_home(claim.session_id).home
        leftovers = [read_leftover(old, t) for t in (claim.thread_id, claim.previous_thread_id)] if claim.attempt > 1 else []
        # The thread's rollout this process left here, unchanged since: kept, so the restore appends only
        # the chunks it lacks (``rollout_files.held_prefix``; anything else is wiped and restored in full).
        # Only while PostgreSQL stores the thread's rollout: a host's copy of one it no longer has is not a
        # cache of anything (I8; tests/services/test_webhooks.py's rotation, tests/support/rotation.py).
        held = held_rollout(old, claim.thread_id) if claim.rollout_generation is not None else None
        held_file = file_identity(held)
        paths = prepare_session_home(claim.session_id, sandbox=claim.config["sandbox"],
                                     workdir=policy.session_workdir(claim.session_id), keep=held)
        base = rollout_restore(session_id=claim.session_id, thread_id=claim.thread_id,
                               generation=claim.rollout_generation, home=paths.home)
        rewritten = False
        for leftover in filter(None, leftovers):
            bound = leftover.thread_id == claim.thread_id
            # The bound thread: only an extension of the stored rollout (none stored: nothing to extend);
            # the lost worker's unbound fresh thread: PostgreSQL never had it.
            if not bound or (base is not None and leftover.extends(base) and leftover.shows_work(base)):
                write_leftover(paths.home, leftover)
                rewritten = True
        # Codex's projection of the held rollout stays only while the restore extended that very file in
        # place (same inode: appended, or nothing to append): a full restore renames a new file over it,
        # a forgotten rollout removes it, a leftover rewrites it
        # (tests/services/test_codex_state_kept.py).
        if held is not None and (rewritten or base is None or (paths.home / base.relpath).resolve() != held.resolve()
                                 or file_identity(held) != held_file):
            drop_codex_state(paths.home)
    except RolloutFenced as exc:
        raise TurnRunError(str(exc), TurnOutcome(), TurnAbandoned(str(exc))) from exc
    except RolloutDiverged as exc:
        raise TurnRunError(f"{exc} — the binding is kept", TurnOutcome(), exc) from exc
    except (OSError, DatabaseError) as exc:  # a full disk, a lost database connection: fail (or retry) the turn
        if isinstance(exc, (OperationalError, InterfaceError)):
            connection.close()  # the next try opens a fresh connection instead of reusing the broken one
        raise _StartupError(f"the session's CODEX_HOME could not be prepared: {exc}", cause=exc) from exc
    return paths.home, base


def _ms_since(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 1)


def _codex_version(init: object) -> str:
    """``"0.171.0"`` from initialize's ``userAgent`` (``"<client>/<version> (…)"``, ``docs/codex.md`` §2)."""
    agent = str(init.get("userAgent") or "") if isinstance(init, dict) else ""
    return agent.split("/", 1)[-1].split(" ", 1)[0] if "/" in agent else ""


def _run_once(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter | None = None,
              handover: _Handover | None = None, *, early: EarlyStart | None = None) -> TurnOutcome:
    """One try: on this process's loaded copy of the thread when it is usable (``worker/warm/kept.py``), else
    fresh home + restore, spawn (or a spare), drive the turn; then read what codex appended to the
    rollout (checked against the stored prefix) and close the app-server — or, when ``handover`` may keep
    it (session affinity), leave it running in ``handover``. ``stream`` receives what codex streams (a
    writer of the claim's own when not given). ``early``: a confirmed early ``turn/start``
    (``early_start.py``) — its copy runs the turn, its answer is read instead of sending one."""
    if stream is None:
        stream = TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token,
                                 attempt=claim.attempt)
    handover = handover if handover is not None else _Handover(may_keep=False)
    try:
        check_sandbox()  # cached per process; never run commands on a host whose sandbox fails
    except SandboxUnavailable as exc:
        raise _StartupError(str(exc), cause=exc) from exc
    t0 = time.monotonic()
    kept = early.take() if early is not None else _take_kept(claim)
    claim.timings["take_kept_ms"] = _ms_since(t0)
    if kept is not None:
        try:
            workdir = policy.session_workdir(claim.session_id)
            workdir.mkdir(parents=True, exist_ok=True)
            return _drive(claim, control, stream, kept.client, kept.version, workdir, kept.home, kept.base, t0,
                          restore_ms=0.0, initialize_ms=0.0, spare=False, release=kept.close, handover=handover,
                          turns=kept.turns + 1, thread_loaded=True,
                          turn_start=early.pending if early is not None else None)
        except TurnRunError as exc:
            _unless_recorded(exc, kept)
            raise
        finally:
            if not handover.owns(kept.client):
                kept.close()  # also when the turn failed: a former spare's home goes with it (idempotent)
    spare = _take_spare(claim)
    try:
        return _run_on(claim, control, stream, spare, t0, handover)
    finally:
        if spare is not None and not handover.owns(spare.client):
            spare.discard()  # one session per spare: its home and process go (after the rollout was read)


def _unless_recorded(exc: TurnRunError, kept: KeptThread) -> None:
    """A kept app-server that died as its turn was sent (killed between turns, its death not yet seen when
    the copy was taken: ``turn/start`` was written, then its stdout closed) left no answer and its rollout
    file exactly as kept (``rollout_stamp``): codex recorded nothing of the turn, and PostgreSQL's rollout
    is the thread's latest state. Such a failure counts as before ``turn/start`` — the turn is run again,
    cold (``_may_retry``). Any trace of the turn in the file, or an answer, keeps it a failure."""
    if (not exc.before_turn_start and isinstance(exc.cause, TransportError) and not exc.outcome.codex_turn_id
            and not kept.client.alive() and rollout_stamp(kept.home, kept.thread_id) == kept.stamp):
        logger.info("turn %s: the kept app-server died before it recorded the turn; running it cold", kept.session_id)
        exc.before_turn_start = True


def _take_kept(claim: TurnClaim) -> KeptThread | None:
    """This process's loaded copy of the claim's thread, if it may run this turn: same thread and
    rollout generation as PostgreSQL, same config, alive, the rollout file untouched since
    (``KeptThread.usable_for``); a re-run after a lost worker always runs cold (the lost run's
    leftovers are looked for in the session's home, ``_restore``). A copy that may not is closed."""
    k = keeper_if_made()
    kept = k.take(claim.session_id) if k is not None else None
    if kept is None:
        return None
    why = ("a re-run after a lost worker runs cold" if claim.attempt > 1 else
           kept.usable_for(thread_id=claim.thread_id, generation=claim.rollout_generation, config=claim.config))
    if why:
        logger.info("turn %s: not using the loaded thread %s: %s; running cold", claim.turn_id, kept.thread_id, why)
        kept.close()
        return None
    return kept


def _take_spare(claim: TurnClaim) -> Spare | None:
    """A ready spare app-server (``HERMES_WARM_POOL`` > 0), for a claim's first attempt only: a re-run
    after a lost worker looks for that worker's rollout in the session's own home (``_restore``)."""
    pool = spare_pool() if claim.attempt == 1 else None
    return pool.take() if pool is not None else None


def _run_on(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter, spare: Spare | None,
            t0: float, handover: _Handover) -> TurnOutcome:
    config = claim.config
    home, base = _restore(claim, control, spare)
    restore_ms = round((time.monotonic() - t0) * 1000, 1)
    try:
        workdir = policy.session_workdir_ready(claim.session_id, created=claim.session_created)
        if spare is not None:
            spare.handler = make_server_request_handler(approval_policy=config["approval_policy"], ask=approvals.ask)
            client, version = spare.client, _codex_version(spare.init)
            if not client.alive():
                raise _StartupError("the spare codex app-server died before the turn", cause=TransportError("spare gone"))
        else:
            client, version = _spawn(claim, workdir, die_with_worker=handover.may_keep)
    except _StartupError:
        raise
    except Exception as exc:  # noqa: BLE001 — any start-up trouble fails (or retries) the turn, not the worker
        logger.warning("turn %s: codex app-server did not start: %s", claim.turn_id, exc)
        raise _StartupError(f"codex app-server could not be started: {exc}", cause=exc) from exc
    initialize_ms = round((time.monotonic() - t0) * 1000 - restore_ms, 1)
    return _drive(claim, control, stream, client, version, workdir, home, base, t0,
                  restore_ms=restore_ms, initialize_ms=initialize_ms, spare=spare is not None,
                  release=spare.discard if spare is not None else client.close, handover=handover)


def _spawn(claim: TurnClaim, workdir: Path, *, die_with_worker: bool = False) -> tuple[AppServerClient, str]:
    """A fresh app-server for the claim's session, started and initialized; and codex's version.
    ``die_with_worker``: it may be kept after the turn, so it gets ``PR_SET_PDEATHSIG`` (it must not
    outlive a worker killed with SIGKILL; spawned on a thread that lives as long as the process, ``_Handover``)."""
    config = claim.config
    client = AppServerClient(
        app_server_argv(sandbox=config["sandbox"], workdir=workdir),
        env=app_server_env(session_home(claim.session_id)),
        cwd=str(workdir),
        request_timeout=settings.CODEX_REQUEST_TIMEOUT,
        max_frame_bytes=settings.CODEX_MAX_FRAME_BYTES,
        stderr_tail_lines=STDERR_TAIL_LINES,
        server_request_handler=make_server_request_handler(approval_policy=config["approval_policy"],
                                                           ask=approvals.ask),
        preexec_fn=die_with_parent if die_with_worker else None,
    )
    return client, _codex_version(client.start())


def _drive(claim: TurnClaim, control: TurnControl, stream: TurnEventWriter, client: AppServerClient, version: str,
           workdir: Path, home: Path, base: RolloutBase | None, t0: float, *, restore_ms: float,
           initialize_ms: float, spare: bool, release: Callable[[], None], handover: _Handover,
           turns: int = 1, thread_loaded: bool = False, turn_start: PendingRequest | None = None) -> TurnOutcome:
    """Drive the claim's turn on ``client`` (started), read what codex appended, and close it with
    ``release`` — unless the turn completed and ``handover`` may keep the process: then it is left running
    in ``handover`` (``turns``: how many turns it has run, this one included). ``thread_loaded``: the
    claim's thread is loaded in ``client`` (a kept thread): ``turn/start`` without ``thread/resume``;
    ``turn_start``: that ``turn/start`` was sent already (``early_start.py``)."""
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
        thread_loaded=thread_loaded,
        turn_start=turn_start,
        previous_thread_id=claim.previous_thread_id,
        on_thread_started=lambda thread_id: turn_note_thread(turn_id=claim.turn_id, token=claim.token, thread_id=thread_id),
        on_event=stream.add,
        on_tick=stream.tick,
    )
    keep = completed = False
    control.attach(client.kill_nowait)  # a woken turn's soft limit ends this app-server (time_limits.py)
    asking = approvals.turn_asks(turn_id=claim.turn_id, token=claim.token, control=control,
                                 approval_policy=config["approval_policy"], park=handover.park)
    approvals_asked = 0
    try:
        with asking as asked:
            try:
                outcome = drive_turn(client, spec)
            finally:
                approvals_asked = asked.asked
        outcome.approvals = approvals_asked
        _approval_timings(outcome, control)
        completed = True
        keep = handover.keeps() and outcome.status == "completed" and client.alive()
    except TurnRunError as exc:
        exc.outcome.timings.update(initialize_ms=initialize_ms, restore_ms=restore_ms)
        exc.outcome.approvals = approvals_asked
        _approval_timings(exc.outcome, control)
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
        control.attach(None)
        # Not kept: close before reading the rollout and committing, so codex has exited and the
        # thread's writer lock is free (docs/codex.md §1, §7). Kept: the file is already complete at
        # turn/completed (§7, checked below: it ends with a whole line).
        if not keep:
            client.close()  # the home stays until the rollout is read (``release`` removes a spare's)
        if not completed:
            stream.flush()  # the streamed deltas and items commit before the turn's end is written
    # What codex streamed and the writer has not written yet commits in the finalize transaction,
    # before the turn's last events (a short turn costs no stream transaction of its own).
    outcome.stream_tail = stream.take_pending()
    outcome.timings.update(claim.timings, initialize_ms=initialize_ms, restore_ms=restore_ms)
    if spare:
        outcome.timings["spare"] = 1  # the app-server came from the warm pool (initialize_ms: ~0)
    if turns > 1:
        outcome.timings["warm"] = 1  # ran on a thread kept loaded since the session's last turn
    t1 = time.monotonic()
    mark("rollout.capture.start", claim.turn_id)
    running = _Running(client=client, home=home, version=version, release=release, turns=turns) if keep else None
    try:
        _capture_rollout(outcome, home, base, version, running=running, turn_id=claim.turn_id)
    finally:
        if running is None or not running.client.alive():
            release()
            running = None
    handover.running = running
    outcome.timings["capture_ms"] = round((time.monotonic() - t1) * 1000, 1)  # read + check the appended bytes
    outcome.timings["codex_ms"] = round((time.monotonic() - t0) * 1000, 1)
    return outcome


def _approval_timings(outcome: TurnOutcome, control: TurnControl) -> None:
    """``timings["approval_wait_ms"]``: how long the turn's approvals waited for a person (when any did)."""
    waited = control.waited_seconds()
    if waited:
        outcome.timings["approval_wait_ms"] = round(waited * 1000, 1)


def _capture_rollout(outcome: TurnOutcome, home: Path, base: RolloutBase | None, version: str, *,
                     running: _Running | None = None, turn_id: object = None) -> None:
    """Fill ``outcome.rollout`` with what codex appended to the thread's rollout. A file that no longer
    starts with the stored bytes fails the turn (fail closed: a diverged copy is never stored).
    ``running``: the app-server is still running (to be kept); should the file not end with a whole
    line, it is closed and the file read again (then complete, ``docs/codex.md`` §7); on any error it is
    closed. The home is left in place either way (the caller releases it)."""
    if running is None:
        _read_appended(outcome, home, base, version)
        return
    try:
        _read_appended(outcome, home, base, version)
        if outcome.rollout is not None and not outcome.rollout.data.endswith(b"\n"):
            logger.warning("turn %s: the rollout did not end with a whole line at turn/completed; closing codex "
                           "and reading it again", turn_id)
            running.client.close()
            _read_appended(outcome, home, base, version)
    except BaseException:
        running.client.close()  # the caller releases it
        raise


def _read_appended(outcome: TurnOutcome, home: Path, base: RolloutBase | None, version: str) -> None:
    if not outcome.thread_id:
        return
    extends = base if base is not None and base.thread_id == outcome.thread_id else None
    try:
        outcome.rollout = read_delta(home, outcome.thread_id, extends)
    except RolloutDiverged as exc:
        raise TurnRunError(f"{exc} — the binding is kept", outcome, exc, before_turn_start=False) from exc
    outcome.codex_version = version


@dataclass
class _Running:
    """An app-server left running after a completed turn, until ``_Handover.settle`` keeps it or closes it."""

    client: AppServerClient
    home: Path
    version: str
    release: Callable[[], None]
    turns: int


class _Handover:
    """The hand-over of the app-server one turn ran on to this process's keeper: from ``turn/completed``
    (``running``) to the finalize commit, after which ``settle`` hands it over (a commit that succeeded
    and stored the rollout) and ``close`` closes whatever was not handed over.

    ``may_keep``: this process keeps threads loaded (a route — a worker with one pool process,
    ``worker/affinity.py`` —, keeping on, and a thread that lives as long as the process — the main
    thread, a runner, the wake listener's: ``PR_SET_PDEATHSIG`` follows the spawning thread,
    ``wake.in_long_lived_thread``) and the turn did not park. Turns of other sessions hand theirs over at
    the same time: the keeper locks its map, and ``Keeper.take`` removes a copy, so no two turns ever
    drive one app-server.

    ``parking``: the turn's runner handle (``runners.TurnRun``). A parked turn gave its permit back and
    finishes outside the permits, so its app-server is closed at its end, not kept: the keeper holds only
    what turns within ``HERMES_WORKER_TURNS`` left. ``park`` and ``keeps`` share a lock: a turn parks only
    before its keep was decided, never after
    (``tests/services/test_parking.py::test_a_parked_turns_app_server_is_closed_not_kept``)."""

    def __init__(self, *, may_keep: bool | None = None, parking: TurnRun | None = None) -> None:
        if may_keep is None:
            may_keep = bool(routing.own_route()) and keeper_make() is not None and wake.in_long_lived_thread()
        self.may_keep = may_keep
        self.running: _Running | None = None
        self._parking = parking
        self._lock = threading.Lock()
        self._decided = False

    def park(self, *, token: uuid.UUID, control: TurnControl) -> bool:
        """The approval desk's call once a request waited for a person: free the delivery's permit
        (``runners.TurnRun.park``); ``False`` when the turn keeps it (no runner, the bound, decided already)."""
        with self._lock:
            if self._parking is None or self._decided or not self._parking.park(token=token, control=control):
                return False
            self.may_keep = False
            return True

    def keeps(self) -> bool:
        """Decide, once codex's turn ended, whether its app-server may be kept (``may_keep``); no park after."""
        with self._lock:
            self._decided = True
            return self.may_keep

    def owns(self, client: AppServerClient) -> bool:
        return self.running is not None and self.running.client is client

    def queue(self) -> str:
        """The route to record as holding the thread (``turn_finalize``), or ``""``."""
        return routing.own_route() if self.running is not None else ""

    def settle(self, claim: TurnClaim, outcome: TurnOutcome, turn: Turn | None) -> None:
        running, k = self.running, keeper_make()
        delta = outcome.rollout
        if (running is None or k is None or turn is None or turn.status != Turn.Status.SUCCEEDED
                or delta is None or not outcome.thread_id):
            return  # ``close`` releases it
        generation = delta.base.generation + 1 if delta.base is not None and delta.base.generation else 1
        kept = KeptThread(
            session_id=claim.session_id, thread_id=outcome.thread_id, client=running.client, home=running.home,
            base=RolloutBase(thread_id=delta.thread_id, relpath=delta.relpath, length=delta.length,
                             sha256=delta.sha256, generation=generation),
            config=claim.config, version=running.version, close=running.release, turns=running.turns,
            stamp=rollout_stamp(running.home, outcome.thread_id),
        )
        self.running = None  # the keeper owns it from here
        closed = k.keep(kept)
        try:
            start_affinity(k)
            if closed:
                routing.warm_thread_forget(queue=routing.own_route(), session_ids=[c.session_id for c in closed])
        except Exception:  # noqa: BLE001 — routing is a hint: a stale row only costs the affinity deadline
            logger.exception("turn %s: could not record the kept thread's routing", claim.turn_id)

    def close(self) -> None:
        running, self.running = self.running, None
        if running is not None:
            running.release()


def turn_run(*, turn_id: uuid.UUID | str, task_id: str | None = None, woken: bool = False, session_id: str = "",
             hint: routing.WakeHint | None = None) -> Turn | Parked | None:
    """``turn_execute`` on one of this process's runner threads (``runners.py``), for a delivery that holds
    one of the worker's permits and waits: returns what it returns, or ``Parked`` as soon as the turn parked
    to wait for a person (the delivery then lets its permit go; the runner writes the turn's end). The
    runner gives the turn a task's soft and hard time limits (``time_limits.thread_time_limits``: Celery
    enforces its own only on its tasks' thread, and a parked turn outlives its task) and checks its
    thread's database connection as a task's is. Outside a worker process (no runners: an eager task, a
    test) it runs on this thread, as a task — or, ``woken``, under those limits —, and never parks."""
    kwargs = {"turn_id": turn_id, "task_id": task_id, "woken": woken, "session_id": session_id, "hint": hint}
    pool = runner_pool()
    if pool is None and not woken:
        return turn_execute(**kwargs)  # type: ignore[arg-type]
    work = _runner_work(kwargs)
    if pool is None:
        close_old_connections()
        return work(None)
    return pool.run(work, turn_id=turn_id)


def _runner_work(kwargs: dict[str, Any]) -> Callable[[TurnRun | None], Turn | None]:
    """What a runner runs for a turn: ``turn_execute(**kwargs)`` under a task's time limits."""
    soft, hard = turn_time_limits()
    turn_id = kwargs["turn_id"]
    what = f"woken turn {turn_id}" if kwargs["woken"] else f"turn {turn_id}"

    def work(run: TurnRun | None) -> Turn | None:
        with thread_time_limits(soft=soft, hard=hard, what=what) as limits:
            if run is not None:
                run.limits = limits
            return turn_execute(**kwargs, limits=limits, parking=run)

    return work


def turn_execute_woken(turn_id: uuid.UUID, session_id: str,
                       hint: routing.WakeHint | None = None) -> TurnRun | Turn | Parked | None:
    """Run turn ``turn_id`` of ``session_id`` on its wake-up (``wake.WakeListener``, this process's
    listener thread) once one of this process's ``HERMES_WORKER_TURNS`` permits is free
    (``wake.TurnSlots``: the turns of its Celery delivery and its other wakes hold the others until they
    end or park) — on the kept thread, or cold when this process let the thread go meanwhile. The turn is
    handed to a runner with the permit (``Runners.submit``, the task's time limits as ``turn_run``'s) and
    this returns at once, its ``TurnRun``; the runner gives the permit back when the turn ends or parks.
    ``None`` without running it when no permit comes free within ``HERMES_AFFINITY_DEADLINE``: the turn is
    left undispatched (``dispatch.turn_undispatched``) and the sweep's next round dispatches it to the
    shared queue (``recovery.turns_dispatch_unclaimed``), for any worker. A wait for the permit longer than
    ``wake.QUEUED_BEHIND_SECONDS`` costs the hint (no early ``turn/start``). ``session_id``: from the wake's
    payload. Without runners (a test) the turn runs on this thread, holding the permit, and its end is
    returned.
    """
    slots = wake.turn_slots()
    asked = time.monotonic()
    taken = slots.acquire(timeout=settings.HERMES_AFFINITY_DEADLINE)
    if time.monotonic() - asked > wake.QUEUED_BEHIND_SECONDS:
        hint = None  # it waited for another turn here: not fresh, whatever its clock says (early_start.py)
    if not taken:
        logger.info("turn %s of session %s: woken, but this worker stayed busy past HERMES_AFFINITY_DEADLINE; "
                    "the sweep dispatches it to the shared queue", turn_id, session_id)
        # Its wake is spent: left undispatched, the next round dispatches it even if the session's
        # WarmThread row went meanwhile (an evicted or expired copy), which the deadline rule needs.
        turn_undispatched(turn_id)
        return None
    kwargs = {"turn_id": turn_id, "task_id": WOKEN_TASK_ID, "woken": True, "session_id": session_id, "hint": hint}
    pool = runner_pool()
    if pool is None:
        try:
            return turn_run(**kwargs)  # type: ignore[arg-type]
        finally:
            slots.release()
    try:
        return pool.submit(_runner_work(kwargs), turn_id=turn_id, on_released=slots.release, detached=True)
    except BaseException:
        slots.release()
        raise


def start_affinity(k: Keeper) -> affinity.AffinityLoop | None:
    """This worker process's affinity job (once; at the pool process's start, ``process.start``, and
    at a kept turn) and its wake listener (``wake.wake_start``; runs ``turn_execute_woken``); ``None``
    without a route."""
    loop = affinity.affinity_start(k)
    if loop is not None:
        wake.wake_start(loop.queue, run=turn_execute_woken)
    return loop
