"""Celery is configured for at-least-once delivery of turns (issue 3 §4)."""
from django.conf import settings

from hermes_sessions.tasks import run_turn, sweep_turns
from project.celery import app


def test_turns_are_acknowledged_late_and_requeued_when_a_worker_is_lost():
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1


def test_turns_have_a_queue_of_their_own():
    assert app.amqp.router.route({}, run_turn.name)["queue"].name == settings.CELERY_TASK_ROUTES[run_turn.name]["queue"]
    # The sweep stays on the default queue: long turns filling every turn slot cannot delay it.
    assert app.amqp.router.route({}, sweep_turns.name)["queue"].name == "celery"


def test_redelivery_and_time_limits_outlast_the_longest_turn():
    assert app.conf.broker_transport_options["visibility_timeout"] > settings.CODEX_TURN_TIMEOUT
    assert settings.CODEX_TURN_TIMEOUT < run_turn.soft_time_limit < run_turn.time_limit


def test_the_sweep_is_scheduled():
    schedule = app.conf.beat_schedule["sweep-turns"]
    assert schedule["task"] == sweep_turns.name and schedule["schedule"] <= settings.HERMES_LEASE_SECONDS
