"""``make bench`` — wall time of one turn through the whole stack against codex driven directly, the warm
path against today's cold one, where a turn's time goes, throughput and the worker's memory.

Everything runs in one go on this machine with the same model stand-in and the same pinned codex, on two
stacks side by side (``bench_stacks.py``: each its own gunicorn, turn queue and one ``-c 1`` worker):

* **baseline stack** (``HERMES_WARM_IDLE_SECONDS=0 HERMES_WARM_POOL=0 CODEX_PROJECT_DOCS=1``: the cold path
  as it was before issue 9):
  ``POST /api/sessions/{id}/turns/`` on gunicorn (ASGI, uvicorn workers, as ``make run``) → Redis → the
  worker → a fresh ``codex app-server`` that resumes the session's thread → PostgreSQL, until the turn's
  ``completed`` event arrives on the session's open event stream (``GET /api/sessions/{id}/events/``,
  as a chat client waits; ``StackClient.timed_turn(watch=True)``);
* **warm stack** (``HERMES_WARM_IDLE_SECONDS=120 HERMES_WARM_POOL=1``, ``--warm-pool``): the same, with a
  spare app-server kept ready and the thread kept loaded (session affinity)
  between a session's turns;
* **same work**: a minimal script spawns the app-server, ``initialize``, ``thread/resume``,
  ``turn/start`` → ``turn/completed``, closes it (what the worker must do for a restarted session);
* **same work, fresh home**: the same script on a ``CODEX_HOME`` made afresh for the turn with only the
  thread's rollout in it (as every baseline turn's home is; making it is not timed);
* **warm direct**: ``turn/start`` → ``turn/completed`` on an app-server already running with the thread
  loaded.

Each round (``--runs``) times, interleaved so drift hits them alike: first, on a host left alone for
``SETTLE_SECONDS``, ``WARM_PAIRS`` consecutive turns of one session on the warm stack, each followed at once
by the warm direct turns (pairs: the two sides of ``ratio_vs_warm`` run under the same conditions); then a
turn of another session on the baseline stack (consecutive turns), a **cold** turn on each stack (a new
session given one untimed turn on the baseline stack just before: a stored thread not loaded in the
worker), same work, fresh home. Printed (seconds shown as ms medians):

* ``ratio_vs_same_work`` = baseline stack / same work; ``ratio_fresh_home_vs_same_work``;
* ``ratio_vs_warm`` = warm stack consecutive / warm direct (target ≤ 1.25);
* ``ratio_cold_vs_today`` = cold turn on the warm stack / cold turn on the baseline stack (≤ 0.65);
* **where the time goes**: HTTP, queue, claim + restore, codex, finalize per turn (``bench_figures.
  turn_phases``) for the warm stack's consecutive and cold turns and the baseline's;
* **rollout overhead**: the baseline turns' ``restore_ms`` / ``capture_ms`` / ``store_ms`` and
  ``ratio_rollout_overhead`` = turn / (turn − restore − capture − store); **bytes stored per turn**;
* **long history** (``bench_history.py``, on the baseline stack, ``--history-runs`` rounds after the
  latency rounds): ``ratio_history_first_turn``, ``ratio_history_rotation`` — each the median of per-pair
  ratios (a 100,000-message session's turn over a 10-message one's, timed back to back), printed with
  the median's 95 % confidence interval (also as ``…_ci_low`` / ``…_ci_high``), the quartiles and min–max;
* **memory** (``bench_memory.py``): ``--memory-turns`` consecutive turns over a few sessions on the warm
  stack's worker, its RSS (kB) after ``--memory-warmup`` turns and at the end, ``worker_memory_growth``
  (target ≤ 1.05) and the median private memory (USS), PSS and RSS per app-server under it; then
  ``bench_app_server_memory.py``: an idle app-server with one loaded thread and each extra loaded thread,
  in private memory;
* **rollout size** (``bench_rollout.py``, ``--rollout-rounds``): ``cold_turn_100mb_vs_1mb_seen`` /
  ``…_unseen``, a cold turn at 100 MB of rollout over one at 1 MB;
* **throughput** (``bench_throughput.py``): turns/s with 1, 2, 4 workers (``--workers``), 50 sessions at
  once (``--throughput-sessions``), ``--throughput-rounds`` rounds; failed turns (must be 0). Beside the
  ``--direct-workers`` (2) run's later rounds, as many warm direct app-servers (``bench_direct.py``) driven
  50 at once: ``throughput_ratio_vs_direct`` (target ≥ 0.5, goal 0.8) and ``throughput_kept_share`` (≥ 0.8);
  ``--worker-turns N`` sets the throughput workers' ``HERMES_WORKER_TURNS``;
* **capacity inputs** (``bench_capacity.py``, over the same later rounds): per turn, PostgreSQL commits,
  rows, WAL and table bytes, Redis commands, codex / worker / API / PostgreSQL CPU, stored rollout bytes.

``--quick`` is a tiny run for tests. Key figures are ``name: value`` lines (``bench_figures.
parse_figures`` reads them). Needs ``DATABASE_URL`` (PostgreSQL; a ``*_bench`` database is created
beside it and dropped after the run) and ``CELERY_BROKER_URL``. Run as ``python -m devtools.bench
[--runs N] [--history-runs N] [--memory-turns N] [--workers 1,2,4] [--quick]``; ``--runs 0 --memory-turns 0
--workers=`` runs the long-history part alone.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.bench_app_server_memory import measure as measure_app_server_memory
from devtools.bench_app_server_memory import print_figures as print_app_server_memory
from devtools.bench_capacity import Probe, session_rollouts
from devtools.bench_capacity import figures as capacity_figures
from devtools.bench_capacity import print_figures as print_capacity
from devtools.bench_capacity import rollout_figures as capacity_rollout_figures
from devtools.bench_figures import (
    PHASES,
    chunk_figures,
    median_ms,
    memory_growth,
    phase_median,
    phase_medians,
    ratio,
    ratio_spread,
    rollout_overhead,
)
from devtools.bench_history import BIG, SMALL, HistoryBench
from devtools.bench_memory import worker_memory
from devtools.bench_stacks import BASELINE_ENV, WARM_ENV, Stack, StackClient, stack_environment, stop_processes
from devtools.bench_throughput import WorkerCountResult, run_throughput
from devtools.databases import create_database, database_beside, drop_database
from devtools.processes import stand_in_argv, wait_for_port_file

BASE = Path(__file__).resolve().parent.parent
# Rounds of long-history turns (``--history-runs``): each gives one pair per kind of turn; the median of
# the per-pair ratios of 25 pairs has a 95 % interval of ranks 8–18 (README "Benchmark").
HISTORY_RUNS = 25
#: Per round: warm stack turns of the conversation, each followed by the two warm direct turns (in pairs).
WARM_PAIRS = 3
#: Seconds the host is left alone before a round's warm pairs (the previous round's cold turns end first).
SETTLE_SECONDS = 0.5


class Direct:
    """A minimal newline-delimited JSON-RPC driver for ``codex app-server`` (no threads)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=cwd)
        self.next_id = 0

    def send(self, msg: dict[str, Any]) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any]) -> Any:
        self.next_id += 1
        rid = self.next_id
        self.send({"id": rid, "method": method, "params": params})
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("id") == rid and "method" not in msg:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def wait_turn_completed(self) -> str:
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("method") == "turn/completed":
                return msg["params"]["turn"]["status"]

    def initialize(self) -> None:
        self.request("initialize", {"clientInfo": {"name": "bench", "title": None, "version": "0"}})
        self.send({"method": "initialized", "params": {}})

    def turn(self, thread_id: str, text: str) -> None:
        self.request("turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]})
        status = self.wait_turn_completed()
        assert status == "completed", status

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _environment(bench_db_url: str, broker: str, scratch: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": bench_db_url,
        "CELERY_BROKER_URL": broker,
        "CELERY_TASK_ALWAYS_EAGER": "0",
        "CODEX_HOME": str(scratch / "codex_home"),
        "CODEX_HOMES_ROOT": str(scratch / "homes"),
        "CODEX_USER_HOME": str(scratch / "user_home"),
        "CODEX_WORK_ROOT": str(scratch / "work"),
        "CODEX_MODEL_PROVIDER": "stand-in",
        "HERMES_LOG_LEVEL": "WARNING",
        "HERMES_TURN_QUEUE": f"bench-turns-{os.getpid()}",
    }
    env.pop("CODEX_APP_SERVER_COMMAND", None)
    return env


def _start_stand_in(env: dict[str, str], scratch: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """The model stand-in, in its own process; its URL goes into ``env``."""
    port_file = scratch / "stand_in.port"
    stand_in = subprocess.Popen(stand_in_argv(port_file), cwd=BASE, stdout=subprocess.DEVNULL)
    procs.append(stand_in)
    port = wait_for_port_file(port_file, timeout=30,
                              failed=lambda: None if stand_in.poll() is None else "the model stand-in exited")
    env["CODEX_STAND_IN_URL"] = f"http://127.0.0.1:{port}/v1"


def _setup_django(env: dict[str, str]) -> str:
    """This process on the bench database (created, migrated); returns the ``bench`` user's token."""
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_TASK_ALWAYS_EAGER", "CODEX_HOME",
                                            "CODEX_HOMES_ROOT", "CODEX_USER_HOME", "CODEX_WORK_ROOT", "CODEX_STAND_IN_URL", "HERMES_TURN_QUEUE")})
    create_database(env["DATABASE_URL"])
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from hermes_sessions.codex.launch import ensure_codex_home

    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench")
    token, _ = Token.objects.get_or_create(user=user)
    ensure_codex_home()
    return token.key


