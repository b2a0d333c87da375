"""The leases of the turns a worker process runs, renewed by jobs on the process's scheduler.

A claimed turn's lease (``HERMES_LEASE_SECONDS``) is renewed every ``HERMES_HEARTBEAT_SECONDS`` while the
turn runs (``turns.turn_heartbeat``: one UPDATE guarded by the claim token, ms-scale, as the scheduler's
rule asks: ``scheduler.py``); the renewal also reads whether a client asked to cancel. The renewals are
jobs of the process's one scheduler thread (``hermes-scheduler``) on its database connection, which it
closes once nothing is due soon; no thread is started per turn (~0.6 ms of a woken turn's ~5 ms to
``turn/start`` on 2 cores, ``make bench-warm``, when it was one).
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings

from ..codex.runner import TurnControl
from ..services.turns import TurnClaim, turn_heartbeat
from .recovery import lease_renewed_here
from .scheduler import Job, Scheduler

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Beat:
    claim: TurnClaim
    control: TurnControl
    job: Job | None = None


class TurnHeartbeats:
    """Renews the leases of the registered claims (``beating``): each ``HERMES_HEARTBEAT_SECONDS`` after
    its registration and then after each renewal, on ``scheduler`` (default: this process's,
    ``process.runtime()``). A claim found gone sets ``control.abandon``; a cancel request sets
    ``control.interrupt``; a failed renewal (a database blip) is logged and tried at the next beat — the
    lease has slack. Nothing is set on a claim after it left (``beating`` ended)."""

    def __init__(self, scheduler: Scheduler | None = None) -> None:
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._beats: dict[uuid.UUID, _Beat] = {}  # by claim token

    def _on(self) -> Scheduler:
        if self._scheduler is None:
            from .process import runtime

            return runtime().scheduler
        return self._scheduler

    @contextmanager
    def beating(self, claim: TurnClaim, control: TurnControl) -> Iterator[None]:
        """Renew ``claim``'s lease for the block; this process's lease take-back leaves it alone meanwhile
        (``recovery.lease_renewed_here``)."""
        lease_renewed_here(claim.token, renewing=True)
        beat = _Beat(claim, control)
        with self._lock:
            self._beats[claim.token] = beat
        beat.job = self._on().every(lambda: float(settings.HERMES_HEARTBEAT_SECONDS), lambda: self._renew(beat),
                                    name=f"heartbeat of turn {claim.turn_id}",
                                    first_after=float(settings.HERMES_HEARTBEAT_SECONDS))
        try:
            yield
        finally:
            with self._lock:
                self._beats.pop(claim.token, None)
            beat.job.cancel()
            lease_renewed_here(claim.token, renewing=False)

    def _renew(self, b: _Beat) -> None:
        try:
            beat = turn_heartbeat(turn_id=b.claim.turn_id, token=b.claim.token)
        except Exception:  # noqa: BLE001 — a database blip must not kill the turn; the lease has slack
            logger.exception("turn %s: heartbeat failed", b.claim.turn_id)
            return
        with self._lock:
            if self._beats.get(b.claim.token) is not b:
                return  # the turn ended meanwhile: its control is no longer read
            if not beat.held:
                self._beats.pop(b.claim.token, None)  # no more renewals of a claim that is gone
                if b.job is not None:
                    b.job.cancel()
                b.control.abandon.set()
            elif beat.cancel_requested:
                b.control.interrupt.set()


def process_heartbeats() -> TurnHeartbeats:
    """This process's ``TurnHeartbeats`` (``process.runtime().heartbeats``), made on first use."""
    from .process import runtime

    rt = runtime()
    with rt.lock:
        if rt.heartbeats is None:
            rt.heartbeats = TurnHeartbeats(rt.scheduler)
        return rt.heartbeats
