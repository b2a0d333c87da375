"""Waking the worker that holds a session's thread through PostgreSQL's ``NOTIFY``: path 2 of the delivery
table (docs/architecture.md §4).

A warm turn's way to its worker through Celery — the API's send to the broker, the worker's consumer, the
prefork pool's hop to its child, the task's start — was the largest part of its ``queue`` phase (~6.7 of
~55 ms the stack added to codex's turn on this 2-core machine, traced per hop, ``make bench-warm``). So
the enqueue of a turn whose session's holder (``routing.session_route_params``) listened at its last
heartbeat (``TurnWorker.wakeable``) sends ``pg_notify(routing.wake_channel(route), '<turn id> <session
id>')`` in its transaction instead of a Celery message: PostgreSQL delivers it at the commit. The worker
process of that route listens (``WakeListener``, a thread of its own with a connection of its own) and
hands the turn to a runner thread at once, holding one of the process's ``HERMES_WORKER_TURNS`` permits
(``TurnSlots``) until the turn ends or parks; it does not wait for the turn, so one process runs up to that
many turns of different sessions at once.

The wake is a hint; the ``Turn`` row is the queue. A wake that finds every permit of this process taken
past ``HERMES_AFFINITY_DEADLINE`` (``TurnSlots``), or that never arrives (listener reconnecting, worker
frozen or gone), costs time, never the turn: the sweep dispatches a turn its holder has not claimed
within the deadline to the shared queue (``recovery.turns_dispatch_unclaimed``, every worker's round).
Whichever delivery claims the turn first runs it; any other finds it taken (``turns.turn_claim``).

With ``HERMES_EARLY_START`` the payload also carries the turn's input and the enqueuing process's clock
(``WakeHint``, when it fits the payload limit), so that the woken worker can send ``turn/start`` to the
kept thread while it claims the turn (``early_start.py``).

Facts: PostgreSQL 15 delivers a notification sent in a transaction only when it commits, and never for
one rolled back (docs: NOTIFY); a channel name is an identifier of at most 63 bytes, so a worker's
channel is named by a hash of its route.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from django.conf import settings
from django.db import connection

from ..latency_marks import mark
from ..listener import Listener
from ..services import routing
from ..services.routing import WakeHint
from .process import runtime

logger = logging.getLogger(__name__)

# A wake the listener is handed less than this after its last wake's hand-off ended, when that hand-off took
# at least this long (it waited for a permit), waited behind it.
QUEUED_BEHIND_SECONDS = 0.005


class TurnSlots:
    """This process's turn permits: ``HERMES_WORKER_TURNS`` turns at once in a worker process with a route —
    its Celery delivery's and its woken ones together (a bounded semaphore). A delivery holds a permit
    while its turn runs on a runner, until the turn ends **or parks** (``runners.py``): Celery's delivery
    on its task thread (``delivery_slot``), a woken turn on the runner it was handed to (the listener takes
    the permit and goes on to its next wake, ``execution.turn_execute_woken``). I3 is the claim's, not the
    permits': two turns of one session never both hold a claim (``turns.turn_claim``)."""

    def __init__(self, permits: int) -> None:
        if permits < 1:
            raise ValueError(f"HERMES_WORKER_TURNS must be at least 1, not {permits}")
        self.permits = permits
        self._sem = threading.BoundedSemaphore(permits)
        self._lock = threading.Lock()
        self._held = 0

    def acquire(self, *, timeout: float | None = None) -> bool:
        """Take a permit within ``timeout`` seconds (``None``: as long as it takes); whether it was taken."""
        taken = self._sem.acquire(timeout=None if timeout is None else max(timeout, 0.0))
        if taken:
            with self._lock:
                self._held += 1
        return taken

    def release(self) -> None:
        """Give a permit back (``ValueError`` from the semaphore when none is held: a permit released twice)."""
        self._sem.release()
        with self._lock:
            self._held -= 1

    def held(self) -> int:
        """Permits taken now (turns this process runs on its permits)."""
        with self._lock:
            return self._held

    def drain(self, *, timeout: float) -> int:
        """Wait until every permit is free (``timeout`` seconds at most), then give them back; the permits
        still held at the deadline (0: every turn on a permit ended or parked)."""
        deadline = time.monotonic() + timeout
        got = 0
        try:
            while got < self.permits and self._sem.acquire(timeout=max(0.0, deadline - time.monotonic())):
                got += 1
        finally:
            for _ in range(got):
                self._sem.release()
        return self.permits - got


