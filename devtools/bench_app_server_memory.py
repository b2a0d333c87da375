"""What a kept thread costs in memory, on the real pinned codex binary and the model stand-in: private memory
(USS), PSS and RSS (kB, ``hermes_sessions.worker.warm.process_memory``, each app-server with its children) of

* ``--app-servers`` (4) idle app-servers side by side, each with one loaded thread that ran one turn, each
  under a session's permission profile in its own home as a worker runs them (``launch.app_server_argv``);
* one app-server that then loads ``--extra-threads`` (10) more threads (``thread/start`` + a turn each):
  the private memory one more loaded thread adds.

Printed as ``name: value`` lines (``bench_figures.parse_figures``): ``app_server_one_thread_private_kb``
(median), ``…_pss_kb``, ``…_rss_kb``, ``app_server_private_kb_per_extra_thread``, and
``kept_threads_per_gib`` (1 GiB / private memory of one app-server with its thread), against what the old
cap allowed — 8 kept threads per worker process, each app-server counted as RSS, i.e. 1 GiB / the RSS of
one (``kept_threads_per_gib_old_cap``; the target is 10× more: ``kept_threads_per_gib_factor``) — and
what one app-server holding all 1 + ``--extra-threads`` threads gives (``kept_threads_per_gib_shared``,
its factor ``…_shared_factor``): the measured reason one app-server per thread stays short of 10×. ``make bench`` runs
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
    return {
        "app_server_one_thread_pss_kb": statistics.median(m.pss_kb for m in one),
        **kept_thread_figures(one_private_kb=statistics.median(m.private_kb for m in one),
                              one_rss_kb=statistics.median(m.rss_kb for m in one), first_private_kb=first.private_kb,
                              many_private_kb=many.private_kb, extra_threads=extra_threads),
        "app_servers": app_servers,
    }


GIB_KB = 1024 * 1024


def kept_thread_figures(*, one_private_kb: float, one_rss_kb: float, first_private_kb: float,
                        many_private_kb: float, extra_threads: int) -> dict[str, float]:
    """The per-GiB figures (module docstring) from what ``measure`` read, kB: ``one_*`` of an idle app-server
    with one loaded thread (medians), ``first_private_kb`` / ``many_private_kb`` of the app-server that
    went from one to 1 + ``extra_threads`` loaded threads. The old cap counts each kept thread as one
    app-server's RSS (8 per worker process, 8 × RSS for 8), so its threads per GiB are 1 GiB / RSS and
    the factor against it is RSS / private."""
    shared = GIB_KB * (1 + extra_threads) / many_private_kb
    return {
        "app_server_one_thread_private_kb": one_private_kb,
        "app_server_one_thread_rss_kb": one_rss_kb,
        "app_server_first_thread_private_kb": first_private_kb,
        "app_server_many_threads_private_kb": many_private_kb,
        "app_server_private_kb_per_extra_thread": round((many_private_kb - first_private_kb) / extra_threads),
        "kept_threads_per_gib": round(GIB_KB / one_private_kb, 1),
        "kept_threads_per_gib_old_cap": round(GIB_KB / one_rss_kb, 1),
        "kept_threads_per_gib_factor": round(one_rss_kb / one_private_kb, 1),
        "kept_threads_per_gib_shared": round(shared, 1),
        "kept_threads_per_gib_shared_factor": round(shared * one_rss_kb / GIB_KB, 1),
        "extra_threads": extra_threads,
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
    print(f"kept_threads_per_gib: {f['kept_threads_per_gib']}   (one app-server per kept thread, private memory)")
    print(f"kept_threads_per_gib_old_cap: {f['kept_threads_per_gib_old_cap']}   (8 kept threads per worker process, "
          f"counted as RSS: 1 GiB / {f['app_server_one_thread_rss_kb']:.0f} kB)")
    print(f"kept_threads_per_gib_factor: {f['kept_threads_per_gib_factor']}   (kept_threads_per_gib / old cap; target ≥ 10)")
    print(f"kept_threads_per_gib_shared: {f['kept_threads_per_gib_shared']}   ({1 + f['extra_threads']:.0f} threads in one "
          f"app-server, {f['app_server_many_threads_private_kb']:.0f} kB private; factor "
          f"{f['kept_threads_per_gib_shared_factor']} vs the old cap)")
    if f["kept_threads_per_gib_factor"] < 10:
        base = f["app_server_first_thread_private_kb"] - f["app_server_private_kb_per_extra_thread"]
        print(f"  why not 10× with one app-server per thread: each pays an app-server's own ~{base:.0f} kB private "
              f"beside its thread's ~{f['app_server_private_kb_per_extra_thread']:.0f} kB; 10× needs ≤ "
              f"{f['app_server_one_thread_rss_kb'] / 10:.0f} kB per kept thread")


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
