"""``make bench`` — wall time of one turn through the whole stack against codex driven directly.

Everything runs in one go on this machine with the same model stand-in and the same pinned codex:

* **stack**: ``POST /api/sessions/{id}/turns/`` on gunicorn → Redis → a Celery worker → a fresh
  ``codex app-server`` that resumes the session's thread → PostgreSQL, until ``GET /api/turns/{id}/``
  reports ``succeeded`` (polled every 5 ms);
* **same work**: a minimal script spawns the app-server, ``initialize``, ``thread/resume``,
  ``turn/start`` → ``turn/completed``, closes it (what the worker must do for a restarted session);
* **same work, fresh home**: the same script on a ``CODEX_HOME`` made afresh for the turn with only the
  thread's rollout in it (as every stack turn's home is; making it is not timed);
* **warm**: ``turn/start`` → ``turn/completed`` on an app-server already running with the thread loaded;
* **spare stack**: the stack turn of a second session through a second gunicorn and worker whose turn queue
  is its own and whose worker keeps ``HERMES_WARM_POOL=2`` spare app-servers (``codex/warm.py``): a
  cold session's turn that starts at restore + resume. ``ratio_spare_vs_cold`` = spare stack / stack.

Runs are interleaved (stack, same work, fresh home, warm, …) so drift hits them alike. Prints the medians
and ``ratio_vs_same_work`` / ``ratio_vs_warm`` / ``ratio_fresh_home_vs_same_work``, and in the same run:

* **rollout overhead**: the stack turns' ``restore_ms`` / ``capture_ms`` / ``store_ms`` (``Turn.timings``)
  and ``ratio_rollout_overhead`` = turn / (turn − restore − capture − store);
* **bytes stored per turn**: the bench thread's ``RolloutChunk`` sizes, raw and as stored;
* **long history** (``bench_history.py``): first turns and rotations in a session with 100,000 prior
  messages against one with 10, interleaved with the rounds above: ``ratio_history_first_turn``,
  ``ratio_history_rotation``.

Needs ``DATABASE_URL`` (PostgreSQL; a ``*_bench``
database is created beside it and dropped after the run) and ``CELERY_BROKER_URL``. Run as ``python -m devtools.bench [--runs N] [--history-runs N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from devtools.bench_figures import chunk_figures, median_ms, phase_median, ratio, rollout_overhead
from devtools.bench_history import BIG, SMALL, HistoryBench
from devtools.databases import create_database, database_beside, drop_database
from devtools.processes import free_port, stand_in_argv, wait_for_port_file

BASE = Path(__file__).resolve().parent.parent


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


class StackClient:
    """The REST API as a client sees it, with the ``bench`` user's token."""

    def __init__(self, api: str, token: str):
        self.api = api
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        self.session_id = f"bench-{int(time.time())}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.api + path, method=method, headers=self.headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")

    def wait_up(self) -> None:
        """Until gunicorn answers (at most about 20 s), then make the bench session."""
        for _ in range(200):
            try:
                self.call("GET", "/sessions/")
                break
            except OSError:
                time.sleep(0.1)
        self.call("POST", "/sessions/", {"id": self.session_id})

    def turn(self, text: str, *, session_id: str | None = None) -> tuple[float, dict[str, Any]]:
        """POST a turn (to the bench session unless ``session_id``) and poll it every 5 ms until
        terminal; ``(seconds, the turn)``; it must succeed."""
        t0 = time.monotonic()
        turn = self.call("POST", f"/sessions/{session_id or self.session_id}/turns/", {"input": text})
        while turn["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.005)
            turn = self.call("GET", f"/turns/{turn['id']}/")
        elapsed = time.monotonic() - t0
        assert turn["status"] == "succeeded", turn
        return elapsed, turn


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


def _spare_environment(env: dict[str, str]) -> dict[str, str]:
    """The spare stack's: its own turn queue (its API sends there, its worker alone consumes it) and
    two spare app-servers in the worker."""
    return {**env, "HERMES_TURN_QUEUE": env["HERMES_TURN_QUEUE"] + "-spare", "HERMES_WARM_POOL": "2"}


def _start_api_and_worker(env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> str:
    """gunicorn (one worker) and a Celery turn worker (``-c 1``); returns the API's base URL."""
    http_port = free_port()
    procs.append(subprocess.Popen([str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind", f"127.0.0.1:{http_port}",
                                   "--workers", "1", "--log-level", "warning"], cwd=BASE, env=env))
    procs.append(subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", env["HERMES_TURN_QUEUE"],
                                   "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                                   "-l", "warning"], cwd=BASE, env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL))
    return f"http://127.0.0.1:{http_port}/api"


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


def _measure(client: StackClient, runs: int, work: str, history: HistoryBench | None, history_runs: int,
             spare: StackClient) -> dict[str, Any]:
    """``runs`` interleaved rounds of stack, spare stack, same work and warm — the first ``history_runs``
    of them followed by a round of long-history turns; the seconds of each and the worker's phase timings."""
    from hermes_sessions.codex.launch import app_server_argv, app_server_env

    client.turn("warm-up")  # starts the session's thread
    spare.turn("warm-up")
    if history is not None:
        history.round(0, record=False)  # warm-up: every kind of turn once, on both sessions
    argv, codex_env = app_server_argv(), app_server_env()
    Path(work).mkdir(parents=True, exist_ok=True)
    d, direct_thread = _direct_thread(argv, codex_env, work)  # the direct script's own thread
    d.close()
    warm, warm_thread = _direct_thread(argv, codex_env, work)  # the warm app-server: kept loaded
    fresh = FreshHome(argv, codex_env, work, Path(work).parent / "fresh_home")
    out: dict[str, Any] = {"stack": [], "same": [], "fresh": [], "warm": [], "phases": [], "argv": argv,
                           "spare": [], "spare_phases": []}
    for i in range(runs):
        elapsed, turn = client.turn(f"bench {i}")
        out["stack"].append(elapsed)
        out["phases"].append(turn["timings"])
        elapsed, turn = spare.turn(f"bench {i}")
        out["spare"].append(elapsed)
        out["spare_phases"].append(turn["timings"])
        t0 = time.monotonic()
        d = Direct(argv, codex_env, work)
        d.initialize()
        d.request("thread/resume", {"threadId": direct_thread, "excludeTurns": True})
        d.turn(direct_thread, f"bench {i}")
        d.close()
        out["same"].append(time.monotonic() - t0)
        out["fresh"].append(fresh.turn(f"bench {i}"))
        t0 = time.monotonic()
        warm.turn(warm_thread, f"bench {i}")
        out["warm"].append(time.monotonic() - t0)
        if history is not None and i < history_runs:
            history.round(i)
    warm.close()
    return out


def _print_results(runs: int, m: dict[str, Any]) -> None:
    s, a, w = median_ms(m["stack"]), median_ms(m["same"]), median_ms(m["warm"])
    print(f"runs: {runs} (interleaved; codex {_codex_version(m['argv'])}; model stand-in; PostgreSQL + Redis)")
    print(f"median_stack_ms: {s}        (POST turn → GET shows succeeded; gunicorn, Celery worker, fresh app-server, resume)")
    print(f"median_same_work_ms: {a}    (direct script: spawn, initialize, thread/resume, turn, close)")
    print(f"median_warm_ms: {w}         (turn on an already-running app-server with the thread loaded)")
    f = median_ms(m["fresh"])
    print(f"median_same_work_fresh_home_ms: {f}   (the direct script on a CODEX_HOME made afresh with only the rollout, "
          "as each stack turn's; making it not timed)")
    for key in ("restore_ms", "initialize_ms", "thread_ms", "turn_ms", "capture_ms", "codex_ms", "store_ms", "run_ms"):
        value = phase_median(m["phases"], key)
        if value is not None:
            print(f"  worker {key}: median {value}")
    print(f"ratio_vs_same_work: {s / a:.2f}")
    print(f"ratio_vs_warm: {s / w:.2f}")
    print(f"ratio_fresh_home_vs_same_work: {f / a:.2f}   (codex's own cost of starting on a cold home)")
    _print_spare_figures(m)


def _print_spare_figures(m: dict[str, Any]) -> None:
    """The spare stack against today's cold stack turn, in the same run (README "Warm turns")."""
    p = median_ms(m["spare"])
    on_spare = sum(1 for t in m["spare_phases"] if t.get("spare") == 1)
    print(f"median_spare_stack_ms: {p}   (a second stack whose worker keeps HERMES_WARM_POOL=2 spare app-servers; "
          f"{on_spare}/{len(m['spare_phases'])} turns ran on a spare)")
    for key in ("restore_ms", "initialize_ms", "thread_ms", "turn_ms", "codex_ms"):
        value = phase_median(m["spare_phases"], key)
        if value is not None:
            print(f"  spare worker {key}: median {value}")
    print(f"ratio_spare_vs_cold: {ratio(m['spare'], m['stack']):.2f}   (spare stack / stack; issue 9's target for a "
          "cold session's turn ≤ 0.65)")


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


def _print_history_figures(h: HistoryBench) -> None:
    """Figure 3: turns that read a 100,000-message history against a 10-message one."""
    for kind in h.KINDS:
        name = "first_turn" if kind == "first" else "rotation"
        big, small = h.seconds[(kind, BIG)], h.seconds[(kind, SMALL)]
        threads = "/".join(str(phase_median(h.timings[(kind, n)], "thread_ms")) for n in (BIG, SMALL))
        print(f"median_history_{name}_ms: {median_ms(big)} ({BIG:,} messages) vs {median_ms(small)} ({SMALL})   "
              f"(worker thread_ms {threads}; {len(big)} runs each)")
        print(f"ratio_history_{name}: {ratio(big, small):.3f}   (target ≤ 1.05)")
    print(f"median_history_seed_read_ms: {median_ms(h.seed_seconds[BIG])} ({BIG:,} messages) vs "
          f"{median_ms(h.seed_seconds[SMALL])} ({SMALL})   (turns.history_seed alone, in the bench process)")


def _chunks(session_id: str) -> list[tuple[int, int, int]]:
    """``(seq, size, stored bytes)`` of the chunks of the session's bound thread's rollout."""
    from django.db.models.functions import Length

    from hermes_sessions.models import CodexBinding, RolloutChunk

    thread = CodexBinding.objects.get(session_id=session_id, status=CodexBinding.Status.ACTIVE).thread_id
    rows = RolloutChunk.objects.filter(rollout__thread_id=thread).annotate(stored=Length("data"))
    return [(seq, size, stored) for seq, size, stored in rows.values_list("seq", "size", "stored")]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM) if p.pid == os.getpgid(p.pid) else p.terminate()
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its medians; exits with a message without PostgreSQL and a broker."""
    parser = argparse.ArgumentParser(prog="python -m devtools.bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--history-runs", type=int, default=9,
                        help="rounds (of the first --runs) followed by the long-history turns; 0 skips them")
    args = parser.parse_args(argv)

    db_url = os.environ.get("DATABASE_URL", "")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    env = _environment(database_beside(db_url, "_bench"), broker, scratch)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start_stand_in(env, scratch, procs)
        token = _setup_django(env)
        client = StackClient(_start_api_and_worker(env, procs), token)
        client.wait_up()
        spare = StackClient(_start_api_and_worker(_spare_environment(env), procs), token)
        spare.session_id += "-spare"
        spare.wait_up()
        history = HistoryBench(client) if args.history_runs > 0 else None
        if history is not None:
            t0 = time.monotonic()
            history.create()
            print(f"history_setup_s: {time.monotonic() - t0:.1f}   ({BIG:,} + {SMALL} messages by INSERT … SELECT generate_series)")
        m = _measure(client, args.runs, env["CODEX_WORK_ROOT"], history, args.history_runs, spare)
        _print_results(args.runs, m)
        _print_rollout_figures(m, _chunks(client.session_id))
        if history is not None:
            _print_history_figures(history)
        return 0
    finally:
        _stop(procs)
        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(env["DATABASE_URL"])  # a scratch database: nothing in it outlives the run


def _codex_version(argv: list[str]) -> str:
    try:
        return subprocess.run([argv[0], "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