def turn_slots() -> TurnSlots:
    """This process's ``TurnSlots`` (``process.runtime().slots``), made on first use with
    ``HERMES_WORKER_TURNS`` permits."""
    rt = runtime()
    slots = rt.slots
    if slots is None:
        with rt.lock:
            if rt.slots is None:
                rt.slots = TurnSlots(int(settings.HERMES_WORKER_TURNS))
            slots = rt.slots
    return slots


@contextlib.contextmanager
def turn_slot(*, timeout: float | None = None) -> Iterator[bool]:
    """One of this process's turn permits (``TurnSlots``), held for the block; yields whether it was taken
    within ``timeout`` seconds (``None``: waits as long as it takes, always ``True``)."""
    slots = turn_slots()
    taken = slots.acquire(timeout=timeout)
    try:
        yield taken
    finally:
        if taken:
            slots.release()


@contextlib.contextmanager
def delivery_slot(*, timeout: float | None = None) -> Iterator[bool]:
    """For a Celery delivery of ``run_turn``: hold a ``turn_slot`` permit while this process has a wake
    listener, waiting at most ``timeout`` seconds for one (woken turns hold the others); yields whether the
    permit is this delivery's. Without a listener, nothing to hold (always ``True``): no other thread runs
    turns here (an eager task inside a request, a worker with several pool processes or keeping off).

    Why the bound: Celery does not see woken turns, so it counts this pool process idle and hands it the
    next message of the shared queue; waiting for a woken turn to end would hold a turn that another, idle
    worker could run. A delivery that cannot have a permit leaves its turn to the sweep instead
    (``tasks.run_turn``; ``tests/e2e/test_affinity.py`` pins that it does not starve)."""
    if not wake_listening():
        yield True
        return
    with turn_slot(timeout=timeout) as taken:
        yield taken


