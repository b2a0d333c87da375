"""``make bench``'s throughput: turns per second through one API and 1, 2, 4 … ``-c 1`` worker processes
(the warm stack's settings), with many sessions at once.

For each worker count: fresh workers on the stack's queue (started, then pinged until they answer),
``sessions`` new sessions, then ``rounds`` rounds; a round posts one turn on every session at once (16
client threads) and waits until every one has ended (read from PostgreSQL every 20 ms, so the bench's
polling does not load the API). Round 1 starts each session's thread; later rounds are the sessions'
consecutive turns, where session affinity (once in the worker) keeps threads loaded. Figures per worker
count: turns/s over the later rounds (wall time from the first POST to the last turn ended, summed over
rounds), turns/s of round 1, failed turns (anything but ``succeeded``, and POSTs that errored), and
how many turns ran on a kept-loaded thread (``timings.warm``).

Beside one worker count (``beside``; ``make bench``: 2), after the stack's round 1: ``sessions`` warm direct
app-servers (``bench_direct.DirectFleet``) and, per later round, a round of one turn on each at once right
beside the stack's round (the order alternating per round, so drift hits both alike). Figures:
``direct_turns_per_s`` over those rounds, ``ratio_vs_direct`` = the stack's later rounds' turns/s over it,
``kept_share`` = the share of the stack's later turns on a kept-loaded thread. With a
``bench_capacity.Probe``, its counters are read around each of those stack rounds (the window) and each
direct round (the background): ``WorkerCountResult.capacity``."""
from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from devtools.bench_capacity import FLUSH_SECONDS, Counters, Probe, Window
from devtools.bench_direct import DirectFleet
from devtools.bench_figures import throughput
from devtools.bench_stacks import TERMINAL, Stack, StackClient

ROUND_DEADLINE = 600  # seconds a round may take before its unfinished turns count as failed


@dataclass
class Round:
    """One round: ``turns`` posted, ``seconds`` from the first POST to the last end, ``failed``, ``warm``
    (turns with ``timings.warm``), ``polls`` (the bench's reads of the turns from PostgreSQL)."""

    turns: int
    seconds: float
    failed: int
    warm: int = 0
    polls: int = 0


@dataclass
class Capacity:
    """The ``bench_capacity`` windows of one worker count's later rounds: ``stack`` (around its rounds),
    ``background`` (around the direct rounds), ``own_transactions`` (the bench's polls and readings counted
    inside ``stack``), ``sessions`` (their ids, for the rollout figures)."""

    stack: Window = field(default_factory=Window)
    background: Window = field(default_factory=Window)
    own_transactions: int = 0
    sessions: list[str] = field(default_factory=list)


@dataclass
class WorkerCountResult:
    workers: int
    rounds: list[Round] = field(default_factory=list)
    direct_rounds: list[Round] = field(default_factory=list)  # beside the later rounds (module docstring)
    direct_start_seconds: float = 0.0
    capacity: Capacity | None = None

    def figures(self) -> dict[str, Any]:
        """turns/s of the later rounds (round 1 alone if there is only one) and of round 1; failures;
        ``kept_share`` = later turns on a kept-loaded thread / later turns; with direct rounds,
        ``direct_turns_per_s``, ``ratio_vs_direct`` (stack / direct), ``direct_failed``. Ratios to three
        decimals."""
        later = self.rounds[1:] or self.rounds
        later_turns = sum(r.turns for r in later)
        out: dict[str, Any] = {
            "turns_per_s": throughput(later_turns, sum(r.seconds for r in later)),
            "first_round_turns_per_s": throughput(self.rounds[0].turns, self.rounds[0].seconds),
            "failed": sum(r.failed for r in self.rounds),
            "turns": sum(r.turns for r in self.rounds),
            "warm": sum(r.warm for r in later),
            "later_turns": later_turns,
            "kept_share": round(sum(r.warm for r in later) / later_turns, 3) if later_turns else 0.0,
        }
        if self.direct_rounds:
            direct_turns = sum(r.turns for r in self.direct_rounds)
            direct_seconds = sum(r.seconds for r in self.direct_rounds)
            stack = later_turns / sum(r.seconds for r in later)
            out.update(direct_turns_per_s=throughput(direct_turns, direct_seconds),
                       ratio_vs_direct=round(stack / (direct_turns / direct_seconds), 3),
                       direct_failed=sum(r.failed for r in self.direct_rounds), direct_turns=direct_turns)
        return out


