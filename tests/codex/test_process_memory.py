"""``worker/warm/process_memory.py`` on real processes: a grandchild that allocates 50 MiB adds ≈ 50 MiB of
private memory (USS) to its tree, read from ``/proc/<pid>/smaps_rollup``, with PSS and RSS beside it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hermes_sessions.worker.warm.process_memory import Memory, descendants, process_memory, tree_memory

MIB = 1024  # kB
ALLOCATE = 50 * MIB

# Reads a line, then fills ALLOCATE kB with non-zero bytes (every page touched, none shared) and answers.
GRANDCHILD = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    f"block = b'x' * ({ALLOCATE} * 1024)\n"
    "print('allocated', flush=True)\n"
    "sys.stdin.readline()\n"
)


@pytest.fixture
def tree():
    """``sh`` (the top of the tree, a few hundred kB) running a Python grandchild that allocates on demand;
    ``; exit`` keeps sh from exec-ing into Python, so the allocating process is sh's child."""
    proc = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0"; exit', GRANDCHILD],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    try:
        yield proc
    finally:
        proc.kill()
        for pid in descendants(proc.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()


def test_a_descendant_allocating_50_mib_adds_about_50_mib_private_to_the_tree(tree):
    assert tree.stdin is not None and tree.stdout is not None
    assert len(descendants(tree.pid)) == 1
    top_before, before = process_memory(tree.pid), tree_memory(tree.pid)
    assert 0 < before.private_kb <= before.pss_kb <= before.rss_kb
    tree.stdin.write("go\n")
    tree.stdin.flush()
    assert tree.stdout.readline().strip() == "allocated"
    after = tree_memory(tree.pid)
    grown = after.private_kb - before.private_kb
    assert ALLOCATE * 0.95 <= grown <= ALLOCATE * 1.15, (before, after)
    # RSS is read beside it and grows alike; PSS of private pages is the pages themselves.
    assert ALLOCATE * 0.95 <= after.rss_kb - before.rss_kb <= ALLOCATE * 1.15
    assert after.private_kb <= after.pss_kb <= after.rss_kb
    # The top process alone did not grow: the tree's growth is its child's.
    assert abs(process_memory(tree.pid).private_kb - top_before.private_kb) < MIB


def test_shared_pages_count_in_rss_but_not_in_private():
    """Two Python processes share their interpreter's text pages: each one's RSS counts them, its private
    memory does not, and its PSS counts half of what both map."""
    a = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    b = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        for _ in range(200):
            m = process_memory(a.pid)
            if m.rss_kb > 4 * MIB:
                break
            subprocess.run(["sleep", "0.01"], check=True)
        assert m.private_kb < m.pss_kb < m.rss_kb
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_process_that_is_gone_reads_zero():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_memory(gone.pid) == Memory() == tree_memory(gone.pid) == tree_memory(None)
