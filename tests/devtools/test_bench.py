"""``make bench``'s figures (pure) and its bulk history load (in the test database), without the stack."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from devtools.bench_figures import (
    PHASES,
    chunk_figures,
    epoch_seconds,
    median_ci_ranks,
    median_ms,
    memory_growth,
    paired_ratios,
    parse_figures,
    phase_median,
    phase_medians,
    ratio,
    ratio_spread,
    rollout_overhead,
    throughput,
    turn_phases,
)
from devtools.bench_history import seed_messages, small_row_chars
from hermes_sessions.history_seed import OMITTED
from hermes_sessions.models import Message, Session
from hermes_sessions.services.turns import history_seed, seed_row_limit
from tests.factories import SessionFactory, TurnFactory


def test_rollout_overhead_pairs_each_turn_with_its_own_timings():
    stack = [1.0, 1.1, 0.9]  # seconds
    timings = [
        {"restore_ms": 40, "capture_ms": 1, "store_ms": 9},
        {"restore_ms": 60, "capture_ms": 1, "store_ms": 39},
        {"restore_ms": 50, "store_ms": 0},  # a phase a turn lacks counts 0
    ]
    o = rollout_overhead(stack, timings)
    assert o["restore_ms"] == 50.0 and o["capture_ms"] == 1.0 and o["store_ms"] == 9.0
    # net turns: 950, 1000, 850 ms → median 950; whole median 1000
    assert o["ratio_rollout_overhead"] == pytest.approx(1000 / 950, abs=1e-3)
    with pytest.raises(ValueError):
        rollout_overhead(stack, timings[:2])


def test_chunk_figures_leave_the_first_turn_out_of_the_per_turn_medians():
    chunks = [(3, 6_000, 1_500), (1, 36_000, 12_000), (2, 7_000, 1_700), (4, 6_500, 1_600)]
    c = chunk_figures(chunks)
    assert c["chunk_bytes_raw_median"] == 6_500 and c["chunk_bytes_stored_median"] == 1_600
    assert c["first_chunk_bytes_raw"] == 36_000 and c["first_chunk_bytes_stored"] == 12_000
    assert c["turns"] == 3 and c["chunk_stored_percent"] == pytest.approx(24.6)
    assert chunk_figures([(1, 100, 50)])["chunk_bytes_raw_median"] == 100  # only a first turn: it is the figure


def test_medians_and_ratio():
    assert median_ms([0.2, 0.1, 0.3]) == 200.0
    assert phase_median([{"thread_ms": 3}, {"thread_ms": 1.0}, {}], "thread_ms") == 2.0
    assert phase_median([{}], "thread_ms") is None
    assert ratio([2.0, 2.2, 1.8], [1.0, 2.0, 3.0]) == 1.0


@pytest.mark.django_db
def test_seed_messages_appends_numbered_rows_and_the_seed_reads_only_the_tail():
    session = SessionFactory()
    seed_messages(session.id, 5_000, user_chars=200, assistant_chars=600)
    seed_messages(session.id, 3, user_chars=10, assistant_chars=20)  # appends after the first load
    session = Session.objects.get(pk=session.pk)
    assert session.last_message_seq == 5_003
    rows = Message.objects.filter(session=session).order_by("seq")
    assert rows.count() == 5_003
    assert list(rows.values_list("seq", flat=True)[:3]) == [1, 2, 3]
    first, second = rows[0], rows[1]
    assert (first.role, len(first.content)) == ("user", 200) and (second.role, len(second.content)) == ("assistant", 600)
    assert rows.last().seq == 5_003 and rows.last().role == "user" and len(rows.last().content) == 10
    seed = history_seed(session_id=session.id, exclude_turn_id=TurnFactory(session=session).id)
    assert OMITTED in seed and "message 4999: " in seed and "message 1: " not in seed
    assert seed_row_limit() < 5_000  # what the bench relies on: the seed never reads all of a long history


@pytest.mark.django_db
def test_ten_small_rows_fill_the_seed_cap(settings):
    session = SessionFactory()
    chars = small_row_chars()
    seed_messages(session.id, 10, user_chars=chars, assistant_chars=chars)
    seed = history_seed(session_id=session.id, exclude_turn_id=TurnFactory(session=session).id)
    assert len(seed) > settings.HERMES_HISTORY_SEED_MAX_CHARS * 0.9 and OMITTED in seed


def _record(*, post=(100.0, 100.020), created="1970-01-01T00:01:40.010000Z", started=100.050, finished=100.400,
            seen=100.430, timings=None):
    """A bench turn record: epoch seconds on the client, ISO timestamps from the API (100 s = 00:01:40)."""
    iso = lambda t: datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")  # noqa: E731
    return {"post_start": post[0], "post_end": post[1], "seen": seen,
            "turn": {"created_at": created, "started_at": iso(started), "finished_at": iso(finished),
                     "timings": {"run_ms": 350.0, "codex_ms": 300.0, "restore_ms": 20.0, "store_ms": 5.0}
                     if timings is None else timings}}


def test_turn_phases_split_a_turn_from_post_to_seen():
    p = turn_phases(_record())
    assert p["http_ms"] == 20.0
    assert p["queue_ms"] == 40.0  # created 100.010 → started 100.050
    assert p["claim_restore_ms"] == 65.0  # run 350 − codex 300 − store 5 + restore 20
    assert p["codex_ms"] == 280.0  # codex 300 − restore 20
    assert p["finalize_ms"] == 35.0  # store 5 + finished 100.400 → seen 100.430
    assert p["total_ms"] == 430.0
    # the four server-side phases add up to created_at → seen
    assert p["queue_ms"] + p["claim_restore_ms"] + p["codex_ms"] + p["finalize_ms"] == pytest.approx(420.0)


def test_turn_phases_count_missing_timings_as_zero_and_derive_run_ms():
    # a warm turn: no restore, nothing stored, no run_ms → finished − started
    p = turn_phases(_record(timings={"codex_ms": 60.0, "warm": 1}, started=100.050, finished=100.150, seen=100.160))
    assert p["claim_restore_ms"] == 40.0 and p["codex_ms"] == 60.0 and p["finalize_ms"] == 10.0


def test_phase_medians_take_each_phase_on_its_own():
    records = [_record(seen=100.430), _record(seen=100.440), _record(seen=100.530, post=(100.0, 100.100))]
    m = phase_medians(records)
    assert m["finalize_ms"] == 45.0 and m["total_ms"] == 440.0 and m["http_ms"] == 20.0
    assert set(m) == set(PHASES)
    with pytest.raises(ValueError):
        phase_medians([])


def test_epoch_seconds_reads_api_timestamps():
    assert epoch_seconds("1970-01-01T00:01:40.500000Z") == 100.5
    assert epoch_seconds("1970-01-01T01:01:40+01:00") == 100.0
    assert epoch_seconds(7) == 7.0


def test_throughput_is_turns_over_wall_seconds():
    assert throughput(150, 60.0) == 2.5
    assert throughput(50, 30.0) == 1.67
    with pytest.raises(ValueError):
        throughput(1, 0)


def test_memory_growth_compares_the_end_with_just_after_the_warm_up():
    samples = [(n, 100_000 + n) for n in range(10, 301, 10)]  # grows 1 kB a turn
    g = memory_growth(samples, warmup_turns=100)
    assert g["after_warmup_kb"] == 100_120.0  # median of the samples at 100, 110, …, 140
    assert g["end_kb"] == 100_280.0  # median of 260 … 300
    assert g["growth"] == pytest.approx(100_280 / 100_120, abs=1e-3)
    flat = memory_growth([(n, 50_000) for n in range(0, 1001, 10)][::-1], warmup_turns=100)  # order does not matter
    assert flat == {"after_warmup_kb": 50_000.0, "end_kb": 50_000.0, "growth": 1.0}
    assert memory_growth([(100, 1000), (200, 1100)], warmup_turns=100, window=1)["growth"] == 1.1
    with pytest.raises(ValueError):
        memory_growth([(10, 1.0)], warmup_turns=100)


def test_parse_figures_reads_name_value_lines_and_skips_prose():
    text = """runs: 5 (interleaved; codex 0.171.0)
