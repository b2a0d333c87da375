"""``make bench``'s memory figures: resident memory of a Celery turn worker's processes and of the codex
app-servers it keeps, read from Linux ``/proc`` (kB, as ``/proc/<pid>/status`` reports them).

A worker started as ``celery … worker -c 1`` is a tree: the Celery main process, its one prefork pool
child, and below the child the app-servers it spawned (spare ones, a kept-loaded one, the one running a
turn) with whatever codex runs under them (sandbox helpers, briefly). ``worker_memory`` splits that
tree into the worker's Python processes and the app-servers, each app-server counted with its own
descendants."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["WorkerMemory", "children", "descendants", "pss_kb", "rss_kb", "worker_memory"]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """The live children of ``pid``, from ``/proc/<pid>/task/*/children`` (every thread's: a child
    spawned from a worker's scheduler thread is listed under that thread)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        out += [int(c) for c in _read(f"/proc/{pid}/task/{tid}/children").split()]
    return sorted(set(out))


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, … of ``pid`` (breadth first; ``[]`` once it is gone)."""
    out, todo = [], children(pid)
    while todo:
        c = todo.pop(0)
        if c not in out:
            out.append(c)
            todo += children(c)
    return out


def rss_kb(pid: int) -> int:
    """``VmRSS`` of ``pid`` in kB (0 once it is gone, or for a zombie)."""
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pss_kb(pid: int) -> int:
    """``Pss`` of ``pid`` in kB from ``/proc/<pid>/smaps_rollup`` (pages shared with the other processes
    of the tree counted once across them); 0 once it is gone."""
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _is_python(pid: int) -> bool:
    exe = ""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    return "python" in os.path.basename(exe)


@dataclass
class WorkerMemory:
    """One sample of a worker tree: ``worker_rss_kb`` / ``worker_pss_kb`` = the Celery main process plus
    its Python pool child(ren); ``app_servers_kb`` = each app-server's RSS with its descendants'."""

    worker_rss_kb: int = 0
    worker_pss_kb: int = 0
    worker_pids: list[int] = field(default_factory=list)
    app_servers_kb: list[int] = field(default_factory=list)


def worker_memory(main_pid: int) -> WorkerMemory:
    """A sample of the worker whose Celery main process is ``main_pid``."""
    m = WorkerMemory(worker_pids=[main_pid])
    for child in children(main_pid):
        if _is_python(child):
            m.worker_pids.append(child)
            for grandchild in children(child):
                if _is_python(grandchild):
                    m.worker_pids.append(grandchild)
                else:
                    m.app_servers_kb.append(rss_kb(grandchild) + sum(rss_kb(d) for d in descendants(grandchild)))
        else:
            m.app_servers_kb.append(rss_kb(child) + sum(rss_kb(d) for d in descendants(child)))
    m.worker_rss_kb = sum(rss_kb(p) for p in m.worker_pids)
    m.worker_pss_kb = sum(pss_kb(p) for p in m.worker_pids)
    return m
