"""An early ``turn/start``: a woken worker sends the turn to the session's kept thread *while* it claims it.

Why: on the warm path the claim (one round trip: the locks, the claim, the ``running`` event, the
COMMIT) took ~3.3 ms of the ~16 ms the stack added to codex's ~62 ms turn, and ``turn/start`` waited for
it (``make bench-warm`` with ``HERMES_LATENCY_MARKS``, README "make bench-warm"). codex itself takes
~25 ms to answer ``turn/start`` and ~50 ms to send the model its request (codex 0.171.0 under the
read-only profile, 20 turns on a loaded thread, the stand-in's request log: 45–56 ms after
``turn/start`` was written). So the claim can run inside codex's own start-up instead of before it.

The rule that keeps a turn from running twice stays the claim: codex is *given* the input before the
claim answers, but nothing of the turn is read, streamed or committed before the claim holds
(``TurnSpec.turn_start``: its answer is read after the claim). When the claim does not hold — the turn
was cancelled, run or taken by another worker meanwhile, is not the session's next turn, or the
stored thread, generation, config or input is not the kept copy's — the app-server is killed at once
(SIGKILL of its process group, ``AppServerClient.kill``) and the copy dropped; the turn, if it is
still this worker's, then runs cold. Killed within a claim's round trip, codex has not reached the
model (above), so an abandoned early start costs nothing but the copy. A claim can be late (a lock
held by another writer of the session, a slow database, a busy host): ``PAUSE_AFTER_SECONDS`` after
``turn/start`` a job on the process's scheduler (``worker/scheduler.py``, whose jobs never block for
long, so nothing delays it) stops the app-server process (SIGSTOP; not its group, whose
sandbox helpers could be stopped before they registered to die with their parent — ``AppServerClient.pause``)
until the claim is confirmed (SIGCONT, ``timings["early_start_paused"]``; the stopped time extends
``turn/start``'s deadline) or not (SIGKILL): unpaused, a claim 60 ms late would let codex ask the model, and run a
command, for a turn that ends cancelled (``tests/services/test_early_start.py``).

An early start is tried only when every one of these holds (``early_start``), else the worker claims
first as before:

* ``HERMES_EARLY_START`` is on, and the wake carried the turn's input (``routing.WakeHint``: an input
  that does not fit a ``NOTIFY`` payload goes without);
* the wake is fresh: sent less than ``max_age()`` seconds ago by the enqueuing process's clock — far
  inside ``HERMES_AFFINITY_DEADLINE``, before which no other worker is given the turn (the sweep's
  dispatch to the shared queue, ``recovery.turns_dispatch_unclaimed``) — *and* by this process's own
  evidence: it did not wait
  behind another wake's slow hand-off (``wake.WakeListener``), nor for a permit
  (``execution.turn_execute_woken``), nor for its session's last run in this process to hand its app-server
  to the keeper (``execution.turn_execute``, ``runners.SessionRuns``).
  The clock test alone would not do across hosts: a worker whose clock is behind the API host's takes a
  late wake for a fresh one (one ahead by more than ``CLOCK_SLACK_SECONDS`` never starts early);
* this process keeps the session's thread loaded, alive, its rollout file as this process left it;
* the session's sandbox is ``read-only``: even a claim slower than codex's start-up cannot have let a
  killed turn change a file.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from django.conf import settings

from ...codex.client import PendingRequest
from ...codex.errors import CodexError
from ...codex.runner import kept_turn_start_params
from ...codex.sandbox_check import SandboxUnavailable, check_sandbox
from ...latency_marks import mark
from ...services.routing import WakeHint
from ...services.turns import TurnClaim
from ..process import runtime
from ..scheduler import Job
from .kept import KeptThread, keeper_if_made, rollout_stamp

logger = logging.getLogger(__name__)

MAX_AGE_SECONDS = 0.5  # a wake older than this (or a quarter of HERMES_AFFINITY_DEADLINE) claims first
CLOCK_SLACK_SECONDS = 0.05  # a wake "from the future" by less than this is fresh (another host's clock)
# A claim not confirmed this long after turn/start pauses codex (SIGSTOP) until it is: codex asks the model
# ~45 ms after turn/start at the earliest (measured: 0 requests with the claim 10–40 ms
# late, 1 at 60 ms), a claim takes ~4 ms.
PAUSE_AFTER_SECONDS = 0.02


def max_age() -> float:
    """Seconds after its enqueue a wake may still start its turn early: ``min(MAX_AGE_SECONDS,
    HERMES_AFFINITY_DEADLINE / 4)``."""
    return min(MAX_AGE_SECONDS, float(settings.HERMES_AFFINITY_DEADLINE) / 4)


@dataclass
class EarlyStart:
    """``turn/start`` sent to ``kept`` (taken out of this process's keeper: the turn owns it) for turn
    ``turn_id`` with ``text``; ``pending`` is its unread answer. ``confirm`` with the claim, then run the
    turn on ``kept`` with ``pending`` (``execution._run_once``) — or ``abort``."""

    turn_id: uuid.UUID
    kept: KeptThread
    pending: PendingRequest
    text: str
    taken: bool = False
    paused: bool = False  # the claim was late: codex is (or was) stopped until it is confirmed
    settled: bool = False  # confirmed or aborted: the pause job leaves it alone
    _paused_at: float = 0.0  # time.monotonic() of the pause
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pause_job: Job | None = field(default=None, repr=False)

    def _late(self) -> None:
        """The pause job's (on the scheduler): the claim is not confirmed ``PAUSE_AFTER_SECONDS`` after ``turn/start`` — stop
        codex before it can ask the model or run anything."""
        with self._lock:
            if self.settled:
                return
            self.paused = self.kept.client.pause()
            self._paused_at = time.monotonic()
        logger.info("turn %s: its claim is late; codex is paused until it holds", self.turn_id)

    def _settle(self) -> None:
        with self._lock:
            self.settled = True
        if self._pause_job is not None:
            self._pause_job.cancel()

    def confirm(self, claim: TurnClaim | None) -> str:
        """Why the claim does not let this start stand (``""``: it does): no claim, a re-run, another
        input, or the kept copy is not the stored thread, generation and config (``KeptThread.usable_for``
        without the file, which codex is appending to by now). A start that stands goes on (a paused codex
        is resumed); one that does not must be ``abort``ed."""
        why = self._why(claim)
        self._settle()
        if not why and self.paused:
            self.kept.client.resume()
            # The time codex was stopped does not count against turn/start's answer: otherwise a claim
            # that holds later than CODEX_REQUEST_TIMEOUT would fail the turn with a request timeout.
            self.pending.extend(time.monotonic() - self._paused_at)
        return why

    def _why(self, claim: TurnClaim | None) -> str:
        if claim is None:
            return "the turn was not claimed (run, ended, cancelled or not yet the session's next)"
        if claim.attempt != 1:
            return "a re-run after a lost worker runs cold"
        if claim.input_text != self.text:
            return "the wake's input is not the turn's"
        return self.kept.usable_for(thread_id=claim.thread_id, generation=claim.rollout_generation,
                                    config=claim.config, check_file=False)

    def take(self) -> KeptThread:
        """The copy, for the run that reads ``pending``'s answer: from here that run closes or keeps it."""
        self.taken = True
        return self.kept

    def abort_unless_taken(self) -> None:
        """``abort`` when no run took the copy (something failed between the claim and the run)."""
        if not self.taken:
            self.abort("the turn's run did not reach its app-server")

    def abort(self, why: str) -> None:
        """Kill the app-server (codex must not go on with the turn) and drop the copy (its home with it,
        for a former spare). Idempotent."""
        self._settle()
        logger.info("turn %s: early turn/start withdrawn: %s; its app-server is killed", self.turn_id, why)
        try:
            self.kept.client.kill()
        finally:
            self.kept.close()


def early_start(*, turn_id: uuid.UUID, session_id: str, hint: WakeHint | None) -> EarlyStart | None:
    """Send turn ``turn_id``'s ``turn/start`` to this process's kept thread of ``session_id`` before the
    claim, when the module's conditions hold; ``None`` (nothing sent, nothing taken) otherwise — and
    when the send fails (the copy is closed then; the claimed turn runs cold). The caller must
    ``confirm`` or ``abort`` what it gets."""
    if hint is None or not settings.HERMES_EARLY_START:
        return None
    age = time.time() - hint.sent_at
    if not -CLOCK_SLACK_SECONDS <= age < max_age():
        return None
    k = keeper_if_made()
    kept = k.peek(session_id) if k is not None else None
    if k is None or kept is None or kept.config.get("sandbox") != "read-only" or not kept.client.alive():
        return None
    try:
        check_sandbox()  # cached per process; a host whose sandbox fails runs nothing (the claim path says so)
    except SandboxUnavailable:
        return None
    if rollout_stamp(kept.home, kept.thread_id) != kept.stamp:
        return None
    taken = k.take(session_id)
    if taken is not kept:  # released or replaced since the look (the affinity job, on the scheduler)
        if taken is not None:
            k.keep(taken)
        return None
    try:
        params = kept_turn_start_params(thread_id=kept.thread_id, text=hint.text, client_turn_id=str(turn_id))
        mark("codex.turn_start.sent", turn_id)
        pending = kept.client.send_request("turn/start", params, timeout=settings.CODEX_REQUEST_TIMEOUT)
        early = EarlyStart(turn_id=turn_id, kept=kept, pending=pending, text=hint.text)
        early._pause_job = runtime().scheduler.after(PAUSE_AFTER_SECONDS, early._late,
                                                     name=f"early-start pause of turn {turn_id}")
    except CodexError as exc:
        logger.info("turn %s: early turn/start not sent (%s); the turn runs cold", turn_id, exc)
        _drop(kept)
        return None
    except BaseException:
        _drop(kept)  # taken out of the keeper: nobody else would close it
        raise
    return early


def _drop(kept: KeptThread) -> None:
    try:
        kept.client.kill()
    finally:
        kept.close()
