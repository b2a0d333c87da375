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
model (above), so an abandoned early start costs nothing but the copy.

An early start is tried only when every one of these holds (``early_start``), else the worker claims
first as before:

* ``HERMES_EARLY_START`` is on, and the wake carried the turn's input (``wake.WakeHint``: an input
  that does not fit a ``NOTIFY`` payload goes without);
* the wake is fresh: sent less than ``max_age()`` seconds ago by the enqueuing process's clock — far
  inside ``HERMES_AFFINITY_DEADLINE``, before which no other worker is given the turn (the shared
  queue's copy, the hand-off, ``affinity.py``): a wake read late (this worker was busy or frozen) claims
  first. Across hosts the bound also covers the clocks' skew;
* this process keeps the session's thread loaded, alive, its rollout file as this process left it;
* the session's sandbox is ``read-only``: even a claim slower than codex's start-up cannot have let a
  killed turn change a file.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from ..codex.client import PendingRequest
from ..codex.errors import CodexError
from ..codex.kept import KeptThread, current_keeper, rollout_stamp
from ..codex.runner import kept_turn_start_params
from ..codex.sandbox_check import SandboxUnavailable, check_sandbox
from ..latency_marks import mark
from .turns import TurnClaim
from .wake import WakeHint

logger = logging.getLogger(__name__)

MAX_AGE_SECONDS = 0.5  # a wake older than this (or a quarter of HERMES_AFFINITY_DEADLINE) claims first
CLOCK_SLACK_SECONDS = 0.05  # a wake "from the future" by less than this is fresh (another host's clock)


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

    def confirm(self, claim: TurnClaim | None) -> str:
        """Why the claim does not let this start stand (``""``: it does): no claim, a re-run, another
        input, or the kept copy is not the stored thread, generation and config (``KeptThread.usable_for``
        without the file, which codex is appending to by now)."""
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
    k = current_keeper()
    kept = k.peek(session_id) if k is not None else None
    if k is None or kept is None or kept.config.get("sandbox") != "read-only" or not kept.client.alive():
        return None
    try:
        check_sandbox()  # cached per process; a host whose sandbox fails runs nothing (the claim path says so)
    except SandboxUnavailable:
        return None
    if rollout_stamp(kept.home, kept.thread_id) != kept.stamp or k.take(session_id) is not kept:
        return None
    params = kept_turn_start_params(thread_id=kept.thread_id, text=hint.text, client_turn_id=str(turn_id))
    mark("codex.turn_start.sent", turn_id)
    try:
        pending = kept.client.send_request("turn/start", params, timeout=settings.CODEX_REQUEST_TIMEOUT)
    except CodexError as exc:
        logger.info("turn %s: early turn/start not sent (%s); the turn runs cold", turn_id, exc)
        kept.client.kill()
        kept.close()
        return None
    return EarlyStart(turn_id=turn_id, kept=kept, pending=pending, text=hint.text)
