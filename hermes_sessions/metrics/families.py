"""Every metric ``GET /metrics`` serves: its name, type, help text, labels and where its figure comes from.

One table, read by the process side (``process.py`` builds its registry from the ``PROCESS`` families),
the scrape side (``collector.py``), the docs (``docs/operating.md`` §11 lists the same names) and the
tests (``tests/metrics/test_families.py``: the docs and the Grafana dashboard name only metrics listed
here). Two sources:

* ``database``: state, computed from PostgreSQL at each scrape (right whichever process answers);
* ``process``: events a process counted in memory (counters, histograms) and gauges only a process
  knows (its open event streams, the app-servers it keeps), written to PostgreSQL by that process as a
  ``MetricReport`` and summed over every process at the scrape.

Sample lists (``Samples``) are ``[[sample name, {label: value}, value], …]``, the shape a report stores.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Samples = list[list]  # [[sample name, {label: value}, value], …] (JSON as stored in MetricReport)

#: Seconds: an echo turn on a loaded thread takes ~0.1 s, a real model's minutes (CODEX_TURN_TIMEOUT 600).
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Seconds: a claim is a few ms, a restore tens of ms, codex's part up to the turn's timeout.
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)

TURN_STATUSES = ("succeeded", "failed", "cancelled")
THREAD_ACTIONS = ("started", "resumed", "rotated", "none")  # "none": the turn ended before codex ran it
PHASES = ("queue", "claim_restore", "codex", "finalize")


@dataclass(frozen=True)
class Family:
    """One metric. ``name`` is the family's name (a counter's samples add ``_total``, a histogram's
    ``_bucket``/``_count``/``_sum``); ``known``: label values always served, as 0 before anything was
    counted, so that a dashboard's ``rate()`` has a series from the start."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    source: Literal["database", "process"]
    help: str
    labels: tuple[str, ...] = ()
    known: tuple[tuple[str, ...], ...] = ()
    buckets: tuple[float, ...] = ()

    def sample_names(self) -> tuple[str, ...]:
        """The names its samples carry in the text format."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


FAMILIES: tuple[Family, ...] = (
    # --- from PostgreSQL at the scrape -----------------------------------------------------------
    Family("hermes_turns", "gauge", "database", "Turns queued or running now.",
           ("status",), (("queued",), ("running",))),
    Family("hermes_turn_queue_depth", "gauge", "database",
           "Queued turns by the queue they go to: the route of the worker keeping their session's thread "
           "loaded (fresh heartbeat, open window), else HERMES_TURN_QUEUE.", ("queue",)),
    Family("hermes_turn_queue_oldest_age_seconds", "gauge", "database",
           "Age of the oldest queued turn per queue (0 when none waits).", ("queue",)),
    Family("hermes_leases_expired", "gauge", "database",
           "Running turns whose lease expired and that no sweep has taken back yet."),
    Family("hermes_notices_unacknowledged", "gauge", "database", "Notices no operator acknowledged."),
    Family("hermes_approvals_pending", "gauge", "database", "Approvals waiting for a person."),
    Family("hermes_turn_workers", "gauge", "database",
           "Workers keeping threads loaded whose heartbeat is fresher than HERMES_WORKER_STALE_SECONDS."),
    Family("hermes_warm_threads", "gauge", "database",
           "Sessions whose thread a worker keeps loaded (WarmThread rows with an open window)."),
    Family("hermes_metric_reports", "gauge", "database",
           "Processes whose metric report is fresh (within 3 x HERMES_METRICS_REPORT_SECONDS), by role.",
           ("role",), (("api",), ("worker",))),
    # --- counted by the processes, summed over their reports ----------------------------------------
    Family("hermes_turns_ended", "counter", "process",
           "Turns that reached succeeded, failed or cancelled (counted when that end committed).",
           ("status", "thread_action"), tuple((s, a) for s in TURN_STATUSES for a in THREAD_ACTIONS)),
    Family("hermes_turn_duration_seconds", "histogram", "process",
           "Ended turns' run time: claim to the commit of their end (started_at to finished_at).",
           buckets=DURATION_BUCKETS),
    Family("hermes_turn_phase_seconds", "histogram", "process",
           "Ended turns' phases: queue (created to last claim), claim_restore (claim, kept-thread lookup, "
           "home restore, app-server start, thread/resume or thread/start), codex (turn/start to "
           "turn/completed), finalize (the worker's end-of-turn transaction).",
           ("phase",), tuple((p,) for p in PHASES), PHASE_BUCKETS),
    Family("hermes_thread_rotations", "counter", "process",
           "Codex threads found gone and replaced by a fresh seeded thread (each with one notice)."),
    Family("hermes_lease_take_backs", "counter", "process",
           "Running turns taken back after their lease expired: requeued, or failed past HERMES_MAX_ATTEMPTS.",
           ("outcome",), (("requeued",), ("failed",))),
    Family("hermes_turn_retries", "counter", "process",
           "Retries of a retryable codex failure: within the claim (same_claim) or back to the queue "
           "once the claim's retry budget was spent (requeued).",
           ("how",), (("same_claim",), ("requeued",))),
    Family("hermes_event_stream_clients", "gauge", "process",
           "Open server-sent event streams, summed over the API processes.",
           ("stream",), (("turn",), ("session",))),
    Family("hermes_worker_kept_threads", "gauge", "process",
           "App-servers a worker process keeps with a session's thread loaded.", ("worker",)),
    Family("hermes_worker_spares", "gauge", "process",
           "Spare app-servers a worker process keeps started (HERMES_WARM_POOL).", ("worker",)),
    Family("hermes_worker_parked_turns", "gauge", "process",
           "Turns of a worker process parked while they wait for a person (HERMES_MAX_PARKED_TURNS).", ("worker",)),
    Family("hermes_worker_codex_memory_bytes", "gauge", "process",
           "Memory of a worker process's kept and spare app-servers with their child processes "
           "(/proc/<pid>/smaps_rollup): uss = Private_Clean + Private_Dirty, pss = Pss.",
           ("worker", "holder", "measure")),
)

BY_NAME = {family.name: family for family in FAMILIES}


def sample_names() -> set[str]:
    """Every sample name ``GET /metrics`` can serve."""
    return {name for family in FAMILIES for name in family.sample_names()}


def family_of(sample_name: str) -> Family | None:
    """The family a sample name belongs to (``hermes_turns_ended_total`` → ``hermes_turns_ended``)."""
    for suffix in ("_total", "_bucket", "_count", "_sum", ""):
        family = BY_NAME.get(sample_name.removesuffix(suffix) if suffix else sample_name)
        if family is not None and sample_name in family.sample_names():
            return family
    return None


def samples_sum(*lists: Iterable[list]) -> Samples:
    """The sum of sample lists, value by value per ``(sample name, labels)``; order of first sight."""
    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for samples in lists:
        for name, labels, value in samples:
            key = (name, tuple(sorted(labels.items())))
            total[key] = total.get(key, 0.0) + float(value)
    return [[name, dict(labels), value] for (name, labels), value in total.items()]
