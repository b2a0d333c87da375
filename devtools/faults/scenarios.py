"""The four fault scenarios of ``make faults``. Each drives the stack over HTTP as a client would,
injects its fault and fills a :class:`~devtools.faults.record.Record`; the checks come afterwards
(:mod:`devtools.faults.invariants`).

``kill-worker``         SLOW turns on several sessions; again and again ``kill -9`` the worker running one
                        (found through the codex process working in that session's directory — the one
                        started last, should a worker also keep that session's thread loaded), start a
                        replacement; normal turns keep coming.
``duplicate-delivery``  every turn's ``run_turn`` task is also sent straight to the broker again — while it is
                        queued, while it runs and after it finished; late duplicates must change nothing.
``concurrent-posts``    50 concurrent POSTs to one session, some pairs sharing an ``Idempotency-Key``.
``broker-restart``      the private broker (``--broker``: redis-server, whose queued task messages are
                        lost, or a RabbitMQ node) is killed mid-run and restarted on the same port; posts
                        go on before, during and after; the sweep re-dispatches lost turns; every worker
                        must reconnect, none may exit.
"""
from __future__ import annotations

import os
import random
import threading
import time
import uuid
from argparse import Namespace
from collections import Counter
from collections.abc import Callable
from typing import Any

from devtools.faults.record import TERMINAL, Posted, Record
from devtools.faults.supervisor import HttpError, Proc, Stack, log
from devtools.processes import CodexProcess, ancestors, codex_processes


class Scenario:
    """A scenario's handle on the stack: makes sessions, posts inputs and records what was accepted."""

    def __init__(self, stack: Stack, args: Namespace, name: str):
        self.stack, self.args = stack, args
        self.rec = Record(name)
        self.tag = f"{name}-{uuid.uuid4().hex[:6]}"

    def new_session(self) -> str:
        sid = f"{self.tag}-s{len(self.rec.sessions) + 1}"
        status, data = self.stack.call("POST", "/sessions/", {"id": sid, "title": self.rec.name})
        if status != 201:
            raise RuntimeError(f"session create: {status} {data}")
        self.rec.sessions.append(sid)
        return sid

    def _refused(self, session_id: str, text: str, *, violation: str | None = None, http_5xx: str | None = None) -> None:
        with self.rec.lock:
            if violation:
                self.rec.violations.append(violation)
            if http_5xx:
                self.rec.http_5xx.append(http_5xx)
            self.rec.unanswered.append((session_id, text))

    def post(self, session_id: str, text: str, key: str | None = None) -> dict[str, Any] | None:
        """POST an input; records the 202 (a repeat of an Idempotency-Key is recorded once)."""
        headers = {"Idempotency-Key": key} if key else None
        t0 = time.time()
        try:
            status, data = self.stack.call("POST", f"/sessions/{session_id}/turns/", {"input": text}, headers=headers)
        except HttpError as exc:
            self._refused(session_id, text, http_5xx=f"POST turns ({text[:40]}…): {exc}")
            return None
        except OSError as exc:
            self._refused(session_id, text, violation=f"POST turns ({text[:40]}…) got no answer: {exc}")
            return None
        if status != 202:
            self._refused(session_id, text, violation=f"POST turns answered {status}: {str(data)[:200]}")
            return None
        with self.rec.lock:
            if not any(p.turn_id == data["id"] for p in self.rec.posted):
                self.rec.posted.append(Posted(data["id"], session_id, text, t0))
        return data

    def text(self, i: int, slow: bool = False, slow_for: float | None = None) -> str:
        """A unique input; ``slow``: its reply streams for ``--slow-seconds`` (the stand-in's ``SLOW``), or
        for ``slow_for`` seconds (``SLOW<n>``)."""
        if slow_for is not None:
            return f"{self.tag} input {i} {uuid.uuid4().hex[:8]} SLOW{slow_for:g}"
        return f"{self.tag} input {i} {uuid.uuid4().hex[:8]}" + (" SLOW" if slow else "")

    def wait_terminal(self) -> None:
        """Until every accepted turn is terminal (via the ORM: cheap), bounded by ``--bound``
        after the last post."""
        from hermes_sessions.models import Turn

        last_post = max((p.posted_at for p in self.rec.posted), default=time.time())
        ids = [p.turn_id for p in self.rec.posted]
        while True:
            open_ = Turn.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).count()
            if open_ == 0:
                return
            if time.time() - last_post > self.args.bound:
                return
            time.sleep(0.5)


# --------------------------------------------------------------------------------------- kill-worker


