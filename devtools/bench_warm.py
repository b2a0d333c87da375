"""``make bench-warm`` — the warm path alone, quickly (~20 s): one session's consecutive turns through the
warm stack, each followed by the same turn on an app-server already running with its thread loaded
under the session's permission profile (the warm direct turn of ``make bench``), and where the stack
turn's time went. For working on ``ratio_vs_warm`` between full ``make bench`` runs; the figures of
record come from ``make bench``.

The stack is ``make bench``'s warm stack (``bench_stacks.py``): gunicorn serving the API as ``make run``
does (ASGI, uvicorn workers) unless ``--wsgi``; one ``-c 1`` worker. The client waits for each turn on the
session's open event stream, as a chat client does, unless ``--poll`` (``GET`` every 5 ms).

Printed: ``ratio_vs_warm``, the phase medians (``bench_figures.turn_phases``) and the median of every
key of the turns' ``timings``. ``--spy S``: record the API process and the worker's pool process with
``py-spy`` (``--py-spy PATH``; not a dependency of the project) for S seconds, writing raw collapsed
stacks to ``--spy-dir``; the direct turns are skipped meanwhile (py-spy slows the stack).
With ``HERMES_LATENCY_MARKS=FILE`` in the environment, the stack's processes write their marks to FILE
(``hermes_sessions/latency_marks.py``) and the client's records go beside it; ``python -m
devtools.latency_report FILE`` then prints every hop's median.
Run as ``python -m devtools.bench_warm [--turns N] [--poll] [--wsgi] [--spy S]``."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools.bench import _direct_thread, _environment, _setup_django, _start_stand_in
from devtools.bench_figures import PHASES, turn_phases
from devtools.bench_stacks import WARM_ENV, Stack, StackClient, stack_environment, stop_processes
from devtools.databases import database_beside, drop_database
from devtools.latency_report import write_records
from hermes_sessions import latency_marks


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _spies(stack: Stack, seconds: int, py_spy: str, out_dir: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy on the API's worker process and the Celery pool process, ``seconds`` long, raw format."""
    assert stack.gunicorn is not None
    worker = stack.workers[0].pid if stack.pool == "solo" else _children(stack.workers[0].pid)[0]
    targets = {"api": _children(stack.gunicorn.pid)[0], "worker": worker}
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "500", "--idle", "-t", "-f", "raw",
                              "-o", str(out_dir / f"{name}.txt"), "-d", str(seconds)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets.items()]


def _write_marks_records(records: list[dict[str, Any]]) -> None:
    """The client's records beside the stack's latency marks, when they are being written."""
    if latency_marks.enabled():
        write_records(Path(os.environ[latency_marks.ENV]), records)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_warm", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--poll", action="store_true", help="wait by polling GET /api/turns/{id}/ every 5 ms")
    parser.add_argument("--wsgi", action="store_true", help="serve the API with gunicorn's sync workers (WSGI)")
    parser.add_argument("--pool", default="prefork", choices=("prefork", "solo"), help="the worker's Celery pool")
    parser.add_argument("--spy", type=int, default=0, help="seconds of py-spy recording (0: none)")
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--spy-dir", default="var/bench-warm")
    args = parser.parse_args(argv)
    db_url, broker = os.environ.get("DATABASE_URL", ""), os.environ.get("CELERY_BROKER_URL", "")
    if not db_url.startswith("postgres") or not broker:
        sys.exit("make bench-warm needs DATABASE_URL=postgres://… and CELERY_BROKER_URL (the Makefile sets them)")
    scratch = Path(tempfile.mkdtemp(prefix="hermes-bench-warm-"))
    env = _environment(database_beside(db_url, "_bench_warm"), broker, scratch)
    procs: list[subprocess.Popen[bytes]] = []
    stack: Stack | None = None
    client: StackClient | None = None
    watch = not args.poll
    try:
        _start_stand_in(env, scratch, procs)
        stack = Stack("warm", stack_environment(env, "warm", WARM_ENV), asgi=not args.wsgi, pool=args.pool)
        token = _setup_django(env)
        stack.start_api()
        stack.add_worker()
        client = StackClient(stack.api, token)
        client.wait_up()
        for _ in range(3):
            client.timed_turn("warm-up", watch=watch)
        from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

        work = Path(env["CODEX_WORK_ROOT"])
        work.mkdir(parents=True, exist_ok=True)
        home = prepare_session_home("bench-direct-profile", sandbox="read-only", workdir=work)
        direct, thread = _direct_thread(app_server_argv(sandbox="read-only", workdir=work), app_server_env(home), str(work))
        spies = _spies(stack, args.spy, args.py_spy, Path(args.spy_dir)) if args.spy else []
        records, direct_s = [], []
        for i in range(args.turns):
            records.append(client.timed_turn(f"bench {i}", watch=watch))
            if not spies:
                t0, records[-1]["direct_start"] = time.monotonic(), time.time()
                direct.turn(thread, f"bench {i}")
                direct_s.append(time.monotonic() - t0)
                records[-1]["direct_end"] = time.time()
        direct.close()
        for spy in spies:
            spy.wait()
        _write_marks_records(records)
        stack_ms = _median([r["seconds"] * 1000 for r in records])
        warm = sum(1 for r in records if (r["turn"].get("timings") or {}).get("warm") == 1)
        print(f"turns: {args.turns} ({warm} warm; API {'WSGI' if args.wsgi else 'ASGI'}; worker -P {args.pool}; client "
              f"{'polls' if args.poll else 'watches the event stream'})")
        print(f"warm_turns: {warm}")
        print(f"median_warm_stack_ms: {stack_ms}")
        if direct_s:
            direct_ms = _median([d * 1000 for d in direct_s])
            print(f"median_warm_profile_ms: {direct_ms}")
            print(f"ratio_vs_warm: {stack_ms / direct_ms:.2f}")
        rows = [turn_phases(r) for r in records]
        print("phases (ms): " + "  ".join(f"{k.removesuffix('_ms')} {_median([r[k] for r in rows])}" for k in PHASES))
        keys = sorted({k for r in records for k, v in (r["turn"].get("timings") or {}).items() if isinstance(v, (int, float))})
        print("timings (ms): " + "  ".join(
            f"{k} {_median([float(r['turn']['timings'][k]) for r in records if k in r['turn']['timings']])}" for k in keys))
        if spies:
            print(f"py-spy: {args.spy_dir}/api.txt, {args.spy_dir}/worker.txt")
        return 0
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
