"""``make bench-approvals`` — what turns that wait for a person hold, measured on the production shape:
N turns waiting for an approval at once on one host, while other sessions' turns still run and finish.

The stack (``bench_stacks.Stack``): gunicorn serving the API as ``make run`` does (ASGI, two uvicorn
workers), ``--workers`` Celery worker processes (``celery -A project worker -c <--concurrency>``, as
``make worker`` runs them; its default ``-c 1``), the model stand-in, the real codex binary, the
worker settings' defaults (no spare app-servers, threads kept loaded by ``-c 1`` workers).

1. ``--waiting`` sessions with ``{"sandbox": "workspace-write", "approval_policy": "untrusted"}`` each get
   the input ``RUNCMD touch approved.txt && echo <mark>``: codex asks
   ``item/commandExecution/requestApproval`` and the turn waits for a person. The bench waits until that
   many approvals are pending (read from PostgreSQL, then counted once through the API's
   ``GET /api/sessions/{id}/approvals/?status=pending``), or until the count has not moved for
   ``--settle`` seconds while every worker slot runs a waiting turn, or ``--pending-within`` seconds.
2. With those waiting, one sample of what the stack holds against one taken before any turn
   (``Holdings``): turns running and queued against the worker slots (workers × concurrency); the
   codex app-servers alive, which sessions they run (their ``CODEX_HOME``), and their memory with
   their children (USS, PSS, RSS: ``warm.process_memory.tree_memory``); the Celery pool processes'
   threads and memory; the stack's PostgreSQL connections (``pg_stat_activity`` rows of the bench
   database, each matched to the process holding its socket by its client port) and their states; the
   CPU the worker trees use while the turns wait.
3. ``--others`` other sessions (default model_config: nobody is asked) get ``--other-turns`` turns each,
   one after another; the figures say how many ended while the approvals waited (within
   ``--others-within`` seconds) and how long each took (the turn row's ``created_at`` → ``finished_at``).
4. Every pending approval is accepted through ``POST /api/approvals/{id}/decision/`` (and those asked
   later, when a slot frees up); every approval turn must succeed with the command's output in a
   ``tool`` row of its transcript and ``approved.txt`` in its work directory, and every other turn must
   succeed.
5. For comparison, as many fresh sessions as in 3 get the same turns with nothing waiting
   (``…_nothing_waiting``).

Printed: a ``key: value`` block (``figures``). Exit status 1 if any turn failed or was lost (not
ended within ``--finish-within`` seconds). Run as ``python -m devtools.bench_approvals [--workers 2]
[--concurrency 1] [--waiting 20] [--others 10]`` with ``DATABASE_URL`` and ``CELERY_BROKER_URL``
(``make bench-approvals`` sets them); a scratch database beside ``DATABASE_URL``, dropped afterwards."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devtools.bench import _environment, _setup_django, _start_stand_in
from devtools.bench_stacks import TERMINAL, Stack, StackClient, stack_environment, stop_processes
from devtools.bench_throughput import wait_for_workers
from devtools.databases import database_beside, drop_database

if TYPE_CHECKING:
    from hermes_sessions.worker.warm.process_memory import Memory

# ``hermes_sessions`` is imported inside the functions: it loads the models, which may happen only after
# ``bench._setup_django`` has pointed this process at the bench database.

UNTRUSTED = {"sandbox": "workspace-write", "approval_policy": "untrusted"}
POLL_SECONDS = 0.05
CPU_WINDOW_SECONDS = 5.0


# ------------------------------------------------------------------------------------------- pure parts


def session_of_home(codex_home: str, homes_root: str) -> str | None:
    """The session whose home ``codex_home`` is (``<CODEX_HOMES_ROOT>/<session id>/home``,
    ``codex.launch.session_home``); ``None`` for any other path (the shared ``CODEX_HOME``)."""
    home, root = Path(codex_home), Path(homes_root)
    if home.name != "home" or home.parent.parent != root:
        return None
    return home.parent.name


def cpu_ticks(stat: str) -> int:
    """``utime + stime`` (clock ticks) from the text of ``/proc/<pid>/stat``; 0 for an empty text. The
    command name (field 2) is in parentheses and may hold spaces, so the fields are counted after the
    last ``)``: utime and stime are fields 14 and 15 of the whole line."""
    if ")" not in stat:
        return 0
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def query_label(sql: str) -> str:
    """A connection's last statement in two words: its verb and the first table it names
    (``SELECT hermes_sessions_approval``), the verb alone when it names none (``LISTEN``), ``none``."""
    words = sql.split()
    if not words:
        return "none"
    table = re.search(r'\b(?:FROM|UPDATE|INTO)\s+"?([\w.]+)"?', sql, re.IGNORECASE)
    return f"{words[0].upper()} {table.group(1)}" if table else words[0].upper()


@dataclass
class Connections:
    """The stack's PostgreSQL connections counted per role (``api``, ``worker_main``, ``worker_pool``;
    ``other`` when no stack process holds the socket), per ``role/state`` and per ``role:last statement``."""

    by_role: Counter[str] = field(default_factory=Counter)
    by_state: Counter[str] = field(default_factory=Counter)
    by_query: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, rows: list[tuple[int | None, str | None, str | None]], owners: dict[int, str]) -> Connections:
        """``rows``: ``(client_port, state, query)`` of ``pg_stat_activity``; ``owners``: client port → the
        role of the process holding that socket."""
        out = cls()
        for port, state, query in rows:
            role = owners.get(port or 0, "other")
            out.by_role[role] += 1
            out.by_state[f"{role}/{state or 'none'}"] += 1
            out.by_query[f"{role}:{query_label(query or '')}"] += 1
        return out

    def queries_of(self, role: str) -> str:
        """``label=count`` of ``role``'s connections, most first."""
        return ", ".join(f"{k.split(':', 1)[1]}={v}" for k, v in self.by_query.most_common() if k.startswith(f"{role}:"))


