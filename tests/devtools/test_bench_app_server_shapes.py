"""``devtools.bench_app_server_shapes``'s arithmetic (pure): how threads are spread over app-servers, memory per
thread, turns per second; and the ``name: value`` lines parse."""
from __future__ import annotations

import pytest

from devtools.bench_app_server_shapes import per_thread_kb, print_figures, shape_layout, turns_per_second
from devtools.bench_figures import parse_figures


@pytest.mark.parametrize(("threads", "per_server", "layout"), [
    (50, 1, [1] * 50),
    (50, 10, [10] * 5),
    (50, 50, [50]),
    (7, 3, [3, 3, 1]),
    (3, 10, [3]),
])
def test_shape_layout_holds_every_thread_once(threads, per_server, layout):
    assert shape_layout(threads, per_server) == layout
    assert sum(layout) == threads


@pytest.mark.parametrize(("threads", "per_server"), [(0, 1), (5, 0), (-1, 3)])
def test_shape_layout_refuses_nothing_to_spread(threads, per_server):
    with pytest.raises(ValueError):
        shape_layout(threads, per_server)


def test_per_thread_kb_is_the_trees_sum_over_the_threads():
    assert per_thread_kb([22_000] * 50, 50) == 22_000
    assert per_thread_kb([100_000], 50) == 2_000
    with pytest.raises(ValueError):
        per_thread_kb([1], 0)


def test_turns_per_second_over_the_burst_wall_time():
    assert turns_per_second(50, 10.0, 15.0) == 10.0
    for end in (10.0, 9.0):
        with pytest.raises(ValueError):
            turns_per_second(50, 10.0, end)


def test_printed_figures_parse(capsys):
    print_figures({"shape_1_private_kb_per_thread": 22340, "shape_50_turns_per_s": 6.6, "isolation_a_reads_b": 0})
    assert parse_figures(capsys.readouterr().out) == {
        "shape_1_private_kb_per_thread": 22340, "shape_50_turns_per_s": 6.6, "isolation_a_reads_b": 0}
