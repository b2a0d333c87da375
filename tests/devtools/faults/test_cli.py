"""The command line of ``make faults`` without the stack: options and the table."""
from __future__ import annotations

import pytest

from devtools.faults.cli import SCENARIOS, _row_clean, parse_args, print_table


def test_all_scenarios_run_by_default_and_an_unknown_one_is_refused(capsys):
    assert parse_args([]).chosen == list(SCENARIOS)
    assert list(SCENARIOS)[-7:] == ["kill-during-rollout", "db-down-during-restore", "warm-codex-dies",
                                    "kill-warm-holder", "freeze-warm-holder", "kill-beat-with-worker",
                                    "kill-while-approval-waits"]
    assert parse_args(["--scenarios", "concurrent-posts, broker-restart"]).chosen == ["concurrent-posts", "broker-restart"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--scenarios", "kill-worker,nap"])
    assert exit_info.value.code == 2
    assert "unknown scenario(s): nap" in capsys.readouterr().err


def test_table_has_a_row_per_scenario_and_lists_violations(capsys):
    rows = [
        {"scenario": "concurrent-posts", "runs": 50, "accepted": 45, "terminal": 45, "lost": 0, "duplicates": 0,
         "longest_s": 12.5, "failed": 0, "worker_restarts": 0, "violations": [], "failed_reasons": {},
         "notes": ["50 concurrent POSTs"]},
        {"scenario": "kill-worker", "runs": 5, "accepted": 33, "terminal": 32, "lost": 1, "duplicates": 0,
         "longest_s": 30.0, "failed": 2, "worker_restarts": 0, "violations": ["turn t lacks its assistant reply"],
         "failed_reasons": {"codex turn failed": 2}, "notes": []},
    ]
    print_table(rows)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split("  ")[0] == "scenario" and "messages lost" in out[1] and "violations" in out[1]
    assert out[3].startswith("concurrent-posts") and out[4].startswith("kill-worker     ")
    assert "kill-worker: VIOLATION turn t lacks its assistant reply" in out
    assert "kill-worker: failed ×2: codex turn failed" in out


def test_workers_run_one_turn_at_a_time_by_default_so_warm_processes_are_in_play():
    args = parse_args([])
    assert (args.workers, args.concurrency) == (4, 1)  # -c 1: an own queue and threads kept loaded
    assert (args.warm_sessions, args.warm_rounds, args.holder_sessions, args.holder_rounds) == (4, 4, 6, 2)
    assert args.holder_sessions > args.workers  # pigeonhole: one worker keeps several sessions loaded
    assert (args.freeze_rounds, args.freeze_slow_seconds) == (2, 15.0)
    assert parse_args(["--workers", "2", "--concurrency", "2"]).concurrency == 2  # the options stay


def test_the_broker_is_redis_unless_rabbitmq_is_asked_for(capsys):
    assert parse_args([]).broker == "redis"
    assert parse_args(["--broker", "rabbitmq"]).broker == "rabbitmq"
    with pytest.raises(SystemExit):
        parse_args(["--broker", "kafka"])
    assert "invalid choice: 'kafka'" in capsys.readouterr().err


def test_a_worker_that_had_to_be_restarted_fails_the_run():
    clean = {"violations": [], "lost": 0, "duplicates": 0, "terminal": 88, "accepted": 88, "worker_restarts": 0}
    assert _row_clean(clean)
    assert not _row_clean({**clean, "worker_restarts": 1})  # even with nothing lost: a worker must outlive its broker


def test_broker_restart_posts_every_1_5_to_4_s_from_6_sessions(capsys):
    """Posting every 0.3–1.2 s from 3 sessions queued ~60 turns per session on RabbitMQ (in PostgreSQL:
    the broker holds one message per session) and broke the 150 s bound with nothing lost."""
    args = parse_args([])
    assert (args.broker_post_every, args.broker_sessions, args.bound) == ((1.5, 4.0), 6, 150.0)
    assert parse_args(["--broker-post-every", "0.3,1.2"]).broker_post_every == (0.3, 1.2)
    with pytest.raises(SystemExit):
        parse_args(["--broker-post-every", "4,1"])
    assert "--broker-post-every: invalid" in capsys.readouterr().err


def test_a_broker_that_boots_slowly_is_started_at_once_after_the_kill(monkeypatch):
    """A RabbitMQ node's boot (9–17 s on a loaded machine) is the outage; before, --broker-down came first."""
    import argparse
    import time

    from devtools.faults import scenarios
    from devtools.faults.brokers import RabbitBroker, RedisBroker

    assert RabbitBroker.boots_slowly and not RedisBroker.boots_slowly
    calls: list[str] = []
    monkeypatch.setattr(time, "sleep", lambda seconds: calls.append(f"sleep {seconds:.0f}"))
    monkeypatch.setattr(scenarios, "_connections", lambda stack: {})
    monkeypatch.setattr(scenarios, "_count_broker_crashes", lambda sc, rnd: None)

    class Broker:
        port = 1
        boots_slowly = True

        def describe(self) -> str:
            return "fake"

        def loses_messages(self) -> str:
            return "stay"

        def kill9(self) -> None:
            calls.append("kill")

        def start(self, env: dict[str, str]) -> None:
            calls.append("start")

    class Stack:
        broker, env = Broker(), {}

        def broker_backlog(self) -> tuple[int, int]:
            return 1, 2

    class Sc:
        args = argparse.Namespace(broker_before=4.0, broker_down=3.0)
        stack = Stack()
        rec = argparse.Namespace(notes=[], violations=[])

    assert scenarios._restart_broker(Sc(), 1, time.monotonic()) == 3
    assert calls[:3] == ["sleep 4", "kill", "start"]  # --broker-before, then no --broker-down sleep
    Stack.broker.boots_slowly = False
    calls.clear()
    scenarios._restart_broker(Sc(), 2, time.monotonic())
    assert calls[:4] == ["sleep 4", "kill", "sleep 3", "start"]