def pending_reason(*, pending: int, target: int, running: int, queued: int, slots: int) -> str:
    """Why ``pending`` of ``target`` approvals were pending when the bench stopped waiting."""
    if pending >= target:
        return "all asked"
    if running >= slots and queued:
        return (f"every worker slot ({slots}) runs a turn that waits for a person; the other {queued} "
                f"approval turns are queued behind them")
    return f"{running} turns running on {slots} slots, {queued} queued: codex had not asked yet"


@dataclass
class Holdings:
    """One sample of the stack. ``running``/``queued``: turns of the bench by status; ``pending``:
    pending approvals; ``app_servers``: every codex app-server alive under the pool processes with its
    session (``None``: no session home) and memory (with its children); ``pool_threads``: threads of
    all pool processes; ``pool_private_kb``/``pool_pss_kb``: their own memory (app-servers not included);
    ``connections``: the stack's PostgreSQL connections."""

    running: int = 0
    queued: int = 0
    pending: int = 0
    app_servers: list[tuple[str | None, Memory]] = field(default_factory=list)
    pool_processes: int = 0
    pool_threads: int = 0
    main_threads: int = 0
    pool_private_kb: int = 0
    pool_pss_kb: int = 0
    connections: Connections = field(default_factory=Connections)

    def app_servers_of(self, sessions: set[str]) -> list[Memory]:
        return [m for sid, m in self.app_servers if sid in sessions]


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else 0.0


def _per_turn(total: float, turns: int) -> float:
    return round(total / turns, 2) if turns else 0.0


