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

The same work straight to codex (``run_direct_throughput``), for the ratio against codex in the same run:
``sessions`` app-servers, each on a home of its own under the permission profile a session's turns run
with (read-only), its thread started by one turn; then ``rounds`` − 1 rounds, each one ``turn/start`` →
``turn/completed`` on every app-server at once (one client thread per app-server)."""
from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from devtools.bench_figures import throughput
from devtools.bench_stacks import TERMINAL, Stack, StackClient

ROUND_DEADLINE = 600  # seconds a round may take before its unfinished turns count as failed


@dataclass
class Round:
    """One round: ``turns`` posted, ``seconds`` from the first POST to the last end, ``failed``, ``warm``
    (turns with ``timings.warm``)."""

    turns: int
    seconds: float
    failed: int
    warm: int


@dataclass
class WorkerCountResult:
    workers: int
    rounds: list[Round] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """turns/s of the later rounds (round 1 alone if there is only one) and of round 1; failures."""
        later = self.rounds[1:] or self.rounds
        return {
            "turns_per_s": throughput(sum(r.turns for r in later), sum(r.seconds for r in later)),
            "first_round_turns_per_s": throughput(self.rounds[0].turns, self.rounds[0].seconds),
            "failed": sum(r.failed for r in self.rounds),
            "turns": sum(r.turns for r in self.rounds),
            "warm": sum(r.warm for r in later),
            "later_turns": sum(r.turns for r in later),
        }


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
    failed = 0

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
        if len(rows) == len(ids):
            break
        time.sleep(0.02)
    seconds = time.monotonic() - t0
    if len(rows) < len(ids):
        print(f"  throughput: {len(ids) - len(rows)} turns not ended after {ROUND_DEADLINE} s (counted failed)",
              file=sys.stderr, flush=True)
    failed += len(ids) - len(rows) + sum(1 for status, _ in rows if status != "succeeded")
    warm = sum(1 for _, timings in rows if (timings or {}).get("warm") == 1)
    return Round(turns=len(sessions), seconds=seconds, failed=failed, warm=warm)


def run_direct_throughput(sessions: int, rounds: int, work: str) -> float:
    """Turns/s of ``sessions`` warm app-servers driven directly, ``sessions`` turns at once, over ``rounds``
    − 1 rounds after the threads' first turns (module docstring); prints progress."""
    from pathlib import Path

    from devtools.bench import _direct_thread
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

    workdir = Path(work)
    workdir.mkdir(parents=True, exist_ok=True)

    def start(i: int) -> Any:
        home = prepare_session_home(f"bench-direct-tput-{i}", sandbox="read-only", workdir=workdir)
        return _direct_thread(app_server_argv(sandbox="read-only", workdir=workdir), app_server_env(home), work)

    with ThreadPoolExecutor(sessions) as pool:
        servers = list(pool.map(start, range(sessions)))
        try:
            turns = seconds = 0.0
            for r in range(1, rounds):
                t0 = time.monotonic()
                text = f"direct throughput {r}"
                list(pool.map(lambda ds, text=text: ds[0].turn(ds[1], text), servers))
                took = time.monotonic() - t0
                turns, seconds = turns + len(servers), seconds + took
                print(f"  throughput: direct, round {r + 1}/{rounds}: {len(servers)} turns in {took:.1f} s",
                      file=sys.stderr, flush=True)
        finally:
            for d, _ in servers:
                d.close()
    return throughput(int(turns), seconds) if seconds else 0.0


def run_throughput(stack: Stack, client: StackClient, worker_counts: list[int], sessions: int,
                   rounds: int) -> list[WorkerCountResult]:
    """The throughput runs on ``stack`` (its API started, no workers running); prints progress."""
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
        for r in range(rounds):
            result.rounds.append(_round(client, ids, f"throughput {n} {r}"))
            last = result.rounds[-1]
            print(f"  throughput: {n} worker(s), round {r + 1}/{rounds}: {last.turns} turns in {last.seconds:.1f} s, "
                  f"{last.failed} failed", file=sys.stderr, flush=True)
        out.append(result)
    stack.stop_workers()
    return out
