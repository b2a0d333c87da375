"""The command line of ``make faults`` without the stack: options and the table."""
from __future__ import annotations

import pytest

from devtools.faults.cli import SCENARIOS, _row_clean, parse_args, print_table


def test_all_scenarios_run_by_default_and_an_unknown_one_is_refused(capsys):
    assert parse_args([]).chosen == list(SCENARIOS)
    assert list(SCENARIOS)[-4:] == ["kill-during-rollout", "db-down-during-restore", "warm-codex-dies",
                                    "kill-warm-holder"]
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