def held_figures(idle: Holdings, waiting: Holdings, sessions: set[str]) -> dict[str, Any]:
    """What the waiting turns hold: ``waiting`` against ``idle``, in total and per waiting turn (the
    pending approvals of ``waiting``). Memory in kB."""
    n = waiting.pending
    mine = waiting.app_servers_of(sessions)
    conns = waiting.connections.by_role["worker_pool"] - idle.connections.by_role["worker_pool"]
    threads = waiting.pool_threads - idle.pool_threads
    pool_private = waiting.pool_private_kb - idle.pool_private_kb
    return {
        "app_servers_alive": len(waiting.app_servers),
        "app_servers_of_waiting_turns": len(mine),
        "app_server_private_kb_median": _median([m.private_kb for m in mine]),
        "app_server_pss_kb_median": _median([m.pss_kb for m in mine]),
        "app_server_rss_kb_median": _median([m.rss_kb for m in mine]),
        "app_servers_private_kb_total": sum(m.private_kb for m in mine),
        "app_servers_pss_kb_total": sum(m.pss_kb for m in mine),
        "app_servers_rss_kb_total": sum(m.rss_kb for m in mine),
        "pool_processes": waiting.pool_processes,
        "pool_threads_idle": idle.pool_threads,
        "pool_threads_waiting": waiting.pool_threads,
        "pool_threads_per_waiting_turn": _per_turn(threads, n),
        "pool_private_kb_idle": idle.pool_private_kb,
        "pool_private_kb_idle_per_process": _per_turn(idle.pool_private_kb, idle.pool_processes),
        "pool_private_kb_waiting": waiting.pool_private_kb,
        "pool_pss_kb_waiting": waiting.pool_pss_kb,
        "pool_private_kb_per_waiting_turn": _per_turn(pool_private, n),
        "pg_connections_idle": sum(idle.connections.by_role.values()),
        "pg_connections_waiting": sum(waiting.connections.by_role.values()),
        "pg_connections_pool_idle": idle.connections.by_role["worker_pool"],
        "pg_connections_pool_waiting": waiting.connections.by_role["worker_pool"],
        "pg_connections_per_waiting_turn": _per_turn(conns, n),
        "pg_connections_by_role_state": " ".join(f"{k}={v}" for k, v in sorted(waiting.connections.by_state.items())),
        "pg_pool_last_statement_idle": idle.connections.queries_of("worker_pool"),
        "pg_pool_last_statement_waiting": waiting.connections.queries_of("worker_pool"),
    }


# ------------------------------------------------------------------------------------- reading the stack


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _codex_home(pid: int) -> str:
    for entry in _read(f"/proc/{pid}/environ").split("\0"):
        if entry.startswith("CODEX_HOME="):
            return entry.split("=", 1)[1]
    return ""


@dataclass
class Processes:
    """The stack's processes by role: gunicorn's (``api``), the Celery main processes, their pool
    processes, and the app-servers under those (the codex binary, not Python)."""

    api: list[int]
    mains: list[int]
    pools: list[int]
    app_servers: list[int]

    @classmethod
    def of(cls, stack: Stack) -> Processes:
        from hermes_sessions.worker.warm.process_memory import children

        api = [stack.gunicorn.pid, *children(stack.gunicorn.pid)] if stack.gunicorn is not None else []
        mains = [w.pid for w in stack.workers]
        pools = [c for m in mains for c in children(m) if _is_python(c)]
        app_servers = [c for p in pools for c in children(p) if not _is_python(c)]
        return cls(api=api, mains=mains, pools=pools, app_servers=app_servers)

    def port_owners(self, pg_port: int) -> dict[int, str]:
        """Local port → role for every TCP connection of these processes to PostgreSQL's ``pg_port``."""
        import psutil

        owners: dict[int, str] = {}
        for role, pids in (("api", self.api), ("worker_main", self.mains), ("worker_pool", self.pools)):
            for pid in pids:
                try:
                    conns = psutil.Process(pid).net_connections(kind="tcp")
                except psutil.Error:
                    continue
                for c in conns:
                    if c.raddr and c.raddr.port == pg_port:
                        owners[c.laddr.port] = role
        return owners

    def cpu_ticks(self) -> tuple[int, int]:
        """CPU ticks so far of the Celery processes (main and pool) and of the app-servers."""
        def ticks(pids: list[int]) -> int:
            return sum(cpu_ticks(_read(f"/proc/{pid}/stat")) for pid in pids)

        return ticks(self.mains + self.pools), ticks(self.app_servers)