ratio_vs_warm: 1.21   (warm stack consecutive / warm direct; target ≤ 1.25)
worker_memory_growth 1.012
throughput_w2_failed: 0   (of 150)
  worker restore_ms: median 3.0
where the time goes (medians, ms):
app_server_private_median_kb: none
phase_cold_warm_queue_ms: -0.4
"""
    assert parse_figures(text) == {"runs": 5.0, "ratio_vs_warm": 1.21, "worker_memory_growth": 1.012,
                                   "throughput_w2_failed": 0.0, "phase_cold_warm_queue_ms": -0.4}


def test_worker_count_result_reports_later_rounds_and_failures():
    from devtools.bench_throughput import Round, WorkerCountResult

    r = WorkerCountResult(workers=2, rounds=[Round(50, 50.0, 0, 0), Round(50, 20.0, 1, 40), Round(50, 30.0, 0, 45)])
    f = r.figures()
    assert f["turns_per_s"] == 2.0 and f["first_round_turns_per_s"] == 1.0
    assert f["failed"] == 1 and f["turns"] == 150 and f["warm"] == 85 and f["later_turns"] == 100
    assert WorkerCountResult(1, [Round(10, 5.0, 0, 0)]).figures()["turns_per_s"] == 2.0  # one round: it is the figure


def test_paired_ratios_divide_each_pair_on_its_own():
    assert paired_ratios([2.0, 3.0, 1.0], [1.0, 3.0, 2.0]) == [2.0, 1.0, 0.5]
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratios([], [])


def test_median_ci_ranks_are_the_binomial_order_statistics():
    # n = 9: P(X ≤ 1) = 10/512, so ranks 2–8 cover 1 − 2·10/512 ≈ 96.1 %; ranks 3–7 would cover only 82 %
    assert median_ci_ranks(9) == (2, 8, pytest.approx(1 - 20 / 512))
    lo, hi, coverage = median_ci_ranks(25)
    assert (lo, hi) == (8, 18) and 0.95 <= coverage < 0.96
    assert median_ci_ranks(21)[:2] == (6, 16)
    # too few values for 95 %: min–max, with the coverage it really has
    assert median_ci_ranks(5) == (1, 5, pytest.approx(1 - 2 / 32))
    assert median_ci_ranks(1) == (1, 1, 0.0)
    with pytest.raises(ValueError):
        median_ci_ranks(0)


def test_ratio_spread_reports_the_median_of_pairs_with_quartiles_and_interval():
    ratios = [1.00, 0.98, 1.30, 1.02, 0.97, 1.01, 0.99, 1.03, 0.96]  # one outlier pair (1.30)
    r = ratio_spread(ratios)
    assert r["n"] == 9 and r["median"] == 1.0
    assert (r["min"], r["max"]) == (0.96, 1.3)
    assert (r["q1"], r["q3"]) == (0.98, 1.02)
    assert (r["ci_low"], r["ci_high"]) == (0.97, 1.03)  # ranks 2 and 8 of the sorted nine
    assert r["ci_coverage"] == pytest.approx(0.961, abs=1e-3)
    assert ratio_spread([1.2])["median"] == 1.2


def test_history_runs_are_not_capped_by_runs():
    from devtools.bench import HISTORY_RUNS, _arguments

    args = _arguments(["--runs", "3", "--history-runs", "21"])
    assert (args.runs, args.history_runs) == (3, 21)
    args = _arguments([])
    assert (args.runs, args.history_runs, args.workers, args.memory_turns) == (15, HISTORY_RUNS, [1, 2, 4], 1000)
    assert _arguments(["--runs", "0"]).history_runs == HISTORY_RUNS  # history alone


def test_quick_sets_defaults_but_an_explicit_option_wins():
    from devtools.bench import _arguments

    q = _arguments(["--quick"])
    assert (q.runs, q.history_runs, q.workers, q.throughput_sessions, q.throughput_rounds, q.memory_turns) == \
        (2, 0, [1, 2], 4, 2, 30)
    q = _arguments(["--quick", "--history-runs", "5", "--runs", "4", "--workers="])
    assert (q.runs, q.history_runs, q.workers, q.memory_turns) == (4, 5, [], 30)
    assert _arguments(["--memory-turns", "30"]).memory_warmup == 10  # at most a third of the run, as documented


def test_history_bench_runs_a_warm_up_then_the_rounds_asked_and_pairs_them():
    from devtools.bench_history import BIG, SMALL, HistoryBench

    class Client:
        session_id = "bench"

    h = HistoryBench(Client())
    calls: list[tuple[int, bool]] = []
    h.round = lambda i, *, record=True: calls.append((i, record))  # type: ignore[method-assign]
    h.run(21)
    assert calls == [(0, False)] + [(i, True) for i in range(21)]
    h.seconds[("first", BIG)] += [1.1, 2.0]
    h.seconds[("first", SMALL)] += [1.0, 2.5]
    assert h.ratios("first") == pytest.approx([1.1, 0.8])