def wait_for_workers(stack: Stack, count: int, timeout: float = 90) -> None:
    """Until ``count`` of the stack's workers answer a Celery ping (their node names)."""
    from celery import current_app

    host = socket.gethostname()
    names = {f"bench-{stack.name}-{i}-{os.getpid()}@{host}"
             for i in range(stack.started_workers - count + 1, stack.started_workers + 1)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replies = current_app.control.ping(destination=sorted(names), timeout=1.0) or []
        if names <= {name for reply in replies for name in reply}:
            return
    raise RuntimeError(f"workers {sorted(names)} did not answer a ping within {timeout:.0f} s")


def _round(client: StackClient, sessions: list[str], text: str) -> Round:
    from hermes_sessions.models import Turn

    t0 = time.monotonic()
    failed = polls = 0

    def post(sid: str) -> str | None:
        try:
            return str(client.post_turn(text, sid)["turn"]["id"])
        except OSError as exc:
            print(f"  throughput: POST on {sid} failed: {exc}", file=sys.stderr)
            return None

    with ThreadPoolExecutor(16) as pool:
        ids = [i for i in pool.map(post, sessions) if i is not None]
    failed += len(sessions) - len(ids)
    rows: list[tuple[str, dict[str, Any]]] = []
    while time.monotonic() - t0 < ROUND_DEADLINE:
        rows = list(Turn.objects.filter(pk__in=ids, status__in=TERMINAL).values_list("status", "timings"))
        polls += 1
        if len(rows) == len(ids):
            break
        time.sleep(0.02)
    seconds = time.monotonic() - t0
    if len(rows) < len(ids):
        print(f"  throughput: {len(ids) - len(rows)} turns not ended after {ROUND_DEADLINE} s (counted failed)",
              file=sys.stderr, flush=True)
    failed += len(ids) - len(rows) + sum(1 for status, _ in rows if status != "succeeded")
    warm = sum(1 for _, timings in rows if (timings or {}).get("warm") == 1)
    return Round(turns=len(sessions), seconds=seconds, failed=failed, warm=warm, polls=polls)


def _progress(r: Round, what: str) -> None:
    print(f"  throughput: {what}: {r.turns} turns in {r.seconds:.1f} s, {r.failed} failed", file=sys.stderr, flush=True)


def run_throughput(stack: Stack, client: StackClient, worker_counts: list[int], sessions: int, rounds: int, *,
                   beside: int | None = None, probe: Probe | None = None) -> list[WorkerCountResult]:
    """The throughput runs on ``stack`` (its API started, no workers running), with the direct rounds (and
    ``probe``'s capacity windows) beside worker count ``beside``; prints progress."""
    out = []
    for n in worker_counts:
        stack.stop_workers()
        for _ in range(n):
            stack.add_worker()
        wait_for_workers(stack, n)
        ids = [f"{client.session_id}-tput-w{n}-{i}" for i in range(sessions)]
        for sid in ids:
            client.make_session(sid)
        result = WorkerCountResult(workers=n)
        result.rounds.append(_round(client, ids, f"throughput {n} 0"))
        _progress(result.rounds[-1], f"{n} worker(s), round 1/{rounds}")
        if n == beside and rounds > 1:
            _rounds_beside_direct(stack, client, ids, result, rounds, probe)
        else:
            for r in range(1, rounds):
                result.rounds.append(_round(client, ids, f"throughput {n} {r}"))
                _progress(result.rounds[-1], f"{n} worker(s), round {r + 1}/{rounds}")
        out.append(result)
    stack.stop_workers()
    return out


def _rounds_beside_direct(stack: Stack, client: StackClient, ids: list[str], result: WorkerCountResult,
                          rounds: int, probe: Probe | None) -> None:
    """Rounds 2+ of the stack, each with a direct round beside it (module docstring; the stack first in
    round 2, 4, …); with ``probe``, readings around each (a stack round's end reading after
    ``FLUSH_SECONDS``, so its backends' statistics are in it)."""
    n = result.workers
    fleet = DirectFleet(len(ids), f"{client.session_id}-direct")
    capacity = result.capacity = Capacity(sessions=list(ids)) if probe is not None else None

    def read() -> Counters:
        assert probe is not None
        return probe.read(stack.gunicorn.pid if stack.gunicorn else None, [w.pid for w in stack.workers])

    def stack_round(r: int) -> None:
        start = read() if capacity else None
        result.rounds.append(_round(client, ids, f"throughput {n} {r}"))
        if capacity is not None and start is not None and probe is not None:
            time.sleep(FLUSH_SECONDS)
            capacity.stack.add(start, read())
            capacity.own_transactions += result.rounds[-1].polls + probe.TRANSACTIONS_PER_READING
        _progress(result.rounds[-1], f"{n} worker(s), round {r + 1}/{rounds}")

    def direct_round(r: int) -> None:
        start = read() if capacity else None
        seconds, failed = fleet.round(f"throughput {n} {r}")
        result.direct_rounds.append(Round(turns=len(ids), seconds=seconds, failed=failed))
        if capacity is not None and start is not None:
            capacity.background.add(start, read())
        _progress(result.direct_rounds[-1], f"direct, round {r + 1}/{rounds}")

    try:
        result.direct_start_seconds = fleet.start()
        print(f"  throughput: {len(ids)} warm direct app-servers started in {result.direct_start_seconds:.1f} s",
              file=sys.stderr, flush=True)
        for r in range(1, rounds):
            steps: tuple[Callable[[int], None], ...] = (stack_round, direct_round) if r % 2 == 1 else (direct_round, stack_round)
            for step in steps:
                step(r)
    finally:
        fleet.close()