def _pg_rows(db_name: str) -> list[tuple[int | None, str | None, str | None]]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT client_port, state, query FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()", [db_name])
        return list(cur.fetchall())


def _turn_counts(turn_ids: list[str]) -> Counter[str]:
    from hermes_sessions.models import Turn

    return Counter(Turn.objects.filter(pk__in=turn_ids).values_list("status", flat=True))


def _pending_count(sessions: list[str]) -> int:
    from hermes_sessions.models import Approval

    return Approval.objects.filter(session_id__in=sessions, status=Approval.Status.PENDING).count()


def sample(stack: Stack, *, db_url: str, homes_root: str, turn_ids: list[str], sessions: list[str]) -> Holdings:
    """One ``Holdings`` of ``stack``: turns and approvals from PostgreSQL, processes from ``/proc``."""
    from hermes_sessions.worker.warm.process_memory import process_memory, tree_memory

    url = urllib.parse.urlsplit(db_url)
    procs = Processes.of(stack)
    connections = Connections.of(_pg_rows(url.path.lstrip("/")), procs.port_owners(url.port or 5432))
    counts = _turn_counts(turn_ids)
    pool = [process_memory(pid) for pid in procs.pools]
    return Holdings(
        running=counts["running"], queued=counts["queued"], pending=_pending_count(sessions),
        app_servers=[(session_of_home(_codex_home(p), homes_root), tree_memory(p)) for p in procs.app_servers],
        pool_processes=len(procs.pools), pool_threads=sum(_threads(p) for p in procs.pools),
        main_threads=sum(_threads(p) for p in procs.mains),
        pool_private_kb=sum(m.private_kb for m in pool), pool_pss_kb=sum(m.pss_kb for m in pool),
        connections=connections)


def cpu_percent(stack: Stack, seconds: float) -> tuple[float, float]:
    """CPU the worker trees used over ``seconds``, in % of one core: (Celery's main and pool processes,
    the app-servers). An app-server's sandboxed children are not counted."""
    procs = Processes.of(stack)
    start = procs.cpu_ticks()
    time.sleep(seconds)
    end = procs.cpu_ticks()
    per_tick = 100 / os.sysconf("SC_CLK_TCK") / seconds
    return round((end[0] - start[0]) * per_tick, 1), round((end[1] - start[1]) * per_tick, 1)


# ------------------------------------------------------------------------------------------ driving turns


class Others:
    """The other sessions' turns: each session's next turn posted once its previous one ended."""

    def __init__(self, client: StackClient, sessions: list[str], turns_each: int):
        self.client, self.turns_each = client, turns_each
        self.left = {sid: turns_each for sid in sessions}
        self.current: dict[str, str] = {}
        self.ended: dict[str, tuple[str, float, float]] = {}  # turn id → status, seconds, ended at (epoch)
        self.posted: list[str] = []

    def step(self) -> None:
        """Post what is due; collect the turns that ended (from PostgreSQL)."""
        from hermes_sessions.models import Turn

        if self.current:
            session_of = {t: s for s, t in self.current.items()}
            rows = Turn.objects.filter(pk__in=list(session_of), status__in=TERMINAL)
            for turn in rows.only("id", "status", "created_at", "finished_at"):
                finished = turn.finished_at or turn.created_at
                self.ended[str(turn.pk)] = (turn.status, (finished - turn.created_at).total_seconds(),
                                            finished.timestamp())
                del self.current[session_of[str(turn.pk)]]
        for sid, left in self.left.items():
            if left and sid not in self.current:
                turn = self.client.post_turn(f"other turn {self.turns_each - left + 1}", sid)["turn"]
                self.current[sid] = str(turn["id"])
                self.posted.append(str(turn["id"]))
                self.left[sid] = left - 1

    @property
    def done(self) -> bool:
        return not self.current and not any(self.left.values())


