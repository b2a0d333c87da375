"""The early ``turn/start`` (``worker/warm/early_start.py``): a woken worker sends the turn to the session's
kept thread while it claims it — and kills that app-server when the claim does not let it stand.

Real PostgreSQL, the pinned codex binary and the model stand-in, in this process: the session's first turn
runs here and its app-server is kept (``execution._Handover``, this process's keeper), then the second turn is
run as its wake would run it (``turn_execute`` with the wake's ``WakeHint``). The whole path with real
workers and the API: ``tests/e2e/test_affinity.py`` (``timings["early_start"]``).
"""
from __future__ import annotations

import os
import time
import uuid

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.models import Message, Turn
from hermes_sessions.services import dispatch, routing
from hermes_sessions.services.routing import WakeHint
from hermes_sessions.worker import execution
from hermes_sessions.worker.warm import early_start
from hermes_sessions.worker.warm import kept as kept_mod
from tests.factories import SessionFactory

from ..support.real_codex import use_real_codex

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def stand_in():
    with ModelStandIn() as server:
        yield server


@pytest.fixture
def keeping(settings, codex_dirs, real_codex_bin, stand_in, monkeypatch):
    """This process keeps threads loaded (an own queue, a keeper made afresh), runs the real codex, and
    sends no Celery message (the next turn is run by the test); the keeper is closed after the test."""
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 60.0, 4
    settings.HERMES_EARLY_START, settings.HERMES_AFFINITY_DEADLINE = True, 2.0
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, f"turns-test.early-{os.getpid()}")
    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", lambda *a, **kw: None)
    monkeypatch.setattr(execution, "start_affinity", lambda k: None)  # no loop, no listener threads
    kept_mod.close_keeper()
    k = kept_mod.keeper_make()
    assert k is not None
    yield k
    kept_mod.close_keeper()


def _first_turn(user, *, sandbox: str = "read-only"):
    """A session whose first turn ran here and whose app-server is kept: ``(session, kept copy)``."""
    session = SessionFactory(owner=user, model_config={"sandbox": sandbox})
    first = services.turn_enqueue(session=session, input_text="first", user=user)
    done = execution.turn_execute(turn_id=first.pk)
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    copy = kept_mod.keeper_if_made().peek(session.pk)
    assert copy is not None and copy.client.alive()
    return session, copy


def _woken(session, user, text: str, *, hint_text: str | None = None, age: float = 0.0):
    """Enqueue ``text`` and run it as its wake would: the hint carries ``hint_text`` (default: ``text``)
    and was sent ``age`` seconds ago."""
    turn = services.turn_enqueue(session=session, input_text=text, user=user)
    hint = WakeHint(text=text if hint_text is None else hint_text, sent_at=time.time() - age)
    return turn, execution.turn_execute(turn_id=turn.pk, woken=True, session_id=session.pk, hint=hint)


def _asked(stand_in: ModelStandIn, text: str) -> int:
    """How many model requests carried ``text`` as their last user message."""
    return sum(1 for r in stand_in.requests()
               if [t for role, t in stand_in.user_texts(r) if role == "user"][-1:] == [text])


def _dead(pid: int | None) -> bool:
    deadline = time.monotonic() + 5
    while pid is not None and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid is None or not os.path.exists(f"/proc/{pid}")


def test_a_fresh_wake_sends_turn_start_before_the_claim_and_the_turn_runs_once(keeping, user, stand_in, monkeypatch):
    session, copy = _first_turn(user)
    order: list[str] = []
    send, claim = copy.client.send_request, execution.turn_claim
    monkeypatch.setattr(copy.client, "send_request", lambda *a, **kw: (order.append(a[0]), send(*a, **kw))[1])
    monkeypatch.setattr(execution, "turn_claim", lambda **kw: (order.append("claim"), claim(**kw))[1])
    turn, done = _woken(session, user, "second")
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    assert order == ["turn/start", "claim"]
    assert (done.timings.get("early_start"), done.timings.get("warm")) == (1, 1), done.timings
    assert _asked(stand_in, "second") == 1
    assert list(Message.objects.filter(session=session, role="user").values_list("content", flat=True)) == [
        "first", "second"]
    again = keeping.peek(session.pk)
    assert again is not None and again.client is copy.client and again.base.generation == 2  # kept for the next