def _direct_thread(argv: list[str], codex_env: dict[str, str], work: str) -> tuple[Direct, str]:
    """A fresh app-server with a new thread that has had one turn (so it has a rollout)."""
    d = Direct(argv, codex_env, work)
    d.initialize()
    thread = d.request("thread/start", {"cwd": work})["thread"]["id"]
    d.turn(thread, "warm-up")
    return d, thread


class FreshHome:
    """The direct script's work on a ``CODEX_HOME`` made afresh for every turn, holding only the
    thread's rollout and ``config.toml`` (what a stack turn's app-server starts on): codex's own cost
    of a cold home (it creates its sqlite state databases on start) without our restore around it."""

    def __init__(self, argv: list[str], codex_env: dict[str, str], work: str, root: Path):
        from hermes_sessions.codex.rollout_files import find_rollout

        self.argv, self.work, self.root = argv, work, root
        shared = Path(codex_env["CODEX_HOME"])
        d, self.thread = _direct_thread(argv, codex_env, work)  # a thread of its own, started in the shared home
        d.close()
        path = find_rollout(shared, self.thread)
        assert path is not None, "the fresh-home thread has no rollout"
        self.relpath, self.data = path.relative_to(shared), path.read_bytes()
        self.config = (shared / "config.toml").read_bytes()
        self.env = {**codex_env, "CODEX_HOME": str(root / "home"), "HOME": str(root / "user_home")}

    def turn(self, text: str) -> float:
        """Wipe and make the home (not timed), then spawn … close as the direct script does; seconds."""
        shutil.rmtree(self.root, ignore_errors=True)
        home = self.root / "home"
        (self.root / "user_home").mkdir(parents=True)
        (home / self.relpath).parent.mkdir(parents=True)
        (home / "config.toml").write_bytes(self.config)
        (home / self.relpath).write_bytes(self.data)
        t0 = time.monotonic()
        d = Direct(self.argv, self.env, self.work)
        d.initialize()
        d.request("thread/resume", {"threadId": self.thread, "excludeTurns": True})
        d.turn(self.thread, text)
        d.close()
        elapsed = time.monotonic() - t0
        self.data = (home / self.relpath).read_bytes()  # the next turn continues this one
        return elapsed


