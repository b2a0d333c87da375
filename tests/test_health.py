"""The probes in-process (``hermes_sessions/health.py``, ``manage.py health``): what each check says about
the rows and settings it reads. The production shape with pieces stopped: ``tests/e2e/test_readiness.py``."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from hermes_sessions import health
from hermes_sessions.models import WorkerHealth
from hermes_sessions.services.worker_health import worker_health_beat, worker_health_forget, worker_sandbox_record


def _checks(**kwargs) -> dict[str, health.Check]:
    return {c.name: c for c in health.readiness(**kwargs)}


def test_healthz_answers_without_touching_the_database(client):
    response = client.get("/healthz")  # no django_db mark: any database access would raise
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert "no-cache" in response["Cache-Control"]


@pytest.mark.django_db(transaction=True)  # the checks read on a connection of their own
def test_readyz_is_ready_with_a_fresh_worker_whose_sandbox_passed(client, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    worker_sandbox_record(node="w1@host", ok=True, reason="ok")
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "ready" and list(body["checks"]) == list(health.CHECKS)
    assert "w1@host" in body["checks"]["workers"]["reason"]


@pytest.mark.django_db(transaction=True)
def test_a_stale_heartbeat_fails_workers_naming_the_last_one(client, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    worker_health_beat(node="w1@host")
    WorkerHealth.objects.update(heartbeat_at=timezone.now() - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS + 1))
    response = client.get("/readyz")
    assert response.status_code == 503
    workers = response.json()["checks"]["workers"]
    assert workers["status"] == "failed" and "last heard of: w1@host" in workers["reason"]


@pytest.mark.django_db(transaction=True)
def test_sandbox_fails_when_no_fresh_worker_passed_and_names_the_failing_ones(settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    worker_sandbox_record(node="w1@a", ok=False, reason="bwrap: No permissions to create new namespace")
    worker_health_beat(node="w2@b")  # not reported yet
    checks = _checks()
    assert checks["workers"].ok and not checks["sandbox"].ok
    assert "w1@a: bwrap: No permissions" in checks["sandbox"].reason and "w2@b" in checks["sandbox"].reason
    worker_sandbox_record(node="w2@b", ok=True, reason="ok")
    checks = _checks()
    assert checks["sandbox"].ok and "w1@a: bwrap" in checks["sandbox"].reason  # one passes: ready, the other named
    assert not _checks(node="w1@a")["sandbox"].ok  # manage.py health --node on w1's host
    worker_health_forget(node="w2@b")
    assert not _checks()["sandbox"].ok


@pytest.mark.django_db(transaction=True)
def test_an_unapplied_migration_fails_migrations(monkeypatch, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = True  # no worker needed: only migrations may fail
    assert _checks()["migrations"].ok
    on_disk = health._disk_migrations()
    monkeypatch.setattr(health, "_disk_migrations", lambda: (*on_disk, (("hermes_sessions", "9999_future"), ())))
    checks = _checks()
    assert not checks["migrations"].ok and "hermes_sessions.9999_future" in checks["migrations"].reason
    assert [c.name for c in checks.values() if not c.ok] == ["migrations"]


def test_reasons_carry_no_password(settings):
    settings.CELERY_BROKER_URL = "redis://:brokersecret@10.0.0.1:6379/0"
    settings.DATABASES["default"]["PASSWORD"] = "dbsecret"
    text = health.redact("failed: amqp://user:pw@h/v and postgres://u:dbsecret@h/db, password dbsecret; brokersecret")
    assert "pw@" not in text and "dbsecret" not in text and "brokersecret" not in text
    assert "amqp://***@h/v" in text


@pytest.mark.django_db(transaction=True)
def test_the_command_prints_a_line_per_check_and_exits_1_when_one_fails(capsys, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    with pytest.raises(SystemExit) as exited:
        call_command("health")
    assert exited.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" ", 2)[:2] for ln in lines] == [
        ["database", "ok:"], ["migrations", "ok:"], ["broker", "ok:"], ["workers", "failed:"], ["sandbox", "failed:"]]
    worker_sandbox_record(node="w1@host", ok=True, reason="ok")
    call_command("health", "--json", "--node", "w1@host")
    assert json.loads(capsys.readouterr().out)["status"] == "ready"