class WakeListener:
    """A daemon thread that ``LISTEN``s on ``wake_channel(queue)`` (``listener.Listener``: a connection of
    its own, the shared reconnect rule) and calls ``run(turn_id, session_id, hint)`` for each wake
    (``parse_payload``), on this thread (``execution.turn_execute_woken``: it waits at most
    ``HERMES_AFFINITY_DEADLINE`` for a permit, hands the turn to a runner and returns; the runner gives the
    permit back when the turn ends or parks). A wake handed over right after a ``run`` that took at least
    ``QUEUED_BEHIND_SECONDS`` (it waited for a permit) waited behind it: it loses its hint (no early
    ``turn/start``, ``early_start.py``). A lost connection is logged and opened again within a second;
    wakes sent meanwhile are lost, which costs only time (the Celery messages run those turns), so a
    reconnect re-reads nothing: it only sets ``listening`` again (the heartbeat's ``wakeable``).
    ``run`` must not raise; if it does, it is logged."""

    def __init__(self, queue: str, run: Callable[[uuid.UUID, str, WakeHint | None], object]) -> None:
        self.queue, self.channel, self.run = queue, routing.wake_channel(queue), run
        self._ran_until = float("-inf")
        self._ran_for = 0.0  # seconds the last ``run`` took
        self._listener = Listener(self.channel, name="hermes-wake", on_notify=self._notified,
                                  on_connect=self._connected)
        #: Set while the LISTEN is in place (tests wait for it).
        self.listening = self._listener.listening

    def start(self) -> None:
        # long_lived: it may spawn kept app-servers; at its end it closes the Django connection its turns
        # used (looked up on that thread: Django's connections are per thread).
        self._listener.start(long_lived=True, at_exit=lambda: connection.close())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop listening and wait for the thread (``timeout`` seconds at most; a turn it is running
        has its own deadline). A no-op from the listener's own thread."""
        self._listener.stop(timeout)

    @property
    def stopping(self) -> bool:
        return self._listener.stopping

    def is_alive(self) -> bool:
        return self._listener.is_alive()

    @property
    def connects(self) -> int:
        """Connects of its LISTEN so far (1 once listening, one more per reconnect)."""
        return self._listener.connects

    def _connected(self) -> None:
        self._ran_until = float("-inf")

    def _notified(self, payload: str) -> None:
        # Handed over at once after a slow run of the last wake (a wait for a permit): it arrived while that
        # ran, so it is not fresh whatever its clock says (another host's clock may be off): no hint. A quick
        # hand-off (well under a millisecond) makes nobody wait.
        started = time.monotonic()
        behind = started - self._ran_until < QUEUED_BEHIND_SECONDS and self._ran_for >= QUEUED_BEHIND_SECONDS
        self._woken(payload, queued_behind=behind)
        self._ran_until = time.monotonic()
        self._ran_for = self._ran_until - started

    def _woken(self, payload: str, *, queued_behind: bool = False) -> None:
        mark("wake.received", payload.partition(" ")[0])
        parsed = routing.parse_payload(payload)
        if parsed is None:
            logger.warning("wake: ignoring payload %r on %s", payload[:100], self.channel)
            return
        if queued_behind:
            parsed = (parsed[0], parsed[1], None)
        try:
            self.run(*parsed)
        except Exception:  # noqa: BLE001 — the Celery delivery still runs the turn
            logger.exception("wake: turn %s could not be run from its wake-up; its Celery delivery will", parsed[0])


def in_long_lived_thread() -> bool:
    """Whether this thread lives as long as its process (the main thread, a runner, a ``WakeListener``, the
    scheduler's): only
    such a thread may spawn app-servers that outlive the turn, as ``PR_SET_PDEATHSIG`` kills a child
    when the thread that spawned it ends (``codex/launch.py``)."""
    current = threading.current_thread()
    return current is threading.main_thread() or bool(getattr(current, "hermes_long_lived", False))


def wake_start(queue: str, run: Callable[[uuid.UUID, str, WakeHint | None], object]) -> WakeListener | None:
    """Start this process's ``WakeListener`` for route ``queue`` once (``process.runtime().listener``);
    ``None`` when ``queue`` is empty."""
    if not queue:
        return None
    rt = runtime()
    with rt.lock:
        if rt.listener is None:
            listener = WakeListener(queue, run)
            listener.start()
            rt.listener = listener
        return rt.listener


def wake_listening_now() -> bool:
    """Whether this process's ``WakeListener`` has its ``LISTEN`` in place now (the heartbeat's
    ``TurnWorker.wakeable``)."""
    listener = runtime().listener
    return listener is not None and listener.listening.is_set()


def wake_listening() -> bool:
    """Whether this process has a running ``WakeListener`` (its deliveries may find turns already run)."""
    return runtime().listener is not None


def wake_stop(*, turn_timeout: float) -> None:
    """Worker shutdown: stop this process's listener (no more wakes), then wait (``turn_timeout`` seconds at
    most) until every permit is free — every woken turn ended or parked —, so the app-servers are closed after
    them, not under them (parked ones: ``runners.runners_stop``)."""
    rt = runtime()
    with rt.lock:
        listener, rt.listener = rt.listener, None
    if listener is None:
        return
    listener.stop()
    left = turn_slots().drain(timeout=turn_timeout)
    if left:
        logger.warning("wake: %d woken turn(s) still run after %.0f s at shutdown; their leases bring them back",
                       left, turn_timeout)