@dataclass
class Sessions:
    """The measured sessions: ``baseline`` and ``warm`` (consecutive turns on each stack), and per round
    a pair of cold ones — ``cold_warm[i]`` / ``cold_baseline[i]``, each given one (untimed) turn on the
    baseline stack in its round before its timed turn on the warm / baseline stack."""

    baseline: StackClient
    warm: StackClient

    def cold(self, kind: str, i: int) -> str:
        return f"{self.baseline.session_id}-cold-{kind}-{i}"


def _measure(s: Sessions, runs: int, work: str) -> dict[str, Any]:
    """``runs`` interleaved rounds: after ``SETTLE_SECONDS``, ``WARM_PAIRS`` warm stack turns (consecutive turns
    of one session) each followed by the warm direct turn under the session's profile and the unsandboxed one;
    then the baseline stack's consecutive turn, a cold turn on each stack, same work, fresh home. Seconds of
    each; the stack turns' records (``StackClient.timed_turn``)."""
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

    s.baseline.turn("warm-up")  # starts the sessions' threads
    s.warm.turn("warm-up")
    argv, codex_env = app_server_argv(), app_server_env()
    Path(work).mkdir(parents=True, exist_ok=True)
    d, direct_thread = _direct_thread(argv, codex_env, work)  # the direct script's own thread
    d.close()
    warm, warm_thread = _direct_thread(argv, codex_env, work)  # the warm app-server: kept loaded
    # The same, under the permission profile every session's codex runs with (read-only, the default
    # sandbox; launch.app_server_argv + the home's config.toml, as a worker starts it): the same codex work
    # as a stack turn, whose profile adds its own per-turn cost (README "Benchmark").
    profiled_home = prepare_session_home("bench-direct-profile", sandbox="read-only", workdir=Path(work))
    profiled, profiled_thread = _direct_thread(app_server_argv(sandbox="read-only", workdir=Path(work)),
                                               app_server_env(profiled_home), work)
    fresh = FreshHome(argv, codex_env, work, Path(work).parent / "fresh_home")
    out: dict[str, Any] = {"argv": argv, "same": [], "fresh": [], "warm": [], "warm_profile": [],
                           "baseline": [], "warm_stack": [], "cold_warm": [], "cold_baseline": []}
    for i in range(runs):
        print(f"  round {i + 1}/{runs}", file=sys.stderr, flush=True)
        # The consecutive-turn comparison first, on a settled host, in adjacent pairs: each warm stack turn
        # with the warm direct turns right after it. It used to follow the round's baseline stack turn at
        # once, whose tail (its app-server's exit, its home's removal) ran into the warm stack turn only,
        # while the warm direct turns ran after light ones: the ratio moved by ±0.06 between runs of the same
        # code (README "Benchmark").
        time.sleep(SETTLE_SECONDS)
        for j in range(WARM_PAIRS):
            out["warm_stack"].append(s.warm.timed_turn(f"bench {i}.{j}", watch=True))
            t0 = time.monotonic()
            profiled.turn(profiled_thread, f"bench {i}.{j}")
            out["warm_profile"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            warm.turn(warm_thread, f"bench {i}.{j}")
            out["warm"].append(time.monotonic() - t0)
        out["baseline"].append(s.baseline.timed_turn(f"bench {i}", watch=True))
        cold = {kind: s.cold(kind, i) for kind in ("warm", "baseline")}
        for sid in cold.values():  # a stored thread whose last turn ran on the baseline stack
            s.baseline.make_session(sid)
            s.baseline.turn("before", session_id=sid)
        order = (("warm", s.warm), ("baseline", s.baseline))
        for kind, client in order if i % 2 == 0 else order[::-1]:
            out[f"cold_{kind}"].append(client.timed_turn(f"bench {i}", session_id=cold[kind], watch=True))
            client.unwatch(cold[kind])
        t0 = time.monotonic()
        d = Direct(argv, codex_env, work)
        d.initialize()
        d.request("thread/resume", {"threadId": direct_thread, "excludeTurns": True})
        d.turn(direct_thread, f"bench {i}")
        d.close()
        out["same"].append(time.monotonic() - t0)
        out["fresh"].append(fresh.turn(f"bench {i}"))
    warm.close()
    profiled.close()
    out["stack"] = [r["seconds"] for r in out["baseline"]]
    out["phases"] = [r["turn"]["timings"] for r in out["baseline"]]
    return out


def _seconds(records: list[dict[str, Any]]) -> list[float]:
    return [r["seconds"] for r in records]


def _count(records: list[dict[str, Any]], key: str) -> int:
    """How many of the turns have ``timings[key] == 1`` (``warm``: a kept-loaded thread; ``spare``; ``woken``: by
    its holder's wake; ``early_start``: ``turn/start`` sent beside the claim)."""
    return sum(1 for r in records if (r["turn"].get("timings") or {}).get(key) == 1)


def _print_results(runs: int, m: dict[str, Any]) -> None:
    s, a, w = median_ms(m["stack"]), median_ms(m["same"]), median_ms(m["warm"])
    print(f"runs: {runs} (interleaved; codex {_codex_version(m['argv'])}; model stand-in; PostgreSQL + Redis)")
    print(f"median_stack_ms: {s}        (baseline stack: POST turn → GET shows succeeded; gunicorn, Celery worker, "
          "fresh app-server, resume; HERMES_WARM_IDLE_SECONDS=0 HERMES_WARM_POOL=0 CODEX_PROJECT_DOCS=1)")
    print(f"median_same_work_ms: {a}    (direct script: spawn, initialize, thread/resume, turn, close)")
    print(f"median_warm_ms: {w}         (turn on an already-running app-server with the thread loaded)")
    f = median_ms(m["fresh"])
    print(f"median_same_work_fresh_home_ms: {f}   (the direct script on a CODEX_HOME made afresh with only the rollout, "
          "as each stack turn's; making it not timed)")
    for key in ("restore_ms", "initialize_ms", "thread_ms", "turn_ms", "capture_ms", "codex_ms", "store_ms", "run_ms"):
        value = phase_median(m["phases"], key)
        if value is not None:
            print(f"  worker {key}: median {value}")
    print(f"ratio_vs_same_work: {s / a:.2f}   (baseline stack / same work)")
    print(f"ratio_baseline_vs_warm: {s / w:.2f}   (baseline stack / warm direct; was ratio_vs_warm before the warm stack)")
    print(f"ratio_fresh_home_vs_same_work: {f / a:.2f}   (codex's own cost of starting on a cold home)")


def _print_warm_figures(m: dict[str, Any], warm_settings: dict[str, str]) -> None:
    """The warm stack against the warm direct turn and against the baseline stack (README "Benchmark")."""
    settings = " ".join(f"{k}={v}" for k, v in warm_settings.items())
    ws, cw, cb = m["warm_stack"], m["cold_warm"], m["cold_baseline"]
    print(f"median_warm_stack_ms: {median_ms(_seconds(ws))}   (warm stack, {settings}: one session's consecutive turns; "
          f"{_count(ws, 'warm')}/{len(ws)} on a kept-loaded thread, {_count(ws, 'spare')}/{len(ws)} on a spare, "
          f"{_count(ws, 'woken')}/{len(ws)} woken, {_count(ws, 'early_start')}/{len(ws)} started early)")
    print(f"median_warm_profile_ms: {median_ms(m['warm_profile'])}   (warm direct turn under the session's permission "
          "profile, read-only: the same codex work as a stack turn)")
    print(f"ratio_vs_warm: {ratio(_seconds(ws), m['warm_profile']):.2f}   (warm stack consecutive / warm direct under "
          "the same profile; target ≤ 1.25)")
    print(f"ratio_vs_warm_unsandboxed: {ratio(_seconds(ws), m['warm']):.2f}   (the same against the warm direct turn "
          "with no permission profile, median_warm_ms)")
    print(f"median_cold_warm_stack_ms: {median_ms(_seconds(cw))}   (warm stack, sessions whose one previous turn ran on "
          f"the baseline stack; {_count(cw, 'spare')}/{len(cw)} on a spare, {_count(cw, 'warm')}/{len(cw)} warm)")
    print(f"median_cold_baseline_stack_ms: {median_ms(_seconds(cb))}   (baseline stack, sessions made the same way)")
    print(f"ratio_cold_vs_today: {ratio(_seconds(cw), _seconds(cb)):.2f}   (cold session: warm stack / baseline stack; "
          "target ≤ 0.65)")
    kinds = (("warm_consecutive", ws), ("cold_warm", cw), ("baseline", m["baseline"]))
    medians = {name: phase_medians(records) for name, records in kinds}
    print("where the time goes (medians, ms; bench_figures.turn_phases):")
    print(f"  {'':18}" + "".join(f"{p.removesuffix('_ms'):>17}" for p in PHASES))
    for name, _ in kinds:
        print(f"  {name:18}" + "".join(f"{medians[name][p]:>17}" for p in PHASES))
    for name in ("warm_consecutive", "cold_warm"):
        for p in PHASES:
            print(f"phase_{name}_{p}: {medians[name][p]}")


def _memory_run(stack: Stack, client: StackClient, turns: int, warmup: int, sessions: int) -> dict[str, Any]:
    """``turns`` consecutive turns round-robin over ``sessions`` new sessions on the stack's one worker,
    a ``worker_memory`` sample after every ``max(1, turns // 100)``-th; progress every 50 turns."""
    worker = stack.workers[0]
    ids = [f"{client.session_id}-mem-{i}" for i in range(sessions)]
    for sid in ids:
        client.make_session(sid)
    every = max(1, turns // 100)
    samples: list[tuple[int, float]] = []
    pss: list[tuple[int, float]] = []
    app_servers: list[Any] = []
    counts: list[int] = []
    warm_turns = failed = 0
    t0 = time.monotonic()
    for n in range(1, turns + 1):
        try:
            _, turn = client.turn(f"memory {n}", session_id=ids[n % sessions])
            warm_turns += (turn.get("timings") or {}).get("warm") == 1
        except (AssertionError, OSError) as exc:
            failed += 1
            print(f"  memory: turn {n} failed: {exc}", file=sys.stderr)
        if n % every == 0 or n == turns:
            sample = worker_memory(worker.pid)
            samples.append((n, sample.worker_rss_kb))
            pss.append((n, sample.worker_pss_kb))
            app_servers += sample.app_servers
            counts.append(len(sample.app_servers))
        if n % 50 == 0:
            print(f"  memory: {n}/{turns} turns, {time.monotonic() - t0:.0f} s, worker RSS {samples[-1][1] / 1024:.1f} MiB",
                  file=sys.stderr, flush=True)
    return {"turns": turns, "warmup": warmup, "samples": samples, "pss": pss, "app_servers": app_servers,
            "app_server_counts": counts, "warm": warm_turns, "failed": failed, "seconds": time.monotonic() - t0,
            "sessions": sessions}


def _print_memory_figures(mem: dict[str, Any]) -> None:
    g = memory_growth(mem["samples"], mem["warmup"])
    p = memory_growth(mem["pss"], mem["warmup"])
    print(f"memory run: {mem['turns']} turns over {mem['sessions']} sessions on one warm-stack worker in "
          f"{mem['seconds']:.0f} s; {mem['warm']} on a kept-loaded thread; {len(mem['samples'])} samples")
    print(f"memory_failed: {mem['failed']}")
    print(f"worker_rss_after_warmup_kb: {g['after_warmup_kb']:.0f}   (Celery main + pool child, VmRSS, after "
          f"{mem['warmup']} turns)")
    print(f"worker_rss_end_kb: {g['end_kb']:.0f}")
    print(f"worker_memory_growth: {g['growth']:.3f}   (end / after warm-up; target ≤ 1.05)")
    print(f"worker_pss_growth: {p['growth']:.3f}   (the same on Pss: {p['after_warmup_kb']:.0f} → {p['end_kb']:.0f} kB)")
    if mem["app_servers"]:
        counts = sorted(mem["app_server_counts"])
        alive = f"{counts[0]}–{counts[-1]} alive per sample"
        for name in ("private", "pss", "rss"):
            value = statistics.median(getattr(m, f"{name}_kb") for m in mem["app_servers"])
            print(f"app_server_{name}_median_kb: {value:.0f}   (per app-server under the worker between turns, with "
                  f"its children, smaps_rollup{' Private_Clean + Private_Dirty' if name == 'private' else ''}; {alive})")
    else:
        print("app_server_private_median_kb: none   (no app-server alive under the worker between turns)")


def _worker_turns_env(worker_turns: int | None) -> dict[str, str]:
    """``HERMES_WORKER_TURNS`` for the throughput stack's workers (``--worker-turns``); none: the setting's own."""
    return {} if worker_turns is None else {"HERMES_WORKER_TURNS": str(worker_turns)}


def _throughput_part(tput: Stack, token: str, session_id: str, broker: str, args: argparse.Namespace) -> None:
    """Start the throughput stack's API, run the throughput rounds (with the direct rounds and the capacity
    probe beside ``--direct-workers``) and print their figures."""
    client = StackClient(tput.start_api(), token, session_id=session_id)
    client.wait_up(make_session=False)
    probe = Probe(broker) if args.direct_workers else None
    try:
        results = run_throughput(tput, client, args.workers, args.throughput_sessions, args.throughput_rounds,
                                 beside=args.direct_workers or None, probe=probe)
    finally:
        if probe is not None:
            probe.close()
    _print_throughput(results, args.throughput_sessions, args.throughput_rounds, tput.http_workers, args.worker_turns,
                      args.warm_memory_budget_mb)


def _print_throughput(results: list[WorkerCountResult], sessions: int, rounds: int, http_workers: int,
                      worker_turns: int | None, budget_mb: int) -> None:
    turns = "the setting's default" if worker_turns is None else worker_turns
    print(f"throughput: {sessions} sessions at once, {rounds} rounds per worker count (warm stack settings, "
          f"HERMES_WORKER_TURNS {turns}, HERMES_WARM_MEMORY_BUDGET_MB {budget_mb}, one gunicorn of {http_workers} "
          "sync workers); turns/s over rounds 2+, "
          "round 1 (thread starts) apart")
    for r in results:
        f = r.figures()
        print(f"throughput_w{r.workers}_turns_per_s: {f['turns_per_s']}   (round 1: {f['first_round_turns_per_s']}; "
              f"{f['warm']}/{f['later_turns']} later turns on a kept-loaded thread)")
        print(f"throughput_w{r.workers}_failed: {f['failed']}   (of {f['turns']})")
    for r in results:
        if r.direct_rounds:
            _print_direct(r, sessions)
        if r.capacity is not None:
            c = r.capacity
            later = sum(x.turns for x in r.rounds[1:])
            print_capacity(capacity_figures(c.stack, c.background, later, c.own_transactions), c.stack, c.background,
                           later, capacity_rollout_figures(session_rollouts(c.sessions)),
                           f"rounds 2–{len(r.rounds)} of {r.workers} workers × {sessions} sessions")


def _print_direct(r: WorkerCountResult, sessions: int) -> None:
    """The stack's throughput against warm direct app-servers driven as many at once, beside its rounds."""
    f = r.figures()
    print(f"throughput_direct_turns_per_s: {f['direct_turns_per_s']}   ({sessions} warm direct app-servers, each its "
          f"own home, workspace-write profile and one loaded thread, {sessions} turns at once; "
          f"{len(r.direct_rounds)} rounds beside the stack's rounds 2+; started in {r.direct_start_seconds:.0f} s; "
          f"{f['direct_failed']} failed)")
    print(f"throughput_ratio_vs_direct: {f['ratio_vs_direct']}   ({r.workers} workers' {f['turns_per_s']} turns/s / "
          "direct; target ≥ 0.5, goal 0.8)")
    print(f"throughput_kept_share: {f['kept_share']}   ({f['warm']}/{f['later_turns']} of the {r.workers} workers' later "
          "turns on a kept-loaded thread, timings.warm; target ≥ 0.8)")


def _worker_counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


# The options whose default ``--quick`` changes: (default, under --quick). An option given on the command
# line wins over both (``--quick --history-runs 5`` runs five history rounds).
SIZES: dict[str, tuple[Any, Any]] = {
    "runs": (15, 2),
    "history_runs": (HISTORY_RUNS, 0),
    "workers": ([1, 2, 4], [1, 2]),
    "throughput_sessions": (50, 4),
    "throughput_rounds": (3, 2),
    "memory_turns": (1000, 30),
    "rollout_rounds": (3, 0),
}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, help="interleaved rounds of the latency figures (default 15); 0 skips them")
    parser.add_argument("--history-runs", type=int,
                        help=f"rounds of long-history turns, run after the latency rounds whatever --runs is (default "
                             f"{HISTORY_RUNS}); 0 skips them")
    parser.add_argument("--warm-pool", type=int, default=1, help="HERMES_WARM_POOL of the warm stack")
    parser.add_argument("--workers", type=_worker_counts,
                        help="worker counts of the throughput runs, comma-separated (default 1,2,4); empty skips them")
    parser.add_argument("--throughput-sessions", type=int, help="default 50")
    parser.add_argument("--throughput-rounds", type=int, help="default 3")
    parser.add_argument("--direct-workers", type=int, default=2,
                        help="the worker count whose later throughput rounds run beside warm direct app-servers "
                             "(throughput_ratio_vs_direct) and give the capacity inputs (default 2); 0 skips both")
    parser.add_argument("--warm-memory-budget-mb", type=int, default=4096,
                        help="HERMES_WARM_MEMORY_BUDGET_MB of the throughput stack (default 4096: its 50 sessions' "
                             "kept threads, ~40 MB private each after a few turns, fit; docs/capacity.md)")
    parser.add_argument("--worker-turns", type=int,
                        help="HERMES_WORKER_TURNS of the throughput stack's workers (default: the setting's own)")
    parser.add_argument("--memory-turns", type=int, help="turns of the memory run (default 1000); 0 skips it")
    parser.add_argument("--memory-warmup", type=int, default=100,
                        help="turns before the memory baseline (at most a third of --memory-turns)")
    parser.add_argument("--memory-sessions", type=int, default=4)
    parser.add_argument("--rollout-rounds", type=int,
                        help="rounds of devtools.bench_rollout (100 MB vs 1 MB rollout, cold turns; its own database "
                             "and in-process worker; default 3); 0 skips it")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run for tests: 2 rounds, no history, 1 and 2 workers × 4 sessions × 2 rounds, "
                             "30 memory turns (each unless given explicitly)")
    args = parser.parse_args(argv)
    for name, (default, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    args.memory_warmup = min(args.memory_warmup, args.memory_turns // 3)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures; exits with a message without PostgreSQL and a broker."""
    args = _arguments(argv)
    db_url = os.environ.get("DATABASE_URL", "")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    env = _environment(database_beside(db_url, "_bench"), broker, scratch)
    procs: list[subprocess.Popen[bytes]] = []
    warm_settings = {**WARM_ENV, "HERMES_WARM_POOL": str(args.warm_pool)}
    tput_settings = {**warm_settings, **_worker_turns_env(args.worker_turns),
                     "HERMES_WARM_MEMORY_BUDGET_MB": str(args.warm_memory_budget_mb)}
    stacks: list[Stack] = []
    try:
        _start_stand_in(env, scratch, procs)  # sets CODEX_STAND_IN_URL: before the stacks copy env
        stacks += [Stack("baseline", stack_environment(env, "baseline", BASELINE_ENV), asgi=True),
                   Stack("warm", stack_environment(env, "warm", warm_settings), asgi=True),
                   Stack("tput", stack_environment(env, "tput", tput_settings), http_workers=4)]
        baseline, warm_stack, tput = stacks
        token = _setup_django(env)
        for stack in (baseline, warm_stack):
            stack.start_api()
            stack.add_worker()
        s = Sessions(baseline=StackClient(baseline.api, token), warm=StackClient(warm_stack.api, token))
        s.warm.session_id += "-warm"
        s.baseline.wait_up()
        s.warm.wait_up()
        history = HistoryBench(s.baseline) if args.history_runs > 0 else None
        if history is not None:
            t0 = time.monotonic()
            history.create()
            print(f"history_setup_s: {time.monotonic() - t0:.1f}   ({BIG:,} + {SMALL} messages by INSERT … SELECT generate_series)")
        if args.runs > 0:
            m = _measure(s, args.runs, env["CODEX_WORK_ROOT"])
            _print_results(args.runs, m)
            _print_warm_figures(m, warm_settings)
            _print_rollout_figures(m, _chunks(s.baseline.session_id))
            sys.stdout.flush()
        if history is not None:
            t0 = time.monotonic()
            history.run(args.history_runs)
            _print_history_figures(history, time.monotonic() - t0)
        sys.stdout.flush()
        if args.memory_turns > 0:
            _print_memory_figures(_memory_run(warm_stack, s.warm, args.memory_turns, args.memory_warmup,
                                              args.memory_sessions))
            print_app_server_memory(measure_app_server_memory(extra_threads=3 if args.quick else 10))
            sys.stdout.flush()
        s.baseline.close()  # the sessions' event streams
        s.warm.close()
        baseline.stop()
        warm_stack.stop()
        if args.workers:
            _throughput_part(tput, token, s.baseline.session_id, broker, args)
        if args.rollout_rounds > 0:
            sys.stdout.flush()
            subprocess.run([sys.executable, "-m", "devtools.bench_rollout", "--rounds", str(args.rollout_rounds)],
                           cwd=BASE, env={k: v for k, v in os.environ.items() if k != "CELERY_BROKER_URL"}, check=False)
        print(f"bench_seconds: {time.monotonic() - started:.0f}")
        return 0
    finally:
        for stack in stacks:
            stack.stop()
        stop_processes(procs)
        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(env["DATABASE_URL"])  # a scratch database: nothing in it outlives the run


def _print_rollout_figures(m: dict[str, Any], chunks: list[tuple[int, int, int]]) -> None:
    """Figure 1 (restore + store against the whole turn) and figure 2 (bytes stored per turn)."""
    o = rollout_overhead(m["stack"], m["phases"])
    print(f"median_restore_ms: {o['restore_ms']}   (wipe + recreate the session's CODEX_HOME, load the chunks, write + verify the rollout)")
    print(f"median_capture_ms: {o['capture_ms']}   (read what codex appended, check the stored prefix)")
    print(f"median_store_ms: {o['store_ms']}     (compress, insert the chunk, fenced header update — inside finalize)")
    print(f"ratio_rollout_overhead: {o['ratio_rollout_overhead']:.3f}   "
          "(stack turn / (stack turn − restore − capture − store); target ≤ 1.10)")
    c = chunk_figures(chunks)
    print(f"chunk_bytes_raw_median: {c['chunk_bytes_raw_median']:.0f}   (per resumed echo turn, {c['turns']} turns)")
    print(f"chunk_bytes_stored_median: {c['chunk_bytes_stored_median']:.0f}   (zlib: {c['chunk_stored_percent']} % of raw)")
    print(f"first_chunk_bytes: {c['first_chunk_bytes_raw']} raw, {c['first_chunk_bytes_stored']} stored   (the thread's first turn)")


def _print_history_figures(h: HistoryBench, seconds: float) -> None:
    """Figure 3: turns that read a 100,000-message history against a 10-message one — the median of the
    per-pair ratios, with their spread and the median's 95 % confidence interval."""
    runs = len(h.seconds[(h.KINDS[0], BIG)])
    print(f"history: {runs} rounds in {seconds:.0f} s (after an untimed one); per kind and round a pair of turns, "
          f"{BIG:,}-message and {SMALL}-message session back to back, alternating which goes first")
    for kind in h.KINDS:
        name = "first_turn" if kind == "first" else "rotation"
        big, small = h.seconds[(kind, BIG)], h.seconds[(kind, SMALL)]
        threads = "/".join(str(phase_median(h.timings[(kind, n)], "thread_ms")) for n in (BIG, SMALL))
        print(f"median_history_{name}_ms: {median_ms(big)} ({BIG:,} messages) vs {median_ms(small)} ({SMALL})   "
              f"(worker thread_ms {threads}; {len(big)} runs each)")
        pairs = h.ratios(kind)
        r = ratio_spread(pairs)
        print(f"  history {name}: per-pair ratios in round order: " + " ".join(f"{x:.3f}" for x in pairs),
              file=sys.stderr)
        print(f"ratio_history_{name}: {r['median']:.3f}   (median of {r['n']} per-pair ratios; target ≤ 1.05; "
              f"95 % CI of the median {r['ci_low']:.3f}–{r['ci_high']:.3f}, IQR {r['q1']:.3f}–{r['q3']:.3f}, "
              f"min–max {r['min']:.3f}–{r['max']:.3f}; ratio of the medians {ratio(big, small):.3f})")
        print(f"ratio_history_{name}_ci_low: {r['ci_low']:.3f}")
        print(f"ratio_history_{name}_ci_high: {r['ci_high']:.3f}")
    print(f"median_history_seed_read_ms: {median_ms(h.seed_seconds[BIG])} ({BIG:,} messages) vs "
          f"{median_ms(h.seed_seconds[SMALL])} ({SMALL})   (turns.history_seed alone, in the bench process)")


def _chunks(session_id: str) -> list[tuple[int, int, int]]:
    """``(seq, size, stored bytes)`` of the chunks of the session's bound thread's rollout."""
    from django.db.models.functions import Length

    from hermes_sessions.models import CodexBinding, RolloutChunk

    thread = CodexBinding.objects.get(session_id=session_id, status=CodexBinding.Status.ACTIVE).thread_id
    rows = RolloutChunk.objects.filter(rollout__thread_id=thread).annotate(stored=Length("data"))
    return [(seq, size, stored) for seq, size, stored in rows.values_list("seq", "size", "stored")]


def _codex_version(argv: list[str]) -> str:
    try:
        return subprocess.run([argv[0], "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