def _post_waiting(client: StackClient, sessions: list[str]) -> dict[str, tuple[str, str]]:
    """One approval turn per session; session → (turn id, the mark its command echoes)."""
    out = {}
    for sid in sessions:
        mark = f"ran-{uuid.uuid4().hex[:10]}"
        turn = client.post_turn(f"RUNCMD touch approved.txt && echo {mark}", sid)["turn"]
        out[sid] = (str(turn["id"]), mark)
    return out


def _wait_pending(*, target: int, sessions: list[str], turn_ids: list[str], slots: int, within: float,
                  settle: float) -> tuple[int, float, str]:
    """Until ``target`` approvals are pending, or the count has not moved for ``settle`` s while every
    slot runs a turn and others are queued, or ``within`` s; (pending, seconds, why)."""
    t0 = last_change = time.monotonic()
    pending = -1
    while True:
        now_pending = _pending_count(sessions)
        counts = _turn_counts(turn_ids)
        if now_pending != pending:
            pending, last_change = now_pending, time.monotonic()
        stuck = counts["running"] >= slots and counts["queued"] and time.monotonic() - last_change >= settle
        if pending >= target or stuck or time.monotonic() - t0 >= within:
            seconds = (last_change if pending < target else time.monotonic()) - t0
            why = pending_reason(pending=pending, target=target, running=counts["running"],
                                 queued=counts["queued"], slots=slots)
            return pending, round(seconds, 2), why
        time.sleep(0.2)


def _api_pending(client: StackClient, sessions: list[str]) -> int:
    return sum(client.call("GET", f"/sessions/{sid}/approvals/?status=pending")["count"] for sid in sessions)


def _accept_all(client: StackClient, waiting: dict[str, tuple[str, str]], others: Others, within: float) -> float:
    """Accept every approval as it becomes pending until every approval turn ended (or ``within`` s),
    driving ``others`` meanwhile; returns the seconds it took."""
    from hermes_sessions.models import Approval

    t0 = time.monotonic()
    turn_ids = [t for t, _ in waiting.values()]
    accepted: set[str] = set()
    while time.monotonic() - t0 < within:
        for approval_id in Approval.objects.filter(session_id__in=list(waiting), status=Approval.Status.PENDING) \
                .exclude(pk__in=accepted).values_list("pk", flat=True):
            client.call("POST", f"/approvals/{approval_id}/decision/", {"decision": "accept"})
            accepted.add(str(approval_id))
        others.step()
        counts = _turn_counts(turn_ids)
        if sum(counts[s] for s in TERMINAL) == len(turn_ids):
            break
        time.sleep(POLL_SECONDS)
    return round(time.monotonic() - t0, 2)


def _finish_others(others: Others, within: float) -> None:
    t0 = time.monotonic()
    while not others.done and time.monotonic() - t0 < within:
        others.step()
        time.sleep(POLL_SECONDS)


def _approval_outcomes(client: StackClient, waiting: dict[str, tuple[str, str]], work_root: str) -> dict[str, Any]:
    """Each approval turn's end: succeeded with its mark in a ``tool`` row (through the API) and
    ``approved.txt`` written; the decision → end times (ms) of those accepted."""
    from hermes_sessions.models import Approval, Turn

    ok, failed, lost, decided_to_end = 0, [], [], []
    for sid, (turn_id, mark) in waiting.items():
        turn = Turn.objects.get(pk=turn_id)
        if turn.status not in TERMINAL:
            lost.append(turn_id)
            continue
        rows = client.call("GET", f"/sessions/{sid}/messages/?page_size=200")["results"]
        in_transcript = any(r["role"] == "tool" and mark in (r["content"] or "") for r in rows)
        written = (Path(work_root) / sid / "approved.txt").exists()
        if turn.status == "succeeded" and in_transcript and written:
            ok += 1
        else:
            failed.append(f"{turn_id} {turn.status} transcript={in_transcript} file={written} {turn.error[:200]}")
        approval = Approval.objects.filter(turn_ref=turn_id, status=Approval.Status.ACCEPTED).first()
        if approval is not None and approval.decided_at and turn.finished_at:
            decided_to_end.append((turn.finished_at - approval.decided_at).total_seconds() * 1000)
    return {"ok": ok, "failed": failed, "lost": lost, "decided_to_end_ms": decided_to_end}


