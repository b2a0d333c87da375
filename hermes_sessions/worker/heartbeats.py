"""The leases of the turns a worker process runs, renewed by one thread per process.

A claimed turn's lease (``HERMES_LEASE_SECONDS``) is renewed every ``HERMES_HEARTBEAT_SECONDS`` while the
turn runs (``turns.turn_heartbeat``: one UPDATE guarded by the claim token); the renewal also reads
whether a client asked to cancel. It used to be a thread per turn, started before ``turn/start`` and
joined after the finalize: ~0.6 ms of the ~5 ms between a woken turn's wake-up and its ``turn/start`` on
2 cores (``make bench-warm``), and a new database connection for every turn longer than one beat. Now
``TurnHeartbeats`` — one thread (``hermes-turn-heartbeats``) and one connection per process, started on
first use (again after a fork) — renews every registered claim when its beat is due, and closes its
connection whenever no turn runs.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings
from django.db import close_old_connections, connection

from ..codex.runner import TurnControl
from ..services.due_threads import DueThread
from ..services.turns import TurnClaim, turn_heartbeat
from .recovery import lease_renewed_here

logger = logging.getLogger(__name__)


@dataclass
class _Beat:
    claim: TurnClaim
    control: TurnControl
    due: float  # monotonic


class TurnHeartbeats(DueThread):
    """Renews the leases of the registered claims (``beating``): each ``HERMES_HEARTBEAT_SECONDS`` after
    its registration and then after each renewal. A claim found gone sets ``control.abandon``; a cancel
    request sets ``control.interrupt``; a failed renewal (a database blip) is logged and tried at the next
    beat — the lease has slack. Nothing is set on a claim after it left (``beating`` ended). The thread's
    connection is closed whenever no turn is left to renew."""

    thread_name = "hermes-turn-heartbeats"

    def __init__(self) -> None:
        super().__init__()
        self._beats: dict[uuid.UUID, _Beat] = {}  # by claim token

    @contextmanager
    def beating(self, claim: TurnClaim, control: TurnControl) -> Iterator[None]:
        """Renew ``claim``'s lease for the block; this process's lease take-back leaves it alone meanwhile
        (``recovery.lease_renewed_here``)."""
        lease_renewed_here(claim.token, renewing=True)
        with self._cond:
            if self._ensure_started():
                self._beats = {}  # a forked child's: the parent's turns are not its own
            self._beats[claim.token] = _Beat(claim, control, time.monotonic() + settings.HERMES_HEARTBEAT_SECONDS)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._beats.pop(claim.token, None)
            lease_renewed_here(claim.token, renewing=False)

    def _take_due(self, now: float) -> list[_Beat]:
        due = [b for b in self._beats.values() if b.due <= now]
        for b in due:
            b.due = now + settings.HERMES_HEARTBEAT_SECONDS
        return due

    def _next_at(self) -> float | None:
        return min((b.due for b in self._beats.values()), default=None)

    def _run_due(self, b: _Beat) -> None:
        self._renew(b)

    def _quiet(self) -> None:
        connection.close()  # no turn left to renew: hold no connection meanwhile (a test database's drop waits)

    def _renew(self, b: _Beat) -> None:
        try:
            close_old_connections()
            beat = turn_heartbeat(turn_id=b.claim.turn_id, token=b.claim.token)
        except Exception:  # noqa: BLE001 — a database blip must not kill the turn; the lease has slack
            logger.exception("turn %s: heartbeat failed", b.claim.turn_id)
            return
        with self._cond:
            if self._beats.get(b.claim.token) is not b:
                return  # the turn ended meanwhile: its control is no longer read
            if not beat.held:
                self._beats.pop(b.claim.token, None)  # no more renewals of a claim that is gone
                b.control.abandon.set()
            elif beat.cancel_requested:
                b.control.interrupt.set()


HEARTBEATS = TurnHeartbeats()
