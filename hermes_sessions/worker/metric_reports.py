"""A worker process's metric report: a job on its scheduler every ``HERMES_METRICS_REPORT_SECONDS``
writes what the process counted (``metrics.process.report``) with the gauges only it knows — the
app-servers it keeps with a thread loaded, its spares and their memory (``warm/process_memory.py``), its
parked turns — and a last
report at its stop. One statement per interval, no transaction held; marked slow (the memory read walks
the app-servers' page tables, ~1 ms each), so it never delays an early-start pause.
"""
from __future__ import annotations

import logging
import os
import socket

from django.conf import settings
from django.db import close_old_connections

from ..metrics.families import Samples
from ..metrics.process import report, reported_by_scheduler
from ..services import routing
from .process import runtime
from .runners import parked_count
from .warm.process_memory import Memory, tree_memory

logger = logging.getLogger(__name__)


def worker_name() -> str:
    """The ``worker`` label of this process's gauges: its route, or ``<host>:<pid>`` without one."""
    return routing.own_route() or f"{socket.gethostname()}:{os.getpid()}"


def worker_gauges() -> Samples:
    """This process's kept threads, spares and their memory (bytes, uss and pss), and its parked turns
    (``runners.py``), as gauge samples."""
    rt = runtime()
    kept = rt.keeper.pids() if rt.keeper is not None else []
    spares = rt.spares.pids() if rt.spares is not None else []
    samples: Samples = [["hermes_worker_kept_threads", {}, len(kept)], ["hermes_worker_spares", {}, len(spares)],
                        ["hermes_worker_parked_turns", {}, parked_count()]]
    for holder, pids in (("kept", kept), ("spare", spares)):
        memory = sum((tree_memory(pid) for pid in pids), Memory())
        samples += [["hermes_worker_codex_memory_bytes", {"holder": holder, "measure": "uss"}, memory.private_kb * 1024],
                    ["hermes_worker_codex_memory_bytes", {"holder": holder, "measure": "pss"}, memory.pss_kb * 1024]]
    return samples


def report_now(*, final: bool = False) -> None:
    """Write this process's report now (the job's round; ``final`` at the process's stop). A database
    error is logged: the next round writes the same cumulative counts."""
    try:
        close_old_connections()
        report(role="worker", worker=worker_name(), gauges=[] if final else worker_gauges(), final=final)
    except Exception:  # noqa: BLE001 — a lost report costs nothing the next one does not carry
        logger.warning("metrics: could not write this worker process's report", exc_info=True)


def metric_reports_start() -> None:
    """Report every ``HERMES_METRICS_REPORT_SECONDS`` from this process's scheduler (0: never)."""
    interval = float(settings.HERMES_METRICS_REPORT_SECONDS)
    rt = runtime()
    with rt.lock:
        if interval <= 0 or rt.metric_reports is not None:
            return
        reported_by_scheduler()
        rt.metric_reports = rt.scheduler.every(interval, report_now, name="metrics: report", first_after=interval,
                                               slow=True)


def metric_reports_stop() -> None:
    """The process stops: end the job and write the last report (its gauges no longer count)."""
    rt = runtime()
    with rt.lock:
        job, rt.metric_reports = rt.metric_reports, None
    if job is None:
        return
    rt.scheduler.cancel(job, wait=5.0)
    report_now(final=True)
