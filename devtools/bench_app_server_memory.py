"""What a kept thread costs in memory, on the real pinned codex binary and the model stand-in: private memory
(USS), PSS and RSS (kB, ``hermes_sessions.worker.warm.process_memory``, each app-server with its children) of

* ``--app-servers`` (4) idle app-servers side by side, each with one loaded thread that ran one turn, each
  under a session's permission profile in its own home as a worker runs them (``launch.app_server_argv``);
* one app-server that then loads ``--extra-threads`` (10) more threads (``thread/start`` + a turn each):
  the private memory one more loaded thread adds.

Printed as ``name: value`` lines (``bench_figures.parse_figures``): ``app_server_one_thread_private_kb``
(median), ``…_pss_kb``, ``…_rss_kb``, ``app_server_private_kb_per_extra_thread``, and
``kept_threads_per_gib`` (1 GiB / private memory of one app-server with its thread). ``make bench`` runs
it in its memory part; alone: ``python -m devtools.bench_app_server_memory`` (no database, no broker).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from devtools.model_stand_in import ModelStandIn

SETTLE_SECONDS = 1.0  # after a turn, before reading: codex's own post-turn work (rollout flush, sqlite) ends


def _configure(scratch: Path, stand_in_url: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-app-server-memory-only")
    os.environ.update({"CODEX_HOMES_ROOT": str(scratch / "homes"), "CODEX_WORK_ROOT": str(scratch / "work"),
                       "CODEX_HOME": str(scratch / "codex_home"), "CODEX_USER_HOME": str(scratch / "user_home"),
                       "CODEX_MODEL_PROVIDER": "stand-in", "CODEX_STAND_IN_URL": stand_in_url})
    os.environ.pop("CODEX_APP_SERVER_COMMAND", None)
    import django

    django.setup()


def _app_server(session_id: str):  # noqa: ANN202 — devtools.bench.Direct, imported after Django's setup
    from devtools.bench import Direct
    from hermes_sessions import policy
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

    workdir = policy.session_workdir(session_id)
    workdir.mkdir(parents=True, exist_ok=True)
    home = prepare_session_home(session_id, sandbox="workspace-write", workdir=workdir)
    d = Direct(app_server_argv(sandbox="workspace-write", workdir=workdir), app_server_env(home), str(workdir))
    d.initialize()
    return d, str(workdir)


def _load_thread(d, work: str) -> str:  # noqa: ANN001
    thread = d.request("thread/start", {"cwd": work})["thread"]["id"]
    d.turn(thread, "hello")
    return thread


def measure(*, app_servers: int = 4, extra_threads: int = 10) -> dict[str, float]:
    """The figures (module docstring); Django must be set up (``_configure``)."""
    from hermes_sessions.worker.warm.process_memory import tree_memory

    servers = []
    try:
        for i in range(app_servers):
            d, work = _app_server(f"mem-{i}")
            servers.append(d)
            _load_thread(d, work)
        time.sleep(SETTLE_SECONDS)
        one = [tree_memory(d.proc.pid) for d in servers]
        d, work = _app_server("mem-many")
        servers.append(d)
        _load_thread(d, work)
        time.sleep(SETTLE_SECONDS)
        first = tree_memory(d.proc.pid)
        for _ in range(extra_threads):
            _load_thread(d, work)
        time.sleep(SETTLE_SECONDS)
        many = tree_memory(d.proc.pid)
    finally:
        for s in servers:
            s.close()
    private = statistics.median(m.private_kb for m in one)
    return {
        "app_server_one_thread_private_kb": private,
        "app_server_one_thread_pss_kb": statistics.median(m.pss_kb for m in one),
        "app_server_one_thread_rss_kb": statistics.median(m.rss_kb for m in one),
        "app_server_many_threads_private_kb": many.private_kb,
        "app_server_private_kb_per_extra_thread": round((many.private_kb - first.private_kb) / extra_threads),
        "kept_threads_per_gib": round(1024 * 1024 / private, 1),
        "extra_threads": extra_threads,
        "app_servers": app_servers,
    }


def print_figures(f: dict[str, float]) -> None:
    print(f"app_server_one_thread_private_kb: {f['app_server_one_thread_private_kb']:.0f}   (median of "
          f"{f['app_servers']:.0f} idle app-servers, one loaded thread each, with children: smaps_rollup "
          "Private_Clean + Private_Dirty)")
    print(f"app_server_one_thread_pss_kb: {f['app_server_one_thread_pss_kb']:.0f}")
    print(f"app_server_one_thread_rss_kb: {f['app_server_one_thread_rss_kb']:.0f}   (beside: shared text pages "
          "counted in full)")
    print(f"app_server_private_kb_per_extra_thread: {f['app_server_private_kb_per_extra_thread']:.0f}   (one "
          f"app-server with 1 + {f['extra_threads']:.0f} loaded threads: "
          f"{f['app_server_many_threads_private_kb']:.0f} kB private)")
    print(f"kept_threads_per_gib: {f['kept_threads_per_gib']}   (one app-server per kept thread, private memory; "
          "8 per worker process before the budget)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_app_server_memory",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--app-servers", type=int, default=4)
    parser.add_argument("--extra-threads", type=int, default=10)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="hermes-app-server-memory-"))
    try:
        with ModelStandIn() as stand_in:
            _configure(scratch, stand_in.base_url)
            print_figures(measure(app_servers=args.app_servers, extra_threads=args.extra_threads))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
