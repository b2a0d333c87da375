"""The capacity model's inputs from ``make bench``'s throughput run: what one turn costs PostgreSQL, the broker
and the host's CPU, and what it leaves stored, per turn.

The bench reads ``Counters`` right before and right after each measured stack round (``read``; after a
round it first waits ``FLUSH_SECONDS``, so every backend has flushed its statistics), and the same around
the warm direct rounds beside them, which touch neither PostgreSQL nor Redis (the **background**: what the
host does meanwhile that is not the stack's turns). ``figures`` turns the summed differences into per-turn
figures:

* **PostgreSQL** (``pg_stat_database`` / ``pg_stat_user_tables`` of the bench database, PostgreSQL 15 flushes
  a backend's counts at most 1 s after it goes idle): ``pg_commits`` = ``xact_commit`` delta less the
  bench's own polling transactions (``own_transactions``; read-only transactions count as commits too);
  rows inserted / updated / deleted (``n_tup_ins`` / ``n_tup_upd`` / ``n_tup_del`` summed over the tables);
  ``table_bytes`` = growth of ``pg_total_relation_size`` summed over the tables (heap, TOAST, indexes; in
  8 kB pages, so coarse over few turns), ``database_bytes`` = ``pg_database_size`` growth; ``pg_cpu_ms`` =
  utime + stime (``/proc/<pid>/stat``) of the bench database's backends alive at each end
  (``pg_stat_activity``, without the bench's own); a backend that exits inside the window is missed.
* **WAL bytes**: ``pg_wal_lsn_diff`` of ``pg_current_wal_lsn()`` — the whole cluster's, so other databases'
  writes count; ``wal_bytes`` is net of the background rate (bytes/s over the direct rounds × the stack
  rounds' seconds), ``wal_bytes_raw`` is not.
* **Broker commands**: Redis ``INFO stats`` ``total_commands_processed`` — every command the Redis server
  ran for any client on any db (Celery's ``LPUSH`` / ``BRPOP`` of the turn messages, kombu's unacked-hash
  bookkeeping, workers' heartbeats and ``celery`` queue polls): commands, not messages; net of the
  background like WAL (``redis_commands_raw`` beside it). A turn whose session's thread a worker keeps
  loaded is woken by ``pg_notify`` (``services/dispatch.py``) and sends nothing through Redis; one sent
  to the shared queue does.
* **CPU** (clock ticks of ``/proc/<pid>/stat``, as ms): ``api_cpu_ms`` = utime + stime + cutime + cstime of
  the gunicorn master and its workers; ``worker_cpu_ms`` = utime + stime of the Celery processes (main and
  pool children, the Python processes of a worker's tree); ``codex_cpu_ms`` = every non-Python process
  under a worker (app-servers and their sandbox helpers: utime + stime + cutime + cstime) plus the
  Python processes' cutime + cstime (the app-servers they reaped: the kernel adds a reaped child's own and
  reaped-children's time to its parent's cutime/cstime when the parent waits for it). The difference of
  that sum between two readings is what codex used in between, whether an app-server lived through the
  window, was spawned in it or was closed and reaped in it; what an app-server's orphaned helper used
  after it was re-parented to init is missed. ``worker_pids_changed`` says a pool child was replaced in
  the window (its time then lands in the main process's cutime, counted as codex).

Per session (``rollout_figures``): the stored (zlib) bytes of the session's ``RolloutChunk`` rows and its
rollout's uncompressed ``length``, each over the session's turns; medians over sessions.

``python -m devtools.bench`` prints them as ``capacity_<name>: value`` lines (``print_figures``)."""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FLUSH_SECONDS = 1.2  # PostgreSQL 15 flushes an idle backend's statistics within PGSTAT_MIN_INTERVAL (1 s)
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: The counters a ``Counters`` reading holds, each summed as it is (differences of cumulative counts).
COUNTERS = ("pg_commits", "rows_inserted", "rows_updated", "rows_deleted", "wal_bytes", "table_bytes",
            "database_bytes", "redis_commands", "pg_ticks", "api_ticks", "worker_ticks", "codex_ticks")
#: Counters of a whole server (every database, every Redis client): reported net of the background.
SERVER_WIDE = ("wal_bytes", "redis_commands")


# --------------------------------------------------------------------------------------- process CPU (pure)