def _started(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _worker_running(stack: Stack, session_id: str, procs: list[CodexProcess]) -> Proc | None:
    """The turn worker whose codex process (one of ``procs``) works in the session's directory, if any.
    Two may have one there for a moment (session affinity): the worker keeping the thread loaded from the
    session's last turn, idle, while another runs the next turn cold — the running one was started last."""
    workdir = os.path.join(stack.work_root, session_id)
    found = []
    for cp in procs:
        if cp.cwd != workdir:
            continue
        chain = ancestors(cp.pid)
        owner = next((w for w in stack.workers if w.pid in chain), None)
        if owner is not None:
            found.append((_started(cp.pid), owner))
    return max(found, key=lambda f: f[0])[1] if found else None


def _find_victim(sc: Scenario, killed_turns: Counter[str], timeout: float = 60) -> tuple[str, str, Proc] | None:
    """A SLOW turn running on a worker: ``(turn id, session id, that worker)``, within ``timeout`` s."""
    from hermes_sessions.models import Turn

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = list(Turn.objects.filter(pk__in=[p.turn_id for p in sc.rec.posted], status="running",
                                           input__endswith="SLOW").values_list("pk", "session_id", "attempt"))
        # Prefer a turn killed least often, so one turn is not killed into HERMES_MAX_ATTEMPTS.
        running.sort(key=lambda r: (killed_turns[str(r[0])], r[2]))
        procs = codex_processes(sc.stack.codex_home)
        for tid, sid, _attempt in running:
            owner = _worker_running(sc.stack, sid, procs)
            if owner is not None:
                return str(tid), sid, owner
        time.sleep(0.1)
    return None


def scenario_kill_worker(sc: Scenario) -> None:
    a, stack = sc.args, sc.stack
    sessions = [sc.new_session() for _ in range(a.kill_sessions)]
    i = 0
    for s in sessions:  # each session starts its thread with a normal turn
        i += 1
        sc.post(s, sc.text(i))
    killed_turns: Counter[str] = Counter()
    for rnd in range(a.kill_rounds):
        for s in sessions:
            sc.post(s, sc.text(i + 1, slow=True))
            sc.post(s, sc.text(i + 2))
            i += 2
        victim = _find_victim(sc, killed_turns)
        if victim is None:
            sc.rec.notes.append(f"round {rnd + 1}: no SLOW turn seen running on a worker within 60 s")
            continue
        tid, sid, owner = victim
        time.sleep(random.uniform(0.0, min(2.5, a.slow_seconds * 0.6)))  # land in different phases of the turn
        log(f"kill-worker round {rnd + 1}: kill -9 {owner.name} (pid group {owner.pid}) running turn {tid[:8]} of {sid}")
        stack.kill9_worker(owner)
        killed_turns[tid] += 1
        stack.wait_ready(stack.start_worker())
    kills = sum(killed_turns.values())
    sc.rec.runs = kills
    sc.rec.notes.append(f"{kills} workers killed mid-turn; {len(killed_turns)} distinct turns hit")


# --------------------------------------------------------------------------------------- duplicate-delivery


def _duplicates_while_running(sc: Scenario, ids: list[str]) -> set[str]:
    """Two more deliveries of each turn as soon as it is seen running; returns the turns so hit."""
    from hermes_sessions.models import Turn

    seen_running: set[str] = set()
    deadline = time.monotonic() + sc.args.bound
    while time.monotonic() < deadline:
        rows = dict(Turn.objects.filter(pk__in=ids).values_list("pk", "status"))
        for tid, status in rows.items():
            if status == "running" and str(tid) not in seen_running:
                seen_running.add(str(tid))
                sc.stack.send_duplicate(str(tid))
                sc.stack.send_duplicate(str(tid))
        if all(s in TERMINAL for s in rows.values()):
            break
        time.sleep(0.05)
    return seen_running


def _finished_state(ids: list[str]) -> tuple[dict[str, dict[str, Any]], Counter[str]]:
    """The turns' outcome fields and their message counts, to compare before and after late duplicates."""
    from hermes_sessions.models import Message, Turn

    turns = {str(t["pk"]): t for t in Turn.objects.filter(pk__in=ids).values(
        "pk", "status", "finished_at", "attempt", "codex_thread_id", "final_text")}
    msgs = Counter(str(t) for t in Message.objects.filter(turn_id__in=ids).values_list("turn_id", flat=True))
    return turns, msgs


def _late_duplicates(sc: Scenario, ids: list[str]) -> None:
    """A third delivery of every finished turn; they drain; nothing may have changed."""
    before = _finished_state(ids)
    for tid in ids:
        sc.stack.send_duplicate(tid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sc.stack.queue_length() > 0:
        time.sleep(0.2)
    time.sleep(3)  # the last reserved duplicates run (each is a no-op claim)
    after = _finished_state(ids)
    if before != after:
        changed = [tid for tid in ids if before[0].get(tid) != after[0].get(tid) or before[1][tid] != after[1][tid]]
        sc.rec.violations.append(f"a late duplicate delivery changed {len(changed)} finished turn(s): {changed[:3]}")


def scenario_duplicate_delivery(sc: Scenario) -> None:
    a, stack = sc.args, sc.stack
    sessions = [sc.new_session() for _ in range(a.dup_sessions)]
    sent = 0
    i = 0
    for rnd in range(a.dup_turns):
        for s in sessions:
            i += 1
            turn = sc.post(s, sc.text(i, slow=(rnd % 2 == 1)))
            if turn is None:
                continue
            stack.send_duplicate(turn["id"])  # queued (or about to be claimed): a second delivery at once
            sent += 1
    ids = [p.turn_id for p in sc.rec.posted]
    seen_running = _duplicates_while_running(sc, ids)
    sent += 2 * len(seen_running)
    sc.wait_terminal()
    _late_duplicates(sc, ids)
    sent += len(ids)
    sc.rec.runs = sent
    sc.rec.notes.append(f"{sent} extra deliveries of run_turn ({len(seen_running)} while running, {len(ids)} after finishing)")


# --------------------------------------------------------------------------------------- concurrent-posts


def _post_at_once(sc: Scenario, sid: str, jobs: list[tuple[str, str | None]]) -> dict[int, dict[str, Any] | None]:
    """Every ``(text, key)`` of ``jobs`` POSTed from its own thread, released together by a barrier."""
    barrier = threading.Barrier(len(jobs))
    results: dict[int, dict[str, Any] | None] = {}

    def worker(n: int, text: str, key: str | None) -> None:
        barrier.wait()
        results[n] = sc.post(sid, text, key)

    threads = [threading.Thread(target=worker, args=(n, t, k)) for n, (t, k) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def scenario_concurrent_posts(sc: Scenario) -> None:
    a = sc.args
    sid = sc.new_session()
    n_keys = a.idem_keys
    plain = a.concurrent_posts - 2 * n_keys
    jobs: list[tuple[str, str | None]] = [(sc.text(i), None) for i in range(plain)]
    keyed = []
    for k in range(n_keys):
        text, key = sc.text(1000 + k), f"{sc.tag}-key-{k}"
        keyed.append((text, key))
        jobs += [(text, key), (text, key)]
    random.shuffle(jobs)
    results = _post_at_once(sc, sid, jobs)
    # Each Idempotency-Key pair must have answered with one and the same turn.
    for _text, key in keyed:
        ids = {r["id"] for n, r in results.items() if r is not None and jobs[n][1] == key}
        if len(ids) != 1:
            sc.rec.violations.append(f"Idempotency-Key {key} answered with {len(ids)} different turns")
    # The same key with another body is refused and creates nothing.
    if keyed:
        text, key = keyed[0]
        status, _ = sc.stack.call("POST", f"/sessions/{sid}/turns/", {"input": text + " changed"},
                                  headers={"Idempotency-Key": key})
        if status not in (409, 422):
            sc.rec.violations.append(f"Idempotency-Key reused with another body answered {status}, not 409/422")
    sc.rec.runs = len(jobs)
    sc.rec.notes.append(f"{len(jobs)} concurrent POSTs to one session ({n_keys} keys sent twice)")


# --------------------------------------------------------------------------------------- broker-restart


def _posting(sc: Scenario, sessions: list[str], stop: threading.Event) -> list[threading.Thread]:
    """One thread per session posting inputs (every third SLOW) every ``--broker-post-every`` s (a
    uniform draw between its two bounds) until ``stop``."""
    counter = iter(range(1, 1_000_000))
    low, high = sc.args.broker_post_every

    def poster(s: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sc.post(s, sc.text(next(counter), slow=(n % 3 == 0)))
            stop.wait(random.uniform(low, high))

    threads = [threading.Thread(target=poster, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    return threads


RECONNECTED = "Connected to "  # a Celery consumer's line once it has (re)connected to the broker


def _connections(stack: Stack) -> dict[str, int]:
    """How many times each running worker (and the sweeper) has logged that it connected."""
    procs = [*stack.workers, stack.procs[2]]
    return {p.name: p.log_path.read_text(errors="replace").count(RECONNECTED) for p in procs if p.alive()}


def _wait_reconnected(sc: Scenario, rnd: int, before: dict[str, int], timeout: float = 60.0) -> None:
    """Until every worker that was connected before the kill has connected again (Celery's retries back
    off: 2, 4, 6 … s); one that has not after ``timeout`` s is a violation, one that exited is counted
    by ``_count_broker_crashes``."""
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    while True:
        now = _connections(sc.stack)
        behind = [name for name, n in before.items() if name in now and now[name] <= n]
        if not behind:
            log(f"broker-restart round {rnd}: every worker reconnected within {time.monotonic() - t0:.1f} s")
            return
        if time.monotonic() > deadline:
            sc.rec.violations.append(f"broker restart {rnd}: {', '.join(behind)} had not reconnected "
                                     f"{timeout:.0f} s after the broker came back")
            return
        time.sleep(0.2)


def _restart_broker(sc: Scenario, rnd: int, posting_since: float) -> int:
    """Post until ``--broker-before`` s after ``posting_since``, kill the private broker, keep it away
    ``--broker-down`` s or for as long as a replacement takes to boot, whichever is longer, wait for the
    workers to reconnect, replace (and count) workers that exited meanwhile; returns how many task
    messages were in the broker when it died.

    The backlog is read within the ``--broker-before`` window (``rabbitmqctl`` alone takes seconds), and
    a broker that boots slower than ``--broker-down`` (a RabbitMQ node: 9–17 s on a loaded 2-core
    machine) is started at once after the kill: its boot *is* the outage. Before, both came on top, and
    the posters ran ≈ 63 s on RabbitMQ instead of ≈ 28 s on Redis."""
    a, stack = sc.args, sc.stack
    queued, unacked = stack.broker_backlog()
    time.sleep(max(0.0, posting_since + a.broker_before - time.monotonic()))
    before = _connections(stack)
    log(f"broker-restart round {rnd}: SIGKILL the {stack.broker.describe()}; "
        f"{queued} queued and {unacked} unacknowledged task message(s) {stack.broker.loses_messages()}")
    stack.broker.kill9()
    killed = time.monotonic()
    if not stack.broker.boots_slowly:
        time.sleep(a.broker_down)
    stack.broker.start(stack.env)
    down = time.monotonic() - killed
    log(f"broker-restart round {rnd}: broker back on port {stack.broker.port} after {down:.1f} s down")
    sc.rec.notes.append(f"broker restart {rnd}: down {down:.1f} s")
    time.sleep(min(a.broker_before, 3.0))  # the workers reconnect (or die) meanwhile
    _count_broker_crashes(sc, rnd)
    _wait_reconnected(sc, rnd, before)
    return max(queued, 0) + max(unacked, 0)


def _count_broker_crashes(sc: Scenario, rnd: int) -> None:
    """Replace workers that exited after the broker restart, counting them as supervisor restarts (each
    one fails the run: project/broker.py keeps a worker alive through a broker restart)."""
    for dead in sc.stack.reap_dead():
        log(f"broker-restart round {rnd}: {dead}; restarted (supervisor)")
        sc.rec.worker_restarts += 1
        sc.rec.notes.append(f"after broker restart {rnd}: {dead}; restarted as a supervisor would")


def scenario_broker_restart(sc: Scenario) -> None:
    a = sc.args
    sessions = [sc.new_session() for _ in range(a.broker_sessions)]
    stop = threading.Event()
    threads = _posting(sc, sessions, stop)
    restarts = lost_msgs = 0
    try:
        for rnd in range(a.broker_restarts):
            lost_msgs += _restart_broker(sc, rnd + 1, time.monotonic())
            restarts += 1
        time.sleep(a.broker_after)
    finally:
        stop.set()
        for t in threads:
            t.join()
    # A worker can still be shutting down from the last restart's crash when the round's wait ends;
    # it is that restart's doing, not a worker dying on its own (which check_stack reports).
    _count_broker_crashes(sc, restarts)
    sc.rec.runs = restarts
    sc.rec.notes.append(f"{restarts} broker restarts; {lost_msgs} task message(s) were in the broker when it died")


SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "kill-worker": scenario_kill_worker,
    "duplicate-delivery": scenario_duplicate_delivery,
    "concurrent-posts": scenario_concurrent_posts,
    "broker-restart": scenario_broker_restart,
}
