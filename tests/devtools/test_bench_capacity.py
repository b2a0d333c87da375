"""``make bench``'s capacity inputs and throughput ratios (``devtools/bench_capacity.py``,
``bench_throughput.WorkerCountResult``, ``bench_app_server_memory.kept_thread_figures``): the arithmetic,
and the CPU of a reaped child read from a real process tree."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from devtools.bench_app_server_memory import kept_thread_figures
from devtools.bench_capacity import (
    CLK_TCK,
    COUNTERS,
    Counters,
    ProcessCpu,
    Window,
    backend_ticks,
    figures,
    process_tree_cpu,
    rollout_figures,
    split_worker_cpu,
    top_tables,
)
from devtools.bench_throughput import Round, WorkerCountResult


def _counters(at: float, **values: int) -> Counters:
    return Counters(at=at, values={name: values.get(name, 0) for name in COUNTERS})


def test_worker_cpu_is_the_python_processes_own_and_codex_the_rest_with_what_they_reaped():
    procs = [
        ProcessCpu(pid=1, python=True, own=100, reaped=7),     # Celery main: reaped nothing of codex's but 7
        ProcessCpu(pid=2, python=True, own=50, reaped=300),    # pool child: 300 ticks of closed app-servers
        ProcessCpu(pid=3, python=False, own=40, reaped=20),    # a live app-server and the helpers it reaped
        ProcessCpu(pid=4, python=False, own=5, reaped=0),      # its live sandbox helper
    ]
    assert split_worker_cpu(procs) == (150, 7 + 300 + 40 + 20 + 5)


def test_an_app_server_reaped_inside_the_window_counts_only_its_time_in_the_window():
    # start: the app-server (pid 3) has used 40; by the end it used 70 in all and was reaped by the pool child
    start = [ProcessCpu(2, True, 50, 300), ProcessCpu(3, False, 40, 0)]
    end = [ProcessCpu(2, True, 60, 300 + 70)]
    (w0, c0), (w1, c1) = split_worker_cpu(start), split_worker_cpu(end)
    assert (w1 - w0, c1 - c0) == (10, 30)


def test_backends_count_from_the_start_reading_or_from_birth_and_gone_ones_are_missed():
    assert backend_ticks({10: 100, 11: 50}, {10: 130, 12: 9}) == 30 + 9


def test_window_sums_pairs_and_per_table_rows():
    w = Window()
    a = _counters(10.0, pg_commits=100, wal_bytes=1_000, api_ticks=5)
    a.tables = {"turn": (10, 4)}
    b = _counters(12.5, pg_commits=160, wal_bytes=9_000, api_ticks=8)
    b.tables = {"turn": (14, 9), "message": (6, 0)}
    b.backends = {7: 4}
    w.add(a, b)
    w.add(_counters(20.0, pg_commits=200), _counters(21.0, pg_commits=240))
    assert w.values["pg_commits"] == 100 and w.values["wal_bytes"] == 8_000 and w.values["api_ticks"] == 3
    assert w.values["pg_ticks"] == 4 and w.seconds == pytest.approx(3.5)
    assert w.tables == {"turn": (4, 5), "message": (6, 0)}
    assert not w.worker_pids_changed
    c = _counters(0)
    c.worker_pids = frozenset({1, 2})
    w.add(_counters(0), c)
    assert w.worker_pids_changed
    assert top_tables(w, 2, 0) == [("message", 3.0), ("turn", 2.0)]
    assert top_tables(w, 2, 1) == [("turn", 2.5)]


def test_figures_take_off_the_bench_s_own_transactions_and_the_background_rate():
    stack = Window(seconds=10.0)
    stack.values.update(pg_commits=2_030, rows_inserted=1_100, wal_bytes=3_000_000, redis_commands=700,
                        codex_ticks=20 * CLK_TCK, worker_ticks=2 * CLK_TCK, api_ticks=CLK_TCK, pg_ticks=0,
                        table_bytes=819_200)
    background = Window(seconds=4.0)
    background.values.update(wal_bytes=400_000, redis_commands=200)  # 100 kB/s and 50/s of others' work
    f = figures(stack, background, turns=100, own_transactions=30)
    assert f["pg_commits"] == 20.0 and f["rows_inserted"] == 11.0 and f["table_bytes"] == 8192.0
    assert f["wal_bytes_raw"] == 30_000.0 and f["wal_bytes_background_per_s"] == 100_000.0
    assert f["wal_bytes"] == (3_000_000 - 100_000 * 10) / 100 == 20_000.0
    assert f["redis_commands_raw"] == 7.0 and f["redis_commands"] == 2.0
    assert (f["codex_cpu_ms"], f["worker_cpu_ms"], f["api_cpu_ms"], f["pg_cpu_ms"]) == (200.0, 20.0, 10.0, 0.0)
    no_background = figures(stack, Window(), turns=100, own_transactions=0)
    assert no_background["wal_bytes"] == no_background["wal_bytes_raw"] == 30_000.0
    with pytest.raises(ValueError):
        figures(stack, background, turns=0, own_transactions=0)


def test_rollout_figures_are_per_session_medians_and_totals_per_turn():
    f = rollout_figures([(3, 15_000, 48_000), (3, 9_000, 36_000), (2, 8_000, 30_000), (0, 0, 0)])
    assert f["rollout_sessions"] == 3
    assert f["rollout_stored_bytes_per_turn"] == 4_000.0  # 5000, 3000, 4000 per turn
    assert f["rollout_raw_bytes_per_turn"] == 15_000.0     # 16000, 12000, 15000
    assert f["rollout_stored_bytes_total_per_turn"] == 32_000 / 8
    with pytest.raises(ValueError):
        rollout_figures([(0, 0, 0)])


def test_ratio_vs_direct_divides_the_later_rounds_turns_per_s_and_kept_share_counts_warm_turns():
    r = WorkerCountResult(workers=2, rounds=[Round(50, 20.0, 0, 0), Round(50, 10.0, 0, 40), Round(50, 15.0, 1, 45)])
    assert r.figures()["kept_share"] == 0.85 and "ratio_vs_direct" not in r.figures()
    r.direct_rounds = [Round(50, 5.0, 0), Round(50, 7.5, 0)]
    f = r.figures()
    assert f["turns_per_s"] == 4.0 and f["direct_turns_per_s"] == 8.0 and f["ratio_vs_direct"] == 0.5
    assert f["failed"] == 1 and f["direct_failed"] == 0 and f["direct_turns"] == 100


def test_kept_threads_per_gib_against_the_old_cap_counted_as_rss():
    f = kept_thread_figures(one_private_kb=22_000, one_rss_kb=146_000, first_private_kb=22_500,
                            many_private_kb=41_500, extra_threads=10)
    assert f["kept_threads_per_gib"] == round(1024 * 1024 / 22_000, 1) == 47.7
    assert f["kept_threads_per_gib_old_cap"] == 7.2  # 8 per process at 8 × 146 MB: 1 GiB / 146 MB
    assert f["kept_threads_per_gib_factor"] == 6.6   # 146,000 / 22,000
    assert f["app_server_private_kb_per_extra_thread"] == 1_900
    assert f["kept_threads_per_gib_shared"] == round(11 * 1024 * 1024 / 41_500, 1) == 277.9
    assert f["kept_threads_per_gib_shared_factor"] == 38.7


def test_a_reaped_non_python_child_s_cpu_shows_as_codex_under_its_python_parent():
    """A Python process runs a busy ``sh`` loop to its end and reaps it: the loop's CPU is in the parent's
    cutime/cstime, which ``split_worker_cpu`` counts as codex's, not the worker's."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; sys.stdin.readline(); "
         "subprocess.run(['sh', '-c', 'i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done']); "
         "print('done', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)  # the interpreter's start-up, before the first reading
        worker0, codex0 = split_worker_cpu(process_tree_cpu(parent.pid))
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        worker1, codex1 = split_worker_cpu(process_tree_cpu(parent.pid))
        assert codex1 - codex0 >= CLK_TCK // 20  # the loop ran ≥ 50 ms of CPU (~0.3–1 s here)
        assert worker1 - worker0 < codex1 - codex0
    finally:
        parent.kill()
        parent.wait()
