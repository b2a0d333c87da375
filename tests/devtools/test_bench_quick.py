"""``make bench --quick`` end to end (e2e: the real codex, PostgreSQL, Redis, gunicorn and Celery workers;
about 3 minutes): every key figure is printed and parses, no turn failed, the worker tree was found."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.bench_figures import parse_figures
from devtools.databases import database_beside

pytestmark = pytest.mark.e2e
BASE = Path(__file__).resolve().parent.parent.parent


@pytest.mark.timeout(900)
def test_quick_bench_prints_every_figure():
    env = {**os.environ, "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY", "bench-quick-test-only"),
           "DATABASE_URL": database_beside(os.environ["DATABASE_URL"], "_quick")}  # → <name>_quick_bench
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the bench runs on project.settings, not the test settings
    result = subprocess.run([sys.executable, "-m", "devtools.bench", "--quick"], cwd=BASE, env=env,
                            capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:]
    f = parse_figures(result.stdout)
    for name in ("ratio_vs_warm", "ratio_cold_vs_today", "ratio_vs_same_work", "ratio_rollout_overhead",
                 "phase_warm_consecutive_queue_ms", "phase_cold_warm_codex_ms", "worker_memory_growth",
                 "worker_rss_end_kb", "app_server_private_median_kb", "app_server_pss_median_kb",
                 "app_server_rss_median_kb", "throughput_w1_turns_per_s",
                 "throughput_w2_turns_per_s", "throughput_direct_turns_per_s", "throughput_ratio_vs_direct",
                 "throughput_kept_share", "kept_threads_per_gib_factor", "capacity_pg_commits_per_turn",
                 "capacity_codex_cpu_ms_per_turn", "capacity_rollout_stored_bytes_per_turn"):
        assert name in f, f"{name} missing from:\n{result.stdout}"
    assert f["memory_failed"] == 0 and f["throughput_w1_failed"] == 0 and f["throughput_w2_failed"] == 0
    assert f["worker_rss_end_kb"] > 10_000 and 0.5 < f["worker_memory_growth"] < 2
    assert f["throughput_w1_turns_per_s"] > 0
    assert f["throughput_direct_turns_per_s"] > 0 and 0 <= f["throughput_kept_share"] <= 1
    assert f["capacity_pg_commits_per_turn"] > 0 and f["capacity_codex_cpu_ms_per_turn"] > 0
    assert 0 < f["capacity_rollout_stored_bytes_per_turn"] < f["capacity_rollout_raw_bytes_per_turn"]
    assert 0 < f["app_server_private_median_kb"] < f["app_server_pss_median_kb"] < f["app_server_rss_median_kb"]


@pytest.mark.timeout(300)
def test_bench_warm_runs_every_turn_on_the_kept_thread_and_prints_its_figures():
    """``make bench-warm``: the API on ASGI, the client waiting on the session's event stream, one ``-c 1``
    worker keeping the thread loaded — every timed turn ran warm, and the figures parse."""
    env = {**os.environ, "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY", "bench-warm-test-only"),
           "DATABASE_URL": database_beside(os.environ["DATABASE_URL"], "_quickwarm")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run([sys.executable, "-m", "devtools.bench_warm", "--turns", "3"], cwd=BASE, env=env,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    f = parse_figures(result.stdout)
    assert f["warm_turns"] == 3, result.stdout
    assert f["median_warm_stack_ms"] > 0 and f["ratio_vs_warm"] > 0
    assert "phases (ms): http" in result.stdout and "timings (ms): " in result.stdout
