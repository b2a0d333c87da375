"""``make bench``'s figures (pure) and its bulk history load (in the test database), without the stack."""
from __future__ import annotations

import pytest

from devtools.bench_figures import chunk_figures, median_ms, phase_median, ratio, rollout_overhead
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
