"""The host's memory budget for kept threads (``worker/warm/memory_budget.py``): the admission decision
(pure), the ledger the worker processes of a host share (files under a directory, real pids), and the
keeper that uses both (``worker/warm/kept.py``)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hermes_sessions.worker.warm import kept as kept_mod
from hermes_sessions.worker.warm.kept import Keeper
from hermes_sessions.worker.warm.memory_budget import HostLedger, admit
from hermes_sessions.worker.warm.process_memory import Memory

from .test_kept import FakeClient, make_kept

MIB = 1024


# --- admit ------------------------------------------------------------------------------------------

def test_a_thread_that_fits_is_kept_and_nothing_evicted():
    d = admit(candidate_kb=21 * MIB, kept=[("a", 21 * MIB)], others_kb=100 * MIB, budget_kb=200 * MIB, max_threads=8)
    assert d.keep and d.evict == () and d.reason == ""


def test_this_process_least_recently_used_go_first_until_the_candidate_fits():
    kept = [("old", 30 * MIB), ("mid", 30 * MIB), ("new", 30 * MIB)]
    d = admit(candidate_kb=30 * MIB, kept=kept, others_kb=50 * MIB, budget_kb=150 * MIB, max_threads=8)
    # 50 + 4 × 30 = 170 > 150: one goes, the least recently used.
    assert d.keep and d.evict == ("old",)
    d = admit(candidate_kb=70 * MIB, kept=kept, others_kb=50 * MIB, budget_kb=150 * MIB, max_threads=8)
    assert d.keep and d.evict == ("old", "mid")  # 50 + 70 + 30 = 150: exactly the budget
    d = admit(candidate_kb=71 * MIB, kept=kept, others_kb=50 * MIB, budget_kb=150 * MIB, max_threads=8)
    assert d.keep and d.evict == ("old", "mid", "new")


def test_a_thread_the_other_processes_leave_no_room_for_is_not_kept_and_evicts_nothing():
    d = admit(candidate_kb=30 * MIB, kept=[("a", 10 * MIB)], others_kb=130 * MIB, budget_kb=150 * MIB, max_threads=8)
    assert not d.keep and d.evict == () and "HERMES_WARM_MEMORY_BUDGET_MB 150" in d.reason


def test_the_count_cap_holds_under_a_roomy_budget():
    kept = [(k, MIB) for k in "abc"]
    d = admit(candidate_kb=MIB, kept=kept, others_kb=0, budget_kb=10_000 * MIB, max_threads=3)
    assert d.keep and d.evict == ("a",)
    assert admit(candidate_kb=MIB, kept=kept, others_kb=0, budget_kb=None, max_threads=2).evict == ("a", "b")
    assert not admit(candidate_kb=MIB, kept=[], others_kb=0, budget_kb=None, max_threads=0).keep


def test_without_a_budget_memory_never_refuses():
    d = admit(candidate_kb=10**9, kept=[("a", 10**9)], others_kb=10**9, budget_kb=None, max_threads=8)
    assert d.keep and d.evict == ()


# --- the ledger --------------------------------------------------------------------------------------

@pytest.fixture
def other_worker():
    """A live process standing for another worker process of the host."""
    proc = subprocess.Popen(["sleep", "30"])
    yield proc
    proc.kill()
    proc.wait()


def test_each_process_sees_the_others_totals_and_not_its_own(tmp_path: Path, other_worker):
    mine, theirs = HostLedger(tmp_path), HostLedger(tmp_path, pid=other_worker.pid)
    mine.publish(40 * MIB)
    theirs.publish(25 * MIB)
    assert mine.others_kb() == 25 * MIB and theirs.others_kb() == 40 * MIB
    theirs.publish(0)  # nothing kept: its file goes
    assert mine.others_kb() == 0 and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]


def test_a_dead_process_file_is_dropped_by_the_next_reader(tmp_path: Path, other_worker):
    HostLedger(tmp_path, pid=other_worker.pid).publish(25 * MIB)
    other_worker.kill()
    other_worker.wait()
    mine = HostLedger(tmp_path)
    assert mine.others_kb() == 0 and list(tmp_path.iterdir()) == []


def test_a_reused_pid_with_another_start_time_does_not_count(tmp_path: Path, other_worker):
    (tmp_path / f"{other_worker.pid}-1").write_text(str(25 * MIB))  # a process that had this pid before
    assert HostLedger(tmp_path).others_kb() == 0 and list(tmp_path.iterdir()) == []


# --- the keeper under a budget ----------------------------------------------------------------------

@pytest.fixture
def sizes(monkeypatch):
    """``tree_memory`` of a fake app-server pid is what the test says: ``sizes[pid] = private kB``."""
    table: dict[int, int] = {}
    monkeypatch.setattr(kept_mod, "tree_memory", lambda pid: Memory(private_kb=table.get(pid or 0, 0)))
    return table


def test_keepers_of_two_processes_share_the_host_budget(tmp_path: Path, sizes, other_worker):
    budget = 100.0
    here = Keeper(max_threads=32, idle_seconds=60, max_turns=200, max_private_mb=256, budget_mb=budget,
                  ledger=HostLedger(tmp_path))
    there = Keeper(max_threads=32, idle_seconds=60, max_turns=200, max_private_mb=256, budget_mb=budget,
                   ledger=HostLedger(tmp_path, pid=other_worker.pid))
    for pid in range(1, 8):
        sizes[pid] = 21 * MIB
    a, b, c = (make_kept(s, client=FakeClient(pid=p)) for s, p in (("a", 1), ("b", 2), ("c", 3)))
    assert there.keep(a) == [] and there.keep(b) == []  # 42 MiB there
    assert here.keep(c) == []  # 63 MiB on the host
    d, e = make_kept("d", client=FakeClient(pid=4)), make_kept("e", client=FakeClient(pid=5))
    assert here.keep(d) == []  # 84 MiB
    assert here.keep(e) == [c] and c.client.closes == 1  # 105 > 100: this process's own oldest goes
    assert [s for s, _, _ in here.kept_threads()] == ["d", "e"] and there.private_kb() == 42 * MIB
    # The other process's next keep sees this one's 42 MiB and makes room from its own.
    f = make_kept("f", client=FakeClient(pid=6))
    assert there.keep(f) == [a] and [s for s, _, _ in there.kept_threads()] == ["b", "f"]
    # Too big for what the others leave: not kept, nothing of its own closed for it.
    sizes[7] = 70 * MIB
    g = make_kept("g", client=FakeClient(pid=7))
    assert here.keep(g) == [g] and g.client.closes == 1 and [s for s, _, _ in here.kept_threads()] == ["d", "e"]
    assert here.ledger is not None and there.ledger is not None
    assert here.ledger.others_kb() == there.private_kb() == 42 * MIB  # what each published
    assert there.ledger.others_kb() == here.private_kb() == 42 * MIB
    here.close_all()
    assert HostLedger(tmp_path, pid=other_worker.pid).others_kb() == 0


def test_threads_publishing_at_once_write_whole_files_and_the_last_figure(tmp_path: Path, caplog):
    """A process's turns keep and close copies on several runner threads at once: every write lands (no
    'not written' for a temporary file another thread moved away) and the file holds the last figure."""
    import threading

    ledger = HostLedger(tmp_path)
    figures = iter(range(1, 10_001))
    lock = threading.Lock()

    def next_figure() -> int:
        with lock:
            return next(figures)

    def publish_many() -> None:
        for _ in range(500):
            ledger.publish(next_figure)

    threads = [threading.Thread(target=publish_many) for _ in range(8)]
    with caplog.at_level("WARNING"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert "not written" not in caplog.text
    assert (tmp_path / ledger.name).read_text() == "4000"