def test_a_wake_whose_turn_was_cancelled_meanwhile_kills_the_app_server_before_codex_asks_the_model(
        keeping, user, stand_in, monkeypatch):
    session, copy = _first_turn(user)
    pid, claim = copy.client.pid, execution.turn_claim

    def cancelled_first(**kw):
        services.turn_cancel(turn=Turn.objects.get(pk=kw["turn_id"]))
        return claim(**kw)

    monkeypatch.setattr(execution, "turn_claim", cancelled_first)
    turn, done = _woken(session, user, "never run")
    assert done is None
    turn.refresh_from_db()
    assert turn.status == Turn.Status.CANCELLED
    assert _dead(pid) and keeping.peek(session.pk) is None
    time.sleep(0.2)  # codex asks the model ~50 ms after turn/start; it was killed well before
    assert _asked(stand_in, "never run") == 0


def test_a_wake_whose_input_is_not_the_turns_is_withdrawn_and_the_turn_runs_cold_on_its_own_input(
        keeping, user, stand_in):
    session, copy = _first_turn(user)
    pid = copy.client.pid
    turn, done = _woken(session, user, "the stored input", hint_text="a forged input")
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    assert "early_start" not in done.timings and "warm" not in done.timings, done.timings  # cold: restored
    assert _dead(pid)
    assert _asked(stand_in, "the stored input") == 1 and _asked(stand_in, "a forged input") == 0


@pytest.mark.parametrize("case", ["stale wake", "workspace-write", "HERMES_EARLY_START=0", "no hint"])
def test_otherwise_the_worker_claims_first_and_runs_on_the_kept_thread(keeping, user, stand_in, settings, case):
    session, copy = _first_turn(user, sandbox="workspace-write" if case == "workspace-write" else "read-only")
    if case == "HERMES_EARLY_START=0":
        settings.HERMES_EARLY_START = False
    if case == "no hint":
        turn = services.turn_enqueue(session=session, input_text="second", user=user)
        done = execution.turn_execute(turn_id=turn.pk, woken=True, session_id=session.pk, hint=None)
    else:
        turn, done = _woken(session, user, "second", age=5.0 if case == "stale wake" else 0.0)
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    assert "early_start" not in done.timings and done.timings.get("warm") == 1, done.timings
    assert _asked(stand_in, "second") == 1


def test_a_wake_with_no_kept_copy_runs_cold_and_takes_nothing(keeping, user, stand_in):
    session = SessionFactory(owner=user)
    assert early_start.early_start(turn_id=uuid.uuid4(), session_id=session.pk,
                                   hint=WakeHint(text="x", sent_at=time.time())) is None


def test_the_age_bound_stays_far_inside_the_affinity_deadline(settings):
    settings.HERMES_AFFINITY_DEADLINE = 2.0
    assert early_start.max_age() == early_start.MAX_AGE_SECONDS == 0.5
    settings.HERMES_AFFINITY_DEADLINE = 0.4
    assert early_start.max_age() == pytest.approx(0.1)


# --- a late claim -----------------------------------------------------------------------------------

def _late_claim(monkeypatch, seconds: float, before=None):
    """``turn_claim`` answering ``seconds`` late (a lock wait, a slow database), after ``before(turn_id)``."""
    claim = execution.turn_claim

    def late(**kw):
        time.sleep(seconds)
        if before is not None:
            before(kw["turn_id"])
        return claim(**kw)

    monkeypatch.setattr(execution, "turn_claim", late)


