"""What this process counts, in memory, and its report to PostgreSQL.

The code that sees an event calls one function here (``turn_ended``, ``phase_observed``,
``thread_rotated``, ``lease_taken_back``, ``turn_retried``, ``stream_opened``/``stream_closed``): an
in-memory increment (prometheus-client's metric objects on a registry of this process's own), never a
database round trip, so the warm turn's path pays microseconds. Every
``HERMES_METRICS_REPORT_SECONDS`` the process writes everything it counted since it started, and its
gauges, as one ``MetricReport`` row (``report()``; ``services.metric_report_write``): a worker process
from its scheduler (``worker/metric_reports.py``), any other process (the API, the demo) from a daemon
thread started at its first count (``hermes-metrics-report``); at a clean stop a last report. A process
killed between two reports loses at most that interval's counts; nothing counted twice.

The counts belong to one process's life: after a fork the child starts from zero under a new report
name (``_counts()``), so a forked process never reports its parent's counts again.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connections
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .families import BY_NAME, Samples

logger = logging.getLogger(__name__)


def _counter(registry: CollectorRegistry, name: str) -> Counter:
    family = BY_NAME[name]
    return Counter(name, family.help, family.labels, registry=registry)


def _histogram(registry: CollectorRegistry, name: str) -> Histogram:
    family = BY_NAME[name]
    return Histogram(name, family.help, family.labels, registry=registry, buckets=family.buckets)


@dataclass(eq=False)
class _Counts:
    """One process's metric objects and report identity."""

    pid: int
    started_at: datetime = field(default_factory=timezone.now)
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=False))
    driver: str = ""  # "" none yet, "thread", "scheduler" (a worker process: worker/metric_reports.py)
    lock: threading.Lock = field(default_factory=threading.Lock)
    retire_due: float = 0.0  # monotonic: when this process next folds the reports of gone processes

    def __post_init__(self) -> None:
        r = self.registry
        self.turns_ended = _counter(r, "hermes_turns_ended")
        self.duration = _histogram(r, "hermes_turn_duration_seconds")
        self.phase = _histogram(r, "hermes_turn_phase_seconds")
        self.rotations = _counter(r, "hermes_thread_rotations")
        self.take_backs = _counter(r, "hermes_lease_take_backs")
        self.retries = _counter(r, "hermes_turn_retries")
        family = BY_NAME["hermes_event_stream_clients"]
        self.streams = Gauge(family.name, family.help, family.labels, registry=r)
        self.process = f"{socket.gethostname()[:200]}:{self.pid}:{int(self.started_at.timestamp() * 1000)}"


_state: _Counts | None = None
_state_lock = threading.Lock()


def _counts() -> _Counts:
    """This process's counts (new ones after a fork: a child never reports its parent's counts)."""
    global _state
    current = _state
    if current is not None and current.pid == os.getpid():
        return current
    with _state_lock:
        if _state is None or _state.pid != os.getpid():
            _state = _Counts(pid=os.getpid())
        return _state


def _counted() -> _Counts:
    """``_counts()``, starting the report thread at a process's first count when nothing else reports."""
    counts = _counts()
    if not counts.driver and settings.HERMES_METRICS_REPORT_SECONDS > 0:
        _start_thread(counts)
    return counts


# --- what the code calls where it sees an event ---------------------------------------------------


@dataclass(frozen=True)
class TurnEnd:
    """A turn's end as the metrics read it (``of``): taken inside the transaction that ends the turn,
    counted (``turn_ended``) only once it committed. Durations in seconds, ``None`` when unknown."""

    status: str
    thread_action: str
    duration: float | None = None
    queue: float | None = None
    claim_restore: float | None = None
    codex: float | None = None

    @classmethod
    def of(cls, turn: Any) -> TurnEnd:
        """From a ``Turn``: status, thread action (``none`` before codex ran it), run time
        (``started_at`` → ``finished_at``), queue wait (``created_at`` → ``started_at``) and the phases of
        its ``timings`` (ms, docs/contract.md "A turn's timings")."""
        timings = turn.timings if isinstance(turn.timings, dict) else {}

        def ms(*keys: str) -> float | None:
            found = [timings[k] for k in keys if isinstance(timings.get(k), int | float)]
            return sum(found) / 1000 if found and keys[0] in timings else None

        started, finished, created = turn.started_at, turn.finished_at, turn.created_at
        return cls(
            status=str(turn.status), thread_action=str(turn.thread_action or "none"),
            duration=(finished - started).total_seconds() if started and finished else None,
            queue=(started - created).total_seconds() if started and created else None,
            claim_restore=ms("claim_ms", "take_kept_ms", "restore_ms", "initialize_ms", "thread_ms"),
            codex=ms("turn_ms"),
        )


