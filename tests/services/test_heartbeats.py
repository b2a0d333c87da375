"""worker/heartbeats.py: the leases of a process's running turns, renewed by jobs on its one scheduler thread."""
from __future__ import annotations

import threading
import time
import uuid

from hermes_sessions.codex.runner import TurnControl
from hermes_sessions.services.turns import Heartbeat, TurnClaim
from hermes_sessions.worker import heartbeats, recovery


def _claim() -> TurnClaim:
    return TurnClaim(turn_id=uuid.uuid4(), session_id="s", token=uuid.uuid4(), input_text="hi", thread_id=None,
                     rollout_generation=None, config={}, attempt=1, previous_thread_id=None)


def _answers(monkeypatch, answer):
    calls: list[uuid.UUID] = []

    def beat(*, turn_id, token):
        calls.append(token)
        return answer(token)

    monkeypatch.setattr(heartbeats, "turn_heartbeat", beat)
    return calls


def test_each_claim_is_renewed_every_beat_while_it_runs_and_never_after(settings, monkeypatch):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    calls = _answers(monkeypatch, lambda token: Heartbeat(held=True, cancel_requested=False))
    hb, a, b = heartbeats.TurnHeartbeats(), _claim(), _claim()
    with hb.beating(a, TurnControl()):
        assert a.token in recovery._renewed_here  # this process's lease take-back leaves it alone
        with hb.beating(b, TurnControl()):
            time.sleep(0.55)
        time.sleep(0.3)
    assert a.token not in recovery._renewed_here
    n_a, n_b = calls.count(a.token), calls.count(b.token)
    assert 6 <= n_a <= 9 and 4 <= n_b <= 6, (n_a, n_b)
    time.sleep(0.3)
    assert len(calls) == n_a + n_b  # nothing after the blocks ended
    assert [t.name for t in threading.enumerate()].count("hermes-scheduler") == 1  # no thread per turn


def test_a_claim_found_gone_is_abandoned_and_a_cancel_request_interrupts(settings, monkeypatch):
    settings.HERMES_HEARTBEAT_SECONDS = 0.05
    gone, cancelled = _claim(), _claim()
    calls = _answers(monkeypatch, lambda token: Heartbeat(held=token != gone.token,
                                                          cancel_requested=token == cancelled.token))
    hb = heartbeats.TurnHeartbeats()
    c_gone, c_cancel = TurnControl(), TurnControl()
    with hb.beating(gone, c_gone), hb.beating(cancelled, c_cancel):
        assert c_gone.abandon.wait(2) and c_cancel.interrupt.wait(2)
        time.sleep(0.3)
    assert not c_gone.interrupt.is_set() and not c_cancel.abandon.is_set()
    assert calls.count(gone.token) == 1  # a claim that is gone is not renewed again


def test_a_failed_renewal_is_logged_and_tried_again_at_the_next_beat(settings, monkeypatch, caplog):
    settings.HERMES_HEARTBEAT_SECONDS = 0.05
    failures = [True, True]

    def answer(token):
        if failures:
            failures.pop()
            raise ConnectionError("database blip")
        return Heartbeat(held=True, cancel_requested=False)

    calls = _answers(monkeypatch, answer)
    hb, claim, control = heartbeats.TurnHeartbeats(), _claim(), TurnControl()
    with hb.beating(claim, control):
        time.sleep(0.4)
    assert len(calls) >= 4 and not control.abandon.is_set()
    assert f"turn {claim.turn_id}: heartbeat failed" in caplog.text


def test_the_heartbeats_of_many_turns_share_the_one_scheduler_thread(settings, monkeypatch):
    settings.HERMES_HEARTBEAT_SECONDS = 0.05
    threads: set[str] = set()

    def beat(*, turn_id, token):
        threads.add(threading.current_thread().name)
        return Heartbeat(held=True, cancel_requested=False)

    monkeypatch.setattr(heartbeats, "turn_heartbeat", beat)
    hb = heartbeats.process_heartbeats()
    assert heartbeats.process_heartbeats() is hb
    with hb.beating(_claim(), TurnControl()), hb.beating(_claim(), TurnControl()):
        time.sleep(0.3)
    assert threads == {"hermes-scheduler"}