def test_a_claim_that_is_late_and_then_fails_never_lets_codex_reach_the_model(keeping, user, stand_in, monkeypatch):
    """Without the pause, a claim 60 ms late let codex ask the model for a turn that ended cancelled (and
    run a command for it): codex asks ~45 ms after turn/start. Paused after 20 ms, it never does."""
    session, copy = _first_turn(user)
    pid = copy.client.pid
    _late_claim(monkeypatch, 0.3, before=lambda t: services.turn_cancel(turn=Turn.objects.get(pk=t)))
    turn, done = _woken(session, user, "cancelled while late")
    assert done is None and Turn.objects.get(pk=turn.pk).status == Turn.Status.CANCELLED
    assert _dead(pid) and keeping.peek(session.pk) is None
    time.sleep(0.3)
    assert _asked(stand_in, "cancelled while late") == 0


def test_a_claim_that_is_late_and_holds_resumes_codex_and_the_turn_runs_warm_once(keeping, user, stand_in, monkeypatch):
    session, copy = _first_turn(user)
    _late_claim(monkeypatch, 0.3)
    turn, done = _woken(session, user, "late but mine")
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    assert (done.timings.get("early_start"), done.timings.get("early_start_paused"), done.timings.get("warm")) == (
        1, 1, 1), done.timings
    assert _asked(stand_in, "late but mine") == 1
    assert keeping.peek(session.pk).client is copy.client  # resumed, and kept again


def test_a_failure_after_the_copy_was_taken_does_not_leave_its_app_server_running(keeping, user, monkeypatch):
    session, copy = _first_turn(user)
    pid = copy.client.pid

    def full_disk(name, key=""):
        if name == "codex.turn_start.sent":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(early_start, "mark", full_disk)
    turn = services.turn_enqueue(session=session, input_text="second", user=user)
    with pytest.raises(OSError):
        execution.turn_execute(turn_id=turn.pk, woken=True, session_id=session.pk,
                               hint=WakeHint(text="second", sent_at=time.time()))
    assert _dead(pid) and keeping.peek(session.pk) is None


def test_a_kept_app_server_that_dies_as_the_early_start_reaches_it_runs_the_turn_cold_and_says_so(
        keeping, user, stand_in, monkeypatch):
    """Killed between turns, its death not yet seen: turn/start is written, then codex is gone. Nothing of
    the turn is in its rollout, so the turn runs again, cold — and its timings do not say early_start."""
    session, copy = _first_turn(user)
    send = copy.client.send_request

    def send_then_die(*a, **kw):
        pending = send(*a, **kw)
        os.killpg(copy.client.pid, 9)
        return pending

    monkeypatch.setattr(copy.client, "send_request", send_then_die)
    turn, done = _woken(session, user, "after the kill")
    assert done is not None and done.status == Turn.Status.SUCCEEDED, done and done.error
    assert "early_start" not in done.timings and "warm" not in done.timings, done.timings
    assert _asked(stand_in, "after the kill") == 1


def test_a_claim_late_past_the_request_timeout_still_runs_the_turn(keeping, user, stand_in, monkeypatch, settings):
    """codex is stopped while the claim is late: its turn/start answer cannot come in that time. A claim that
    holds after CODEX_REQUEST_TIMEOUT must not fail the turn for a timeout codex had no part in (claiming
    first, the same late claim just delays the turn). Without the rule the turn ended failed with
    "codex app-server did not answer 'turn/start' within …"."""
    settings.CODEX_REQUEST_TIMEOUT = 1.0
    session, copy = _first_turn(user)
    _late_claim(monkeypatch, 1.5)
    turn, done = _woken(session, user, "late past the request timeout")
    assert done is not None and done.status == Turn.Status.SUCCEEDED, (done and done.status, done and done.error)
    time.sleep(0.5)
    assert _asked(stand_in, "late past the request timeout") == 1
