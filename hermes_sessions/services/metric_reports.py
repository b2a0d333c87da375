"""The only writer of ``MetricReport``: a process's report of what it counted, and the fold of the
reports of processes gone long ago into one ``retired`` total (``hermes_sessions/metrics/``).

A report holds cumulative counts, so writing it again is harmless and a lost write costs nothing the
next one does not carry; the sum over all rows only grows while processes run, stop and are folded.
"""
from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from ..metrics.families import Samples, samples_sum
from ..models import MetricReport

#: ``MetricReport.process`` of the folded total of gone processes.
RETIRED = "retired"


def metric_report_write(*, process: str, role: str, worker: str, started_at: datetime, counters: Samples,
                        gauges: Samples) -> None:
    """Upsert process ``process``'s report with ``reported_at`` = now. One ``UPDATE`` (an ``INSERT`` the
    first time); no transaction held. Raises the database's error."""
    now = timezone.now()
    fields = {"role": role[:16], "worker": worker[:255], "reported_at": now, "counters": counters, "gauges": gauges}
    if MetricReport.objects.filter(pk=process).update(**fields):
        return
    MetricReport.objects.bulk_create([MetricReport(process=process, started_at=started_at, **fields)],
                                     ignore_conflicts=True)


def metric_reports_retire(*, older_than: datetime) -> int:
    """Fold the counters of every report last written before ``older_than`` (processes gone: a live one
    writes every ``HERMES_METRICS_REPORT_SECONDS``) into the ``retired`` row and delete them, in one
    transaction, so the sums ``GET /metrics`` serves do not change and the table stays as small as the
    number of live processes. Returns how many were folded. Concurrent callers: the ``retired`` row's
    lock serializes them; rows another caller holds are skipped."""
    with transaction.atomic():
        retired, _ = MetricReport.objects.select_for_update().get_or_create(
            pk=RETIRED, defaults={"role": RETIRED, "started_at": timezone.now(), "reported_at": timezone.now()})
        gone = list(MetricReport.objects.select_for_update(skip_locked=True)
                    .filter(reported_at__lt=older_than).exclude(pk=RETIRED).values_list("pk", "counters"))
        if not gone:
            return 0
        retired.counters = samples_sum(retired.counters, *(counters for _, counters in gone))
        retired.gauges = []
        retired.save(update_fields=["counters", "gauges"])
        MetricReport.objects.filter(pk__in=[pk for pk, _ in gone]).delete()
    return len(gone)
