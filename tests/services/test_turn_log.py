"""The operator's log (issue 8 item 7): one INFO line per turn end from ``hermes_sessions.turns`` with
the turn, session, thread action, status, reason and the Celery task id; the sweep silent unless it acts.

Real runs through the task code (``run_turn`` sent eagerly, the scripted app-server as codex); caplog
records what the loggers emitted."""
import logging
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from hermes_sessions import services, worker
from hermes_sessions.models import IdempotencyKey, Turn
from hermes_sessions.services.turn_log import REASON_CHARS

pytestmark = pytest.mark.django_db(transaction=True)

TASK_ID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@pytest.fixture(autouse=True)
def fast_clock(settings):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    settings.HERMES_RETRY_DELAYS = (0.05,)


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.DEBUG, logger="hermes_sessions")
    return caplog


def end_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "hermes_sessions.turns"]


def test_a_succeeded_turn_logs_one_info_line_naming_everything(user, scripted_codex, run_turn_now, log):
    session = services.session_create(owner=user, session_id="sess-log")
    turn = run_turn_now(session=session, text="hello", user=user)
    assert turn.status == Turn.Status.SUCCEEDED
    [line] = end_lines(log)
    assert line.levelno == logging.INFO
    assert re.fullmatch(
        rf'turn {turn.id} ended status=succeeded session=sess-log thread_action=started attempt=1 task={TASK_ID} reason=""',
        line.getMessage(),
    ), line.getMessage()


def test_a_failed_turn_logs_its_reason_trimmed_and_the_task_id(user, scripted_codex, run_turn_now, log):
    long_reason = "the model said no\nbecause " + "x" * 1000
    scripted_codex.script({"turn/start": [{"turn_status": "failed", "turn_error": {"message": long_reason}}]})
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="hello", user=user)
    assert turn.status == Turn.Status.FAILED
    [line] = end_lines(log)
    message = line.getMessage()
    assert message.startswith(f"turn {turn.id} ended status=failed session={session.id} thread_action=started ")
    task_id = re.search(rf"task=({TASK_ID}) ", message).group(1)
    reason = message.split(" reason=", 1)[1]
    assert reason.startswith('"the model said no because xxx') and reason.endswith('…"')  # one line, cut
    assert len(reason) == REASON_CHARS + 2  # the quotes
    # The task id is the Celery task's: the same delivery run again by id finds nothing to do.
    from hermes_sessions.tasks import run_turn

    assert run_turn.apply(args=[str(turn.id)], task_id=task_id).get() == {"turn": str(turn.id), "turn_status": "skipped"}
    assert len(end_lines(log)) == 1


def test_a_cancelled_queued_turn_logs_one_line_without_a_task(user, scripted_codex, log, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hello", user=user)
    services.turn_cancel(turn=turn)
    [line] = end_lines(log)
    assert line.getMessage() == (f'turn {turn.id} ended status=cancelled session={session.id} thread_action=- '
                                 'attempt=0 task=- reason="cancelled before it ran"')


def test_a_turn_put_back_in_the_queue_has_not_ended_and_logs_no_end_line(user, scripted_codex, log, monkeypatch):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    assert services.turn_requeue(turn_id=turn.id, token=claim.token, reason="busy").status == Turn.Status.QUEUED
    assert end_lines(log) == []


def test_the_sweep_logs_nothing_when_it_finds_nothing_to_do(user, scripted_codex, run_turn_now, log):
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello", user=user)
    log.clear()
    for _ in range(3):
        assert worker.turns_sweep() == worker.SweepReport()
    assert [r.getMessage() for r in log.records] == []


def test_the_sweep_logs_one_line_per_action(user, scripted_codex, log, monkeypatch, settings):
    monkeypatch.setattr("hermes_sessions.services.dispatch.turn_dispatch_on_commit", lambda turn_id, **_: None)
    settings.HERMES_MAX_ATTEMPTS = 1
    lost_sessions = [services.session_create(owner=user) for _ in range(2)]
    lost = [services.turn_enqueue(session=s, input_text="hello", user=user) for s in lost_sessions]
    for turn in lost:  # claimed by workers that vanished (attempt 1 of 1: the sweep fails them)
        services.turn_claim(turn_id=turn.id)
    Turn.objects.filter(pk__in=[t.pk for t in lost]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    stale = services.turn_enqueue(session=services.session_create(owner=user), input_text="hi", user=user)
    an_hour_ago = timezone.now() - timedelta(hours=1)  # accepted (and stamped as sent) an hour ago
    Turn.objects.filter(pk=stale.pk).update(created_at=an_hour_ago, dispatched_at=an_hour_ago)
    key = IdempotencyKey.objects.create(user=user, key="k1", scope="x", request_hash="h", object_id="o")
    IdempotencyKey.objects.filter(pk=key.pk).update(created_at=timezone.now() - timedelta(days=2))
    log.clear()

    report = worker.turns_sweep()
    assert (report.failed, report.redispatched, report.keys_deleted) == (2, 1, 1)
    messages = sorted(r.getMessage() for r in log.records)
    assert len(messages) == 4, messages
    assert sum(m.startswith(f"turn {t.id} ended status=failed ") and "the worker running this turn was lost" in m
               for t in lost for m in messages) == 2
    assert any(m.startswith(f"sweep: turn {stale.id} queued at its session's head since ") for m in messages)
    assert any(m.startswith("sweep: deleted 1 Idempotency-Key rows") for m in messages)
