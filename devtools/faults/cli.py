"""The command line of ``make faults``: options, the run (stack up, each scenario, its checks), the
table, clean-up and the exit code (0 only when every row is clean)."""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import devtools.faults
from devtools.databases import database_beside, drop_database
from devtools.faults.approval_scenarios import APPROVAL_SCENARIOS
from devtools.faults.invariants import check
from devtools.faults.rollout_scenarios import ROLLOUT_SCENARIOS
from devtools.faults.scenarios import SCENARIOS as BASIC_SCENARIOS
from devtools.faults.scenarios import Scenario
from devtools.faults.supervisor import BASE, Stack, log
from devtools.faults.warm_scenarios import WARM_SCENARIOS

SCENARIOS = {**BASIC_SCENARIOS, **ROLLOUT_SCENARIOS, **WARM_SCENARIOS, **APPROVAL_SCENARIOS}


def _interval(text: str) -> tuple[float, float]:
    """``"1.5,4"`` → ``(1.5, 4.0)``; argparse reports a ``ValueError`` as a usage error."""
    low, high = (float(part) for part in text.split(","))
    if not 0 <= low <= high:
        raise ValueError(text)
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; exits 2 on an unknown scenario. ``args.chosen`` lists the scenarios to run."""
    p = argparse.ArgumentParser(prog="python -m devtools.faults",
                                description=(devtools.faults.__doc__ or "").splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis",
                   help="the private broker the stack runs on (and broker-restart restarts): a redis-server, "
                        "or a RabbitMQ node of its own (needs rabbitmq-server installed)")
    # 4 × -c 1: each worker runs one turn at a time, so it consumes its own queue and keeps threads
    # loaded between turns (session affinity: warm processes in play); the same 4 turn slots as 2 × -c 2.
    p.add_argument("--workers", type=int, default=4, help="turn workers (each -c CONCURRENCY)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="turns each worker runs at once; 1 (default): it keeps threads loaded between turns, "
                        "more: it keeps none (session affinity needs -c 1)")
    p.add_argument("--slow-seconds", type=float, default=5.0, help="how long a SLOW reply streams")
    # 150 s: 36 turns queued on one session run one at a time; on a loaded 2-core machine the last one
    # took 90.6 s after its POST (a run that failed at the former 90 s bound).
    p.add_argument("--bound", type=float, default=150.0, help="seconds from the last POST by which every turn is terminal")
    p.add_argument("--kill-rounds", type=int, default=5)
    p.add_argument("--kill-sessions", type=int, default=3)
    p.add_argument("--dup-sessions", type=int, default=2)
    p.add_argument("--dup-turns", type=int, default=4, help="turns per session in duplicate-delivery")
    p.add_argument("--concurrent-posts", type=int, default=50)
    p.add_argument("--idem-keys", type=int, default=5, help="keys sent twice among the concurrent posts")
    # 6 sessions on the stack's 4 turn slots (2 workers × -c 2): a session has at most one task message in
    # the broker (its next turn is sent when the previous one ends), so with 3 the broker held no queued
    # message at the kill, only the running turns' unacknowledged ones; with 6 it holds both.
    p.add_argument("--broker-sessions", type=int, default=6, help="sessions posting in broker-restart")
    p.add_argument("--broker-restarts", type=int, default=2)
    p.add_argument("--broker-before", type=float, default=4.0, help="seconds of posting before each kill")
    p.add_argument("--broker-down", type=float, default=3.0,
                   help="seconds before the killed broker is started again (a RabbitMQ node, whose boot takes "
                        "longer, is started at once: its boot is the outage)")
    # 1.5–4 s: a session drains a turn every 3.5 s (SLOW ones 8 s) and runs them one at a time, so posting
    # every 0.3–1.2 s (as before) queued ~6 turns per turn run and the bound measured that queue — 60 turns
    # deep per session while a RabbitMQ node booted twice — rather than the restart. The queue is in
    # PostgreSQL either way: the broker holds one message per session at most (--broker-sessions).
    p.add_argument("--broker-post-every", type=_interval, default=(1.5, 4.0), metavar="MIN,MAX",
                   help="seconds between one session's posts in broker-restart, drawn uniformly")
    p.add_argument("--broker-after", type=float, default=4.0, help="seconds of posting after the last restart")
    p.add_argument("--rollout-sessions", type=int, default=3, help="sessions in the rollout scenarios")
    p.add_argument("--rollout-kills", type=int, default=6, help="kills in kill-during-rollout (restore, store, commit in turn)")
    p.add_argument("--db-down-rounds", type=int, default=4)
    p.add_argument("--db-down", default="2,8", help="seconds PostgreSQL stays unreachable, taken in turn "
                                                    "(the faults stack's lease is 4 s)")
    p.add_argument("--warm-sessions", type=int, default=4, help="sessions in warm-codex-dies")
    p.add_argument("--warm-rounds", type=int, default=4,
                   help="rounds of warm-codex-dies (each kills the kept app-servers of half the sessions)")
    p.add_argument("--holder-sessions", type=int, default=6,
                   help="sessions in kill-warm-holder (more than workers: one worker keeps several)")
    p.add_argument("--holder-rounds", type=int, default=2, help="warm holders killed in kill-warm-holder")
    p.add_argument("--freeze-rounds", type=int, default=2,
                   help="warm holders frozen (SIGSTOP) in freeze-warm-holder (its sessions: --holder-sessions)")
    # 15 s: well past the sweep's bound for a held turn (≈ 6.5 s here), so one left behind the long turn fails it.
    p.add_argument("--freeze-slow-seconds", type=float, default=15.0,
                   help="how long the long SLOW turn of freeze-warm-holder streams (the one worker idle when the "
                        "held turns are posted runs it)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs) and the *_faults database afterwards")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    args.chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.chosen if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(unknown)}")
    return args


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per scenario, then its notes, failure reasons and (up to 15) violations."""
    cols = [("scenario", "scenario"), ("runs", "runs"), ("accepted", "inputs accepted"), ("terminal", "turns terminal"),
            ("lost", "messages lost"), ("duplicates", "duplicates"), ("longest_s", "longest to terminal (s)"),
            ("failed", "failed turns"), ("worker_restarts", "worker restarts"), ("nviol", "violations")]
    data = [{**r, "nviol": len(r["violations"]), "worker_restarts": r.get("worker_restarts", 0)} for r in rows]
    widths = {k: max(len(h), *(len(str(d[k])) for d in data)) for k, h in cols}
    print()
    print("  ".join(h.ljust(widths[k]) for k, h in cols))
    print("  ".join("-" * widths[k] for k, _ in cols))
    for d in data:
        print("  ".join(str(d[k]).ljust(widths[k]) for k, _ in cols))
    print()
    for r in rows:
        for note in r["notes"]:
            print(f"{r['scenario']}: {note}")
        for reason, n in r["failed_reasons"].items():
            print(f"{r['scenario']}: failed ×{n}: {reason}")
        for viol in r["violations"][:15]:
            print(f"{r['scenario']}: VIOLATION {viol}")
        if len(r["violations"]) > 15:
            print(f"{r['scenario']}: … {len(r['violations']) - 15} more violations")