def turn_ended(end: TurnEnd) -> None:
    """A turn's end committed (``services/turn_log.py`` calls it beside the turn-end log line)."""
    counts = _counted()
    counts.turns_ended.labels(end.status, end.thread_action).inc()
    if end.duration is not None:
        counts.duration.observe(max(end.duration, 0.0))
    for phase, seconds in (("queue", end.queue), ("claim_restore", end.claim_restore), ("codex", end.codex)):
        if seconds is not None:
            counts.phase.labels(phase).observe(max(seconds, 0.0))


def phase_observed(phase: str, seconds: float) -> None:
    """A phase measured where it ran (``finalize``: the worker's end-of-turn transaction)."""
    _counted().phase.labels(phase).observe(max(seconds, 0.0))


def thread_rotated() -> None:
    """A rotation committed (``services/bindings.py``: the binding ended and its notice written)."""
    _counted().rotations.inc()


def lease_taken_back(outcome: str) -> None:
    """``requeued`` or ``failed``: a turn taken back after its lease expired (``worker/recovery.py``)."""
    _counted().take_backs.labels(outcome).inc()


def turn_retried(how: str) -> None:
    """``same_claim``: a retry within the claim; ``requeued``: back to the queue (``worker/execution.py``)."""
    _counted().retries.labels(how).inc()


def stream_opened(stream: str) -> None:
    """An event stream (``turn`` or ``session``) started sending (``api/streams.py``)."""
    _counted().streams.labels(stream).inc()


def stream_closed(stream: str) -> None:
    """That stream ended."""
    _counted().streams.labels(stream).dec()


# --- the report ---------------------------------------------------------------------------------


def snapshot() -> tuple[Samples, Samples]:
    """``(counters, gauges)`` of this process now: counters' and histograms' cumulative samples, gauges'
    current ones (prometheus-client's ``_created`` samples left out: a start time does not add up)."""
    cumulative: Samples = []
    current: Samples = []
    for family in _counts().registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            row = [sample.name, dict(sample.labels), sample.value]
            (current if family.type == "gauge" else cumulative).append(row)
    return cumulative, current


def report(*, role: str, worker: str = "", gauges: Samples | None = None, final: bool = False) -> None:
    """Write this process's report (``services.metric_report_write``): its counters, and its gauges plus
    ``gauges`` (a worker's kept threads, spares and their memory); ``final``: the process stops, its gauges
    no longer count. Every ``HERMES_METRICS_RETIRE_SECONDS / 4`` also folds the reports of processes gone
    that long (``services.metric_reports_retire``). Raises the database's error."""
    from ..services.metric_reports import metric_report_write, metric_reports_retire

    counts = _counts()
    cumulative, current = snapshot()
    metric_report_write(process=counts.process, role=role, worker=worker or counts.process.rsplit(":", 1)[0],
                        started_at=counts.started_at, counters=cumulative,
                        gauges=[] if final else current + list(gauges or []))
    retire = float(settings.HERMES_METRICS_RETIRE_SECONDS)
    if retire > 0 and time.monotonic() >= counts.retire_due:
        counts.retire_due = time.monotonic() + retire / 4
        metric_reports_retire(older_than=timezone.now() - timedelta(seconds=retire))


def reported_by_scheduler() -> None:
    """A worker process reports from its scheduler (``worker/metric_reports.py``): no thread here."""
    _counts().driver = "scheduler"


def _start_thread(counts: _Counts) -> None:
    with counts.lock:
        if counts.driver:
            return
        counts.driver = "thread"
    thread = threading.Thread(target=_report_every, args=(float(settings.HERMES_METRICS_REPORT_SECONDS),),
                              name="hermes-metrics-report", daemon=True)
    thread.start()
    atexit.register(_report_once, final=True)


def _report_once(*, final: bool = False) -> None:
    try:
        report(role=_role(), final=final)
    except Exception:  # noqa: BLE001 — the next interval writes the same counts again
        logger.warning("metrics: could not write this process's report", exc_info=True)
    finally:
        _close_connections()


def _report_every(interval: float, *, sleep: Callable[[float], object] = time.sleep) -> None:
    while True:
        sleep(interval)
        _report_once()


def _role() -> str:
    """``api`` in a gunicorn process (the API), else ``other`` (a management command, the demo)."""
    return "api" if "gunicorn" in sys.modules else "other"


def _close_connections() -> None:
    """This thread's database connections go back (the pool's, under ASGI) or are closed."""
    close_old_connections()
    for conn in connections.all(initialized_only=True):
        conn.close()
