"""GET /metrics on PostgreSQL: the state read at the scrape, the processes' reports summed, who may read
it, and the process side's counts (only what committed)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from hermes_sessions.metrics import process
from hermes_sessions.metrics.collector import HermesCollector
from hermes_sessions.metrics.families import FAMILIES, sample_names
from hermes_sessions.models import MetricReport, Turn, TurnWorker, WarmThread
from hermes_sessions.services.metric_reports import RETIRED, metric_report_write, metric_reports_retire
from hermes_sessions.services.turn_log import turn_ended_on_commit
from tests.factories import ApprovalFactory, NoticeFactory, SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db


def scrape(client: APIClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` parsed with prometheus-client's parser: ``{(sample, sorted labels): value}``."""
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/plain; version=0.0.4")
    found = {}
    for family in text_string_to_metric_families(resp.content.decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory(is_staff=True)).key}")
    return client


def test_state_is_read_from_postgresql_at_the_scrape(staff, settings):
    settings.HERMES_TURN_QUEUE = "turns-m"
    now = timezone.now()
    held = SessionFactory()
    TurnWorker.objects.create(queue="turns-m.w1@h", node="w1@h", heartbeat_at=now)
    TurnWorker.objects.create(queue="turns-m.w2@h", node="w2@h", heartbeat_at=now - timedelta(minutes=5))  # stale
    WarmThread.objects.create(session=held, queue="turns-m.w1@h", thread_id="t", generation=1,
                              until=now + timedelta(minutes=1))
    TurnFactory(session=held, status=Turn.Status.QUEUED)
    old = TurnFactory(status=Turn.Status.QUEUED)
    Turn.objects.filter(pk=old.pk).update(created_at=now - timedelta(seconds=90))
    TurnFactory(status=Turn.Status.RUNNING, lease_expires_at=now + timedelta(seconds=30))
    running = TurnFactory(status=Turn.Status.RUNNING, lease_expires_at=now - timedelta(seconds=5))
    TurnFactory(status=Turn.Status.SUCCEEDED)
    NoticeFactory()
    NoticeFactory(acknowledged_at=now)
    ApprovalFactory(turn=running)

    m = scrape(staff)
    assert m[("hermes_turns", (("status", "queued"),))] == 2
    assert m[("hermes_turns", (("status", "running"),))] == 2
    assert m[("hermes_leases_expired", ())] == 1
    assert m[("hermes_notices_unacknowledged", ())] == 1
    assert m[("hermes_approvals_pending", ())] == 1
    assert m[("hermes_turn_workers", ())] == 1
    assert m[("hermes_warm_threads", ())] == 1
    assert m[("hermes_turn_queue_depth", (("queue", "turns-m"),))] == 1
    assert m[("hermes_turn_queue_depth", (("queue", "turns-m.w1@h"),))] == 1
    assert 89 < m[("hermes_turn_queue_oldest_age_seconds", (("queue", "turns-m"),))] < 150
    # Nothing counted yet: the known series are there, at 0.
    assert m[("hermes_turns_ended_total", (("status", "succeeded"), ("thread_action", "resumed")))] == 0
    assert m[("hermes_turn_phase_seconds_count", (("phase", "codex"),))] == 0


def _report(name: str, *, ended: float, bucket: float, gauges: list, reported_ago: float = 0.0, worker: str = "") -> None:
    counters = [
        ["hermes_turns_ended_total", {"status": "succeeded", "thread_action": "resumed"}, ended],
        ["hermes_turn_duration_seconds_bucket", {"le": "1.0"}, bucket],
        ["hermes_turn_duration_seconds_bucket", {"le": "+Inf"}, ended],
        ["hermes_turn_duration_seconds_count", {}, ended],
        ["hermes_turn_duration_seconds_sum", {}, ended * 0.7],
    ]
    metric_report_write(process=name, role="worker", worker=worker or name, started_at=timezone.now(),
                        counters=counters, gauges=gauges)
    MetricReport.objects.filter(pk=name).update(reported_at=timezone.now() - timedelta(seconds=reported_ago))


