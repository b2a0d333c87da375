"""The scrape: every family of ``families.py`` built from PostgreSQL, whichever process answers.

``HermesCollector.collect()`` runs three statements — the state counts (``selectors.metrics_state``:
two) and the processes' reports (``selectors.metric_reports``: one) — and yields prometheus-client
families for ``generate_latest``. Counters and histograms are the sums of every report (of live
processes, stopped ones and the ``retired`` fold); gauges of a process count only while its report is
fresher than three ``HERMES_METRICS_REPORT_SECONDS`` (a process killed without a last report stops
counting then). The labels ``known`` to a family are always served, as 0 until counted.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .. import selectors
from .families import FAMILIES, Family, Samples, family_of, samples_sum

#: Report roles ``hermes_metric_reports`` counts (``retired`` is the fold, no process).
ROLES = ("api", "worker", "other")


def _fresh_after(now: datetime) -> datetime:
    interval = float(settings.HERMES_METRICS_REPORT_SECONDS) or 5.0
    return now - timedelta(seconds=3 * interval)


class HermesCollector(Collector):
    """Every hermes metric, read at collect time (see the module docstring)."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        state = selectors.metrics_state(
            turn_queue=settings.HERMES_TURN_QUEUE,
            fresh_after=now - timedelta(seconds=float(settings.HERMES_WORKER_STALE_SECONDS)))
        reports = selectors.metric_reports()
        fresh = _fresh_after(now)
        counters = samples_sum(*(counters for _, _, _, counters, _ in reports))
        gauges: Samples = []
        reporting = dict.fromkeys(ROLES, 0)
        for role, worker, reported_at, _, process_gauges in reports:
            if reported_at < fresh or role not in reporting:
                continue
            reporting[role] += 1
            for name, labels, value in process_gauges:
                gauges.append([name, {**labels, "worker": worker} if "worker" in _labels(name) else labels, value])
        gauges = samples_sum(gauges)

        queues = state.queues or [(settings.HERMES_TURN_QUEUE, 0, 0.0)]
        database: dict[str, Samples] = {
            "hermes_turns": [["hermes_turns", {"status": "queued"}, state.queued],
                             ["hermes_turns", {"status": "running"}, state.running]],
            "hermes_turn_queue_depth": [["hermes_turn_queue_depth", {"queue": q}, n] for q, n, _ in queues],
            "hermes_turn_queue_oldest_age_seconds": [
                ["hermes_turn_queue_oldest_age_seconds", {"queue": q}, age] for q, _, age in queues],
            "hermes_leases_expired": [["hermes_leases_expired", {}, state.leases_expired]],
            "hermes_notices_unacknowledged": [["hermes_notices_unacknowledged", {}, state.notices_unacknowledged]],
            "hermes_approvals_pending": [["hermes_approvals_pending", {}, state.approvals_pending]],
            "hermes_turn_workers": [["hermes_turn_workers", {}, state.turn_workers]],
            "hermes_warm_threads": [["hermes_warm_threads", {}, state.warm_threads]],
            "hermes_metric_reports": [["hermes_metric_reports", {"role": r}, n] for r, n in reporting.items()],
        }
        for family in FAMILIES:
            if family.source == "database":
                samples = database[family.name]
            else:
                names = family.sample_names()
                samples = [s for s in (gauges if family.kind == "gauge" else counters) if s[0] in names]
            yield _metric(family, samples)


def _labels(sample_name: str) -> tuple[str, ...]:
    family = family_of(sample_name)
    return family.labels if family is not None else ()


def _metric(family: Family, samples: Samples) -> Metric:
    """``family`` as prometheus-client's ``Metric``, with ``samples`` and a zero for each ``known`` label
    set not among them; a histogram's buckets in ascending order, per label set, then count and sum."""
    metric = Metric(family.name, family.help, family.kind)
    found = {(name, tuple(sorted(labels.items()))) for name, labels, _ in samples}
    for values in family.known or (((),) if not family.labels else ()):
        labels = dict(zip(family.labels, values, strict=True))
        for name, extra in _zero_samples(family):
            key = (name, tuple(sorted({**labels, **extra}.items())))
            if key not in found:
                samples.append([name, {**labels, **extra}, 0.0])
    for name, labels, value in _ordered(family, samples):
        metric.add_sample(name, labels, float(value))
    return metric


def _zero_samples(family: Family) -> Iterable[tuple[str, dict[str, str]]]:
    if family.kind != "histogram":
        yield family.sample_names()[0], {}
        return
    for bound in (*family.buckets, float("inf")):
        yield f"{family.name}_bucket", {"le": _le(bound)}
    yield f"{family.name}_count", {}
    yield f"{family.name}_sum", {}


def _le(bound: float) -> str:
    """A bucket's bound as prometheus-client writes it (``0.005``, ``1.0``, ``+Inf``)."""
    return floatToGoString(bound)


def _ordered(family: Family, samples: Samples) -> list[list]:
    """Samples grouped by label set (sorted); within a histogram's group: buckets by bound, count, sum.
    A report's bucket bound this version does not have (the buckets changed) is left out: it would
    break the histogram's cumulative order."""
    bounds = {_le(b) for b in (*family.buckets, float("inf"))}

    def key(sample: list) -> tuple:
        name, labels, _ = sample
        group = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if family.kind != "histogram":
            return (group, 0, 0.0)
        if name.endswith("_bucket"):
            return (group, 0, float(labels["le"]))
        return (group, 1 if name.endswith("_count") else 2, 0.0)

    kept = [s for s in samples if family.kind != "histogram" or not s[0].endswith("_bucket") or s[1].get("le") in bounds]
    return sorted(kept, key=key)