@dataclass(frozen=True)
class ProcessCpu:
    """One process as ``/proc/<pid>/stat`` shows it: ``own`` = utime + stime, ``reaped`` = cutime + cstime
    (clock ticks), ``python`` = its executable is a Python interpreter (a Celery or gunicorn process)."""

    pid: int
    python: bool
    own: int
    reaped: int


def split_worker_cpu(processes: Iterable[ProcessCpu]) -> tuple[int, int]:
    """``(worker ticks, codex ticks)`` of the processes of worker trees (module docstring): a Python
    process's ``own`` is the worker's, its ``reaped`` codex's; a non-Python process's ``own + reaped`` is
    codex's."""
    worker = codex = 0
    for p in processes:
        if p.python:
            worker += p.own
            codex += p.reaped
        else:
            codex += p.own + p.reaped
    return worker, codex


def backend_ticks(start: Mapping[int, int], end: Mapping[int, int]) -> int:
    """CPU ticks of PostgreSQL backends between two readings ``{pid: utime + stime}``: a backend alive at
    the end counts from the start reading, or from its birth if it was not there; one gone by the end is
    missed (its time is nowhere left to read)."""
    return sum(ticks - start.get(pid, 0) for pid, ticks in end.items())


# --------------------------------------------------------------------------------------- readings


@dataclass
class Counters:
    """One reading: ``at`` (monotonic seconds), the cumulative ``values`` named in ``COUNTERS``, the rows
    inserted / updated per table (``tables``: ``{table: (ins, upd)}``), the bench database's backends'
    ticks (``backends``) and the Python pids of the worker trees (``worker_pids``)."""

    at: float
    values: dict[str, int]
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    backends: dict[int, int] = field(default_factory=dict)
    worker_pids: frozenset[int] = frozenset()


@dataclass
class Window:
    """Summed differences of readings taken in pairs (``add``): ``values`` per ``COUNTERS`` name (with
    ``pg_ticks`` from ``backend_ticks``), ``seconds``, rows per table, and whether a worker's Python
    pids changed in any pair."""

    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    seconds: float = 0.0
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    worker_pids_changed: bool = False

    def add(self, start: Counters, end: Counters) -> None:
        for name in COUNTERS:
            self.values[name] += end.values.get(name, 0) - start.values.get(name, 0)
        self.values["pg_ticks"] += backend_ticks(start.backends, end.backends)
        self.seconds += end.at - start.at
        for table, (ins, upd) in end.tables.items():
            ins0, upd0 = start.tables.get(table, (0, 0))
            old = self.tables.get(table, (0, 0))
            self.tables[table] = (old[0] + ins - ins0, old[1] + upd - upd0)
        self.worker_pids_changed |= start.worker_pids != end.worker_pids


def figures(stack: Window, background: Window, turns: int, own_transactions: int) -> dict[str, float]:
    """Per-turn figures of ``turns`` turns measured in ``stack`` (module docstring). ``background``: the
    same counters over the direct rounds, whose rate per second of the server-wide counters is taken off;
    ``own_transactions``: the bench's own transactions on the database inside ``stack`` (its polls and
    readings), taken off ``pg_commits``. CPU in ms; bytes, rows, commands as they are; one decimal.
    Raises ``ValueError`` without turns."""
    if turns <= 0:
        raise ValueError("no turns measured")
    v = stack.values
    out: dict[str, float] = {
        "pg_commits": (v["pg_commits"] - own_transactions) / turns,
        "rows_inserted": v["rows_inserted"] / turns,
        "rows_updated": v["rows_updated"] / turns,
        "rows_deleted": v["rows_deleted"] / turns,
        "table_bytes": v["table_bytes"] / turns,
        "database_bytes": v["database_bytes"] / turns,
    }
    for name in SERVER_WIDE:
        rate = background.values[name] / background.seconds if background.seconds > 0 else 0.0
        out[f"{name}_raw"] = v[name] / turns
        out[f"{name}_background_per_s"] = rate
        out[name] = (v[name] - rate * stack.seconds) / turns
    for name in ("pg_cpu", "api_cpu", "worker_cpu", "codex_cpu"):
        out[f"{name}_ms"] = v[f"{name.removesuffix('_cpu')}_ticks"] * 1000 / CLK_TCK / turns
    return {k: round(x, 1) for k, x in out.items()}


def top_tables(window: Window, turns: int, column: int, n: int = 4) -> list[tuple[str, float]]:
    """The ``n`` tables with most rows inserted (``column`` 0) or updated (1) per turn, most first."""
    rows = [(table, counts[column] / turns) for table, counts in window.tables.items() if counts[column] > 0]
    return [(t, round(x, 2)) for t, x in sorted(rows, key=lambda r: -r[1])[:n]]