def test_reports_are_summed_and_only_fresh_gauges_count(staff, settings):
    settings.HERMES_METRICS_REPORT_SECONDS = 5
    _report("h:1:1", ended=3, bucket=2, worker="turns.w1@h",
            gauges=[["hermes_worker_kept_threads", {}, 2], ["hermes_event_stream_clients", {"stream": "turn"}, 1]])
    _report("h:2:1", ended=4, bucket=4, worker="turns.w2@h", gauges=[["hermes_worker_kept_threads", {}, 1]])
    _report("h:3:1", ended=10, bucket=1, reported_ago=60, worker="turns.w3@h",
            gauges=[["hermes_worker_kept_threads", {}, 7]])  # gone: its counts stay, its gauges do not

    m = scrape(staff)
    assert m[("hermes_turns_ended_total", (("status", "succeeded"), ("thread_action", "resumed")))] == 17
    assert m[("hermes_turn_duration_seconds_bucket", (("le", "1.0"),))] == 7
    assert m[("hermes_turn_duration_seconds_count", ())] == 17
    assert m[("hermes_worker_kept_threads", (("worker", "turns.w1@h"),))] == 2
    assert m[("hermes_worker_kept_threads", (("worker", "turns.w2@h"),))] == 1
    assert ("hermes_worker_kept_threads", (("worker", "turns.w3@h"),)) not in m
    assert m[("hermes_event_stream_clients", (("stream", "turn"),))] == 1
    assert m[("hermes_metric_reports", (("role", "worker"),))] == 2

    # Folding gone reports into the retired total changes no sum.
    assert metric_reports_retire(older_than=timezone.now() - timedelta(seconds=30)) == 1
    assert set(MetricReport.objects.values_list("pk", flat=True)) == {"h:1:1", "h:2:1", RETIRED}
    assert scrape(staff) == m
    assert metric_reports_retire(older_than=timezone.now() - timedelta(seconds=30)) == 0


def test_a_turn_end_counts_once_it_commits_and_never_when_rolled_back(settings, django_capture_on_commit_callbacks):
    settings.HERMES_METRICS_REPORT_SECONDS = 0  # no report thread in the test process
    key = ("hermes_turns_ended_total", (("status", "failed"), ("thread_action", "rotated")))

    def ended() -> float:
        return {(n, tuple(sorted(labels.items()))): v for n, labels, v in process.snapshot()[0]}.get(key, 0.0)

    now = timezone.now()
    turn = TurnFactory(status=Turn.Status.FAILED, thread_action="rotated", started_at=now - timedelta(seconds=2),
                       finished_at=now, timings={"claim_ms": 3, "restore_ms": 40, "turn_ms": 1500})
    before = ended()
    with pytest.raises(RuntimeError), transaction.atomic():
        turn_ended_on_commit(turn)
        raise RuntimeError("rolled back")
    assert ended() == before
    with django_capture_on_commit_callbacks(execute=True):  # the test's transaction stands for the commit
        turn_ended_on_commit(turn)
        assert ended() == before  # not before the commit
    assert ended() == before + 1
    end = process.TurnEnd.of(turn)
    assert end.duration == pytest.approx(2.0) and end.codex == pytest.approx(1.5)
    assert end.claim_restore == pytest.approx(0.043)


def test_only_staff_and_allowed_addresses_read_metrics(staff):
    anonymous = APIClient()
    resp = anonymous.get("/metrics")
    assert resp.status_code == 401 and resp.json()["code"] == "not_authenticated"
    user = APIClient()
    user.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory()).key}")
    resp = user.get("/metrics")
    assert resp.status_code == 403 and "HERMES_METRICS_ALLOW" in resp.json()["detail"]
    assert staff.get("/metrics", HTTP_ACCEPT="text/plain").status_code == 200  # whatever Accept says
    with override_settings(HERMES_METRICS_ALLOW=["127.0.0.0/8"]):
        assert anonymous.get("/metrics").status_code == 200  # the test client's REMOTE_ADDR is 127.0.0.1
        assert anonymous.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 401
    with override_settings(HERMES_METRICS_ALLOW=["10.0.0.0/8"]):
        assert anonymous.get("/metrics").status_code == 401


def test_every_family_is_served_and_parsed(staff):
    served = {name for name, _ in scrape(staff)}
    # Families without a known label set (a worker's gauges) appear once a worker reports.
    expected = {n for f in FAMILIES if f.known or not f.labels for n in f.sample_names()}
    assert expected <= served <= sample_names()


def test_collector_reads_in_three_statements(django_assert_num_queries):
    with django_assert_num_queries(3):
        list(HermesCollector().collect())