# -------------------------------------------------------------------------------------------------- main


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_approvals",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Celery worker processes")
    parser.add_argument("--concurrency", type=int, default=1, help="each worker's -c (make worker's WORKER_CONCURRENCY)")
    parser.add_argument("--waiting", type=int, default=20, help="sessions whose turn waits for an approval")
    parser.add_argument("--others", type=int, default=10, help="other sessions, whose turns nobody is asked about")
    parser.add_argument("--other-turns", type=int, default=2, help="turns of each other session")
    parser.add_argument("--pending-within", type=float, default=120.0)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="stop waiting for approvals when the count has not moved this long with every slot busy")
    parser.add_argument("--others-within", type=float, default=60.0)
    parser.add_argument("--finish-within", type=float, default=600.0)
    return parser.parse_args(argv)


def _print(figures: dict[str, Any]) -> None:
    for key, value in figures.items():
        print(f"{key}: {value}")


def run(args: argparse.Namespace, stack: Stack, client: StackClient, env: dict[str, str]) -> int:
    """The measurement on a started stack (module docstring); prints the figures, returns the exit status."""
    waiting_sessions = [f"{client.session_id}-wait-{i}" for i in range(args.waiting)]
    other_sessions = [f"{client.session_id}-other-{i}" for i in range(args.others)]
    for sid in waiting_sessions:
        client.call("POST", "/sessions/", {"id": sid, "model_config": UNTRUSTED})
    alone_sessions = [f"{client.session_id}-alone-{i}" for i in range(args.others)]
    for sid in other_sessions + alone_sessions:
        client.make_session(sid)
    slots = args.workers * args.concurrency
    where = {"db_url": env["DATABASE_URL"], "homes_root": str(Path(env["CODEX_HOMES_ROOT"]).resolve())}
    time.sleep(3)  # the pool processes' first sweep rounds open their connections
    idle = sample(stack, turn_ids=[], sessions=waiting_sessions, **where)
    cpu_idle = cpu_percent(stack, CPU_WINDOW_SECONDS)

    waiting = _post_waiting(client, waiting_sessions)
    turn_ids = [t for t, _ in waiting.values()]
    pending, pending_s, why = _wait_pending(target=args.waiting, sessions=waiting_sessions, turn_ids=turn_ids,
                                            slots=slots, within=args.pending_within, settle=args.settle)
    time.sleep(1)
    held = sample(stack, turn_ids=turn_ids, sessions=waiting_sessions, **where)
    cpu = cpu_percent(stack, CPU_WINDOW_SECONDS)
    api_pending = _api_pending(client, waiting_sessions)

    others = Others(client, other_sessions, args.other_turns)
    t_others = time.monotonic()
    while not others.done and time.monotonic() - t_others < args.others_within:
        others.step()
        time.sleep(POLL_SECONDS)
    during = dict(others.ended)
    still_pending = _pending_count(waiting_sessions)
    accept_s = _accept_all(client, waiting, others, args.finish_within)
    _finish_others(others, args.finish_within)
    outcome = _approval_outcomes(client, waiting, env["CODEX_WORK_ROOT"])
    alone = Others(client, alone_sessions, args.other_turns)
    _finish_others(alone, args.finish_within)

    other_failed = [t for o in (others, alone) for t, (status, _, _) in o.ended.items() if status != "succeeded"]
    other_lost = [t for o in (others, alone) for t in o.posted if t not in o.ended]
    figures: dict[str, Any] = {
        "workers": args.workers, "concurrency": args.concurrency, "worker_slots": slots,
        "waiting_turns_posted": args.waiting, "approvals_pending": pending, "approvals_pending_api": api_pending,
        "approvals_pending_seconds": pending_s, "approvals_pending_why": why,
        "turns_running_while_waiting": held.running, "turns_queued_while_waiting": held.queued,
        **held_figures(idle, held, set(waiting_sessions)),
        "worker_cpu_percent_idle": cpu_idle[0] + cpu_idle[1],
        "worker_cpu_percent_while_waiting": round(cpu[0] + cpu[1], 1),
        "celery_cpu_percent_while_waiting": cpu[0], "app_servers_cpu_percent_while_waiting": cpu[1],
        "other_turns_posted": args.others * args.other_turns,
        "other_turns_ended_while_waiting": len(during),
        "other_turns_succeeded_while_waiting": sum(1 for s, _, _ in during.values() if s == "succeeded"),
        "other_turn_ms_median_while_waiting": _median([s * 1000 for _, s, _ in during.values()]),
        "other_turn_ms_max_while_waiting": round(max((s * 1000 for _, s, _ in during.values()), default=0.0), 1),
        "approvals_still_pending_after_others": still_pending,
        "accept_phase_seconds": accept_s,
        "decision_to_turn_end_ms_median": _median(outcome["decided_to_end_ms"]),
        "approval_turns_ok": outcome["ok"], "approval_turns_failed": len(outcome["failed"]),
        "approval_turns_lost": len(outcome["lost"]),
        "other_turns_succeeded": sum(1 for s, _, _ in others.ended.values() if s == "succeeded"),
        "other_turn_ms_median": _median([s * 1000 for _, s, _ in others.ended.values()]),
        "other_turns_nothing_waiting_succeeded": sum(1 for s, _, _ in alone.ended.values() if s == "succeeded"),
        "other_turn_ms_median_nothing_waiting": _median([s * 1000 for _, s, _ in alone.ended.values()]),
        "other_turn_ms_max_nothing_waiting": round(max((s * 1000 for _, s, _ in alone.ended.values()), default=0.0), 1),
        "other_turns_failed": len(other_failed), "other_turns_lost": len(other_lost),
    }
    _print(figures)
    for line in outcome["failed"] + [f"lost: {t}" for t in outcome["lost"] + other_lost] + \
            [f"other failed: {t}" for t in other_failed]:
        print(f"  {line}", file=sys.stderr)
    bad = outcome["failed"] or outcome["lost"] or other_failed or other_lost
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    db_url, broker = os.environ.get("DATABASE_URL", ""), os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench-approvals needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-approvals-"))
    env = _environment(database_beside(db_url, "_bench_approvals"), broker, scratch)
    procs: list[subprocess.Popen[bytes]] = []
    stack: Stack | None = None
    client: StackClient | None = None
    try:
        _start_stand_in(env, scratch, procs)
        stack = Stack("approvals", stack_environment(env, "approvals", {}), http_workers=2, asgi=True,
                      concurrency=args.concurrency)
        token = _setup_django(env)
        stack.start_api()
        for _ in range(args.workers):
            stack.add_worker()
        wait_for_workers(stack, args.workers)
        client = StackClient(stack.api, token, session_id=f"bench-appr-{os.getpid()}")
        client.wait_up(make_session=False)
        return run(args, stack, client, env)
    finally:
        if client is not None:
            client.close()
        if stack is not None:
            stack.stop()
        stop_processes(procs)
        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(env["DATABASE_URL"])


if __name__ == "__main__":
    sys.exit(main())