def _on_term(signum: int, frame: FrameType | None) -> None:
    # Once: a second Ctrl-C must not cut the clean-up short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_scenario(stack: Stack, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One scenario, then its checks; a scenario that breaks is a failed row, not a crash."""
    from django.db import close_old_connections

    t0 = time.monotonic()
    log(f"scenario {name}")
    sc = Scenario(stack, args, name)
    try:
        SCENARIOS[name](sc)
    except Exception as exc:  # noqa: BLE001 — a scenario that breaks is a failed row, not a crash
        sc.rec.violations.append(f"the scenario itself failed: {type(exc).__name__}: {exc}")
    sc.wait_terminal()
    close_old_connections()
    row = check(sc, args.bound)
    log(f"scenario {name} done in {time.monotonic() - t0:.0f} s: {row['accepted']} accepted, "
        f"{row['terminal']} terminal, {len(row['violations'])} violation(s)")
    return row


def _log_code_version(stack: Stack) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BASE, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=BASE, capture_output=True, text=True).stdout.splitlines()
    log(f"stack up (code: git {head} + {len(dirty)} changed/untracked path(s), snapshot in {stack.code})")


def _row_clean(r: dict[str, Any]) -> bool:
    # A worker that exited on its own and had to be restarted is a failure too, even when the sweep made
    # up for it: a worker must outlive a broker restart (project/broker.py).
    return (not r["violations"] and r["lost"] == 0 and r["duplicates"] == 0 and r["terminal"] == r["accepted"]
            and r.get("worker_restarts", 0) == 0)


def _close_database_connections() -> None:
    try:
        from django.db import connections

        connections.close_all()
    except Exception:  # noqa: BLE001 — Django may never have been set up (the stack failed early)
        pass


def _report(rows: list[dict[str, Any]], leftover: list[Any], interrupted: bool) -> None:
    if rows:
        print_table(rows)
    if interrupted:
        return
    if leftover:
        print(f"VIOLATION: {len(leftover)} codex process(es) left after the workers stopped: "
              + "; ".join(f"pid {p.pid} cwd {p.cwd}" for p in leftover[:5]))
    else:
        print("codex processes left after the workers stopped: 0")


def main(argv: list[str] | None = None) -> int:
    """Run the chosen scenarios on a private stack; print the table; 0 if every row is clean, else 1."""
    args = parse_args(argv)
    random.seed(args.seed)
    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        sys.exit("make faults needs DATABASE_URL=postgres://… (the Makefile sets it); a *_faults database is made beside it")
    faults_db = database_beside(db_url, "_faults")
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)  # also when started with SIGINT ignored (a background job)
    t_start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hermes-faults-"))
    stack = Stack(args, scratch)
    rows: list[dict[str, Any]] = []
    leftover: list[Any] = []
    ok = interrupted = False
    try:
        log(f"starting the stack (scratch {scratch}, database {faults_db.rsplit('/', 1)[1]}, "
            f"{stack.broker.describe()}, queue {stack.queue})")
        stack.start(faults_db)
        _log_code_version(stack)
        for name in args.chosen:  # rows.append one by one: an interrupt still prints the rows so far
            rows.append(run_scenario(stack, args, name))
        # Every worker stopped: no codex app-server may outlive them.
        stack.stop_workers()
        time.sleep(1)
        leftover = stack.codex_left()
        ok = bool(rows) and all(_row_clean(r) for r in rows) and not leftover
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted; cleaning up")
    finally:
        stack.stop()
        stack.kill_codex()  # ours, by CODEX_HOME: never leave them running
        _close_database_connections()
    _report(rows, leftover, interrupted)
    print(f"runtime: {time.monotonic() - t_start:.0f} s; logs: {scratch / 'logs' if args.keep or not ok else '(removed)'}")
    if ok and not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
        _drop_scratch_database(faults_db)
    print("faults: OK" if ok else "faults: FAILED")
    return 0 if ok else 1


def _drop_scratch_database(url: str) -> None:
    """Remove the scratch database after a clean run (a failed run keeps it for inspection)."""
    try:
        drop_database(url)
    except Exception as exc:  # noqa: BLE001 — leaving it behind is harmless
        log(f"could not drop {url.rsplit('/', 1)[1].split('?')[0]}: {exc}")
