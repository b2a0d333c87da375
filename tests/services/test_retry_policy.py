"""The one retry budget (worker/retry_policy.py): its arithmetic, the number the docs quote, and
that each layer spends it — the run retries, the requeue, the commit retry."""
import pytest
from django.db import OperationalError

from hermes_sessions import services
from hermes_sessions.models import CodexBinding, Notice, Turn
from hermes_sessions.worker import execution
from hermes_sessions.worker.retry_policy import RetryPolicy, retry_policy

pytestmark = pytest.mark.django_db(transaction=True)

ACTIVE_WRITER = {"error": {"code": -32600, "message": "thread {thread_id} already has an active writer"}}
OVERLOADED = {"error": {"code": -32001, "message": "Server overloaded; retry later."}}


def test_next_delay_walks_the_delays_and_stops_at_the_deadline():
    policy = RetryPolicy(delays=(0.5, 1.0, 2.0), deadline=10.0, max_claims=3)
    assert [policy.next_delay(retries=n, elapsed=0.0) for n in range(4)] == [0.5, 1.0, 2.0, None]
    assert policy.next_delay(retries=0, elapsed=9.5) == 0.5  # starts exactly at the deadline
    assert policy.next_delay(retries=0, elapsed=9.6) is None
    assert RetryPolicy(delays=(), deadline=60.0, max_claims=1).next_delay(retries=0, elapsed=0.0) is None


def test_worst_case_with_the_defaults_is_the_readme_number():
    # docs/architecture.md "Durability": 3 × (60 + 7 × 30 + 2) + 15.5 = 831.5 s
    assert RetryPolicy().worst_case_seconds(request_timeout=30.0) == 831.5


def test_the_policy_is_read_from_settings_at_each_call(settings):
    settings.HERMES_RETRY_DELAYS = (0.1, 0.2)
    settings.HERMES_RETRY_DEADLINE = 7.0
    settings.HERMES_MAX_ATTEMPTS = 4
    assert retry_policy() == RetryPolicy(delays=(0.1, 0.2), deadline=7.0, max_claims=4)


def test_the_default_settings_are_the_policy_defaults():
    from project import settings as project_settings

    assert project_settings.HERMES_RETRY_DEADLINE == RetryPolicy().deadline
    assert project_settings.HERMES_MAX_ATTEMPTS == RetryPolicy().max_claims


@pytest.fixture
def bound(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_REQUEST_TIMEOUT = 2.0
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    return session, t1.codex_thread_id


def resume_processes(scripted_codex):
    return len([p for p in scripted_codex.processes() if "thread/resume" in p])


def test_the_deadline_ends_a_claims_retries_early(bound, user, scripted_codex, run_turn_now, settings):
    session, thread = bound
    settings.HERMES_RETRY_DELAYS = (0.3, 0.3, 0.3)
    settings.HERMES_RETRY_DEADLINE = 0.2  # no retry fits: one try per claim
    scripted_codex.script({"thread/resume": [ACTIVE_WRITER] * 9})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED and "gave up after 3 attempts" in t2.error
    assert resume_processes(scripted_codex) == 3  # 3 claims × 1 try, not 3 × 4
    assert CodexBinding.objects.get(session=session, status="active").thread_id == thread


def test_overload_is_retried_on_a_new_app_server_not_inside_the_runner(bound, user, scripted_codex, run_turn_now,
                                                                        settings):
    session, thread = bound
    settings.HERMES_RETRY_DELAYS = (0.05,)
    scripted_codex.script({"thread/resume": [OVERLOADED, OVERLOADED]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    # Claim 1: try + one retry, both overloaded → back to the queue; claim 2 succeeds. Each try is its
    # own app-server with exactly one thread/resume (the runner sends no second one itself).
    assert (t2.status, t2.attempt, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, 2, thread), t2.error
    assert scripted_codex.processes()[1:] == [["initialize", "thread/resume"]] * 2 + [
        ["initialize", "thread/resume", "thread/turns/list", "turn/start"]]
    assert not Notice.objects.exists()


def test_overload_on_turn_start_is_retried_because_codex_refused_the_input(bound, user, scripted_codex, run_turn_now,
                                                                            settings):
    session, thread = bound
    settings.HERMES_RETRY_DELAYS = (0.05,)
    scripted_codex.script({"turn/start": [OVERLOADED]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.attempt, t2.final_text) == (Turn.Status.SUCCEEDED, 1, "echo: hello two"), t2.error
    assert scripted_codex.processes()[1:] == [["initialize", "thread/resume", "turn/start"]] * 2
    assert scripted_codex.turn_inputs().count("hello two") == 2  # refused once, run once


def test_the_commit_retries_a_lost_database_connection_by_the_policy(monkeypatch):
    monkeypatch.setattr(execution, "close_old_connections", lambda: None)
    monkeypatch.setattr(execution.connection, "close", lambda: None)
    calls = []

    def flaky(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise OperationalError("server closed the connection unexpectedly")
        return "committed"

    policy = RetryPolicy(delays=(0.0, 0.0, 0.0), deadline=5.0, max_claims=1)
    assert execution._commit(policy, flaky, turn_id="t") == "committed"
    assert len(calls) == 3

    calls.clear()
    with pytest.raises(OperationalError):
        execution._commit(RetryPolicy(delays=(0.0,), deadline=5.0, max_claims=1), flaky, turn_id="t")
    assert len(calls) == 2  # one try + the policy's one retry