def rollout_figures(sessions: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    """Per session ``(turns, stored bytes of its chunks, uncompressed rollout length)``: the medians over
    sessions of stored and uncompressed bytes per turn, and the totals over all turns. Sessions with no
    turn are left out; raises ``ValueError`` if none is left."""
    rows = [s for s in sessions if s[0] > 0]
    if not rows:
        raise ValueError("no session with turns")
    turns = sum(r[0] for r in rows)
    return {
        "rollout_stored_bytes_per_turn": round(statistics.median(r[1] / r[0] for r in rows), 1),
        "rollout_raw_bytes_per_turn": round(statistics.median(r[2] / r[0] for r in rows), 1),
        "rollout_stored_bytes_total_per_turn": round(sum(r[1] for r in rows) / turns, 1),
        "rollout_raw_bytes_total_per_turn": round(sum(r[2] for r in rows) / turns, 1),
        "rollout_sessions": len(rows),
    }


# --------------------------------------------------------------------------------------- reading the host


def _stat(pid: int) -> tuple[int, int] | None:
    """``(utime + stime, cutime + cstime)`` of ``pid`` in clock ticks; ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is the state (field 3 of proc(5)); utime, stime, cutime, cstime are fields 14–17
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False


def process_tree_cpu(root: int) -> list[ProcessCpu]:
    """``root`` and its live descendants as ``ProcessCpu`` (those gone while read are left out)."""
    from hermes_sessions.worker.warm.process_memory import descendants

    out = []
    for pid in [root, *descendants(root)]:
        stat = _stat(pid)
        if stat is not None:
            out.append(ProcessCpu(pid=pid, python=_is_python(pid), own=stat[0], reaped=stat[1]))
    return out


_PG_READING = """
SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
       (SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables),
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
       (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_stat_user_tables),
       pg_database_size(current_database()),
       (SELECT array_agg(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid())
"""


class Probe:
    """Reads ``Counters`` of one stack: its gunicorn master's and its Celery main processes' pids (given
    at each reading: workers change between worker counts), the bench database (Django's default
    connection) and the broker (``redis_url``)."""

    #: Transactions a reading runs on the bench database (autocommit: one per statement); counted by
    #: PostgreSQL after it, so a window holds its start reading's.
    TRANSACTIONS_PER_READING = 3

    def __init__(self, redis_url: str):
        import redis

        self.redis = redis.Redis.from_url(redis_url)

    def read(self, api_pid: int | None, worker_pids: Sequence[int]) -> Counters:
        from django.db import connection

        values: dict[str, int] = {}
        with connection.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
            cur.execute(_PG_READING)
            commits, deleted, wal, tables, database, backends = cur.fetchone()
            cur.execute("SELECT relname, n_tup_ins, n_tup_upd FROM pg_stat_user_tables")
            per_table = {name: (int(ins), int(upd)) for name, ins, upd in cur.fetchall()}
        values.update(pg_commits=int(commits), rows_deleted=int(deleted), wal_bytes=int(wal), table_bytes=int(tables),
                      database_bytes=int(database), rows_inserted=sum(i for i, _ in per_table.values()),
                      rows_updated=sum(u for _, u in per_table.values()),
                      redis_commands=int(self.redis.info("stats")["total_commands_processed"]))
        ticks = {pid: stat[0] for pid in backends or [] if (stat := _stat(pid)) is not None}
        api = process_tree_cpu(api_pid) if api_pid else []
        values["api_ticks"] = sum(p.own + p.reaped for p in api)
        workers = [p for pid in worker_pids for p in process_tree_cpu(pid)]
        values["worker_ticks"], values["codex_ticks"] = split_worker_cpu(workers)
        return Counters(at=time.monotonic(), values=values, tables=per_table, backends=ticks,
                        worker_pids=frozenset(p.pid for p in workers if p.python))

    def close(self) -> None:
        self.redis.close()


def session_rollouts(session_ids: Sequence[str]) -> list[tuple[int, int, int]]:
    """Per session ``(succeeded turns, stored bytes of all its rollouts' chunks, their uncompressed
    length)``, read from the bench database."""
    from django.db.models import Count, Q, Sum
    from django.db.models.functions import Length

    from hermes_sessions.models import CodexRollout, RolloutChunk, Session

    turns = dict(Session.objects.filter(pk__in=session_ids).annotate(
        n=Count("turns", filter=Q(turns__status="succeeded"))).values_list("pk", "n"))
    stored = dict(RolloutChunk.objects.filter(rollout__session_id__in=session_ids).values("rollout__session_id")
                  .annotate(b=Sum(Length("data"))).values_list("rollout__session_id", "b"))
    length = dict(CodexRollout.objects.filter(session_id__in=session_ids).values("session_id")
                  .annotate(b=Sum("length")).values_list("session_id", "b"))
    return [(turns.get(s, 0), int(stored.get(s) or 0), int(length.get(s) or 0)) for s in session_ids]


# --------------------------------------------------------------------------------------- printing


def _unsteady(net: float) -> str:
    """A warning for a net figure below zero: the server's other clients' load changed between the windows."""
    return "; below 0: other clients' load varied more than the turns' own, read it on a quiet host" if net < 0 else ""


def print_figures(f: Mapping[str, float], stack: Window, background: Window, turns: int,
                  rollouts: Mapping[str, float], about: str) -> None:
    """The ``capacity_<name>: value`` lines (``bench_figures.parse_figures``), ``about`` saying what ran."""
    def line(name: str, value: Any, note: str = "") -> None:
        print(f"capacity_{name}: {value}" + (f"   ({note})" if note else ""))

    ins = ", ".join(f"{t} {x}" for t, x in top_tables(stack, turns, 0))
    upd = ", ".join(f"{t} {x}" for t, x in top_tables(stack, turns, 1))
    print(f"capacity inputs: {turns} turns, {about}; {stack.seconds:.1f} s measured, background "
          f"{background.seconds:.1f} s (the direct rounds); per turn (devtools/bench_capacity.py)")
    line("turns", turns)
    line("pg_commits_per_turn", f["pg_commits"], "xact_commit of the bench database, read-only transactions "
         "included, the bench's own polls taken off")
    line("pg_rows_inserted_per_turn", f["rows_inserted"], ins)
    line("pg_rows_updated_per_turn", f["rows_updated"], upd)
    line("pg_rows_deleted_per_turn", f["rows_deleted"])
    line("wal_bytes_per_turn", f["wal_bytes"], f"cluster-wide, net of {f['wal_bytes_background_per_s']:.0f} B/s "
         f"background; raw {f['wal_bytes_raw']:.0f}{_unsteady(f['wal_bytes'])}")
    line("wal_bytes_per_turn_raw", f["wal_bytes_raw"])
    line("table_bytes_per_turn", f["table_bytes"], "pg_total_relation_size growth, heap + TOAST + indexes, 8 kB "
         f"pages; pg_database_size {f['database_bytes']:.0f}")
    line("database_bytes_per_turn", f["database_bytes"])
    line("redis_commands_per_turn", f["redis_commands"], "total_commands_processed of the Redis server, every "
         f"client and db, net of {f['redis_commands_background_per_s']:.0f}/s background; raw "
         f"{f['redis_commands_raw']:.1f}{_unsteady(f['redis_commands'])}")
    line("redis_commands_per_turn_raw", f["redis_commands_raw"])
    line("codex_cpu_ms_per_turn", f["codex_cpu_ms"], "app-servers and their helpers under the workers, reaped ones "
         "through cutime/cstime")
    line("worker_cpu_ms_per_turn", f["worker_cpu_ms"], "Celery main + pool processes, without codex")
    line("api_cpu_ms_per_turn", f["api_cpu_ms"], "gunicorn master + workers")
    line("pg_cpu_ms_per_turn", f["pg_cpu_ms"], "the bench database's backends alive at both ends; a lower bound")
    line("rollout_stored_bytes_per_turn", rollouts["rollout_stored_bytes_per_turn"],
         f"median over {rollouts['rollout_sessions']:.0f} sessions of RolloutChunk bytes / turns, first turn "
         f"included; all sessions {rollouts['rollout_stored_bytes_total_per_turn']:.0f}")
    line("rollout_raw_bytes_per_turn", rollouts["rollout_raw_bytes_per_turn"],
         f"the same of the uncompressed rollout length; all sessions {rollouts['rollout_raw_bytes_total_per_turn']:.0f}")
    if stack.worker_pids_changed:
        print("  capacity: a worker's pool process was replaced inside the window: its time counts as codex's",
              file=sys.stderr)
