"""Memory of a process tree as the kernel counts it, read from Linux ``/proc`` (kB).

Three figures per process, all from ``/proc/<pid>/smaps_rollup`` (Linux ≥ 4.14):

* **private** (USS) — ``Private_Clean + Private_Dirty``: the pages only this process maps, what the host
  gets back when it exits. Caps and budgets use this one.
* **pss** — ``Pss``: every page divided by the number of processes mapping it; summed over all processes
  of a host it is the host's memory in use. Figures print it beside private.
* **rss** — ``Rss``: every page the process maps, shared ones counted in full in every process. Printed
  beside the other two only: codex's 315 MB binary has its text pages shared by every app-server, so
  RSS overstates an app-server's cost about 7× (issue 26; ``docs/benchmarks.md``).

A *tree* is a process with its descendants (``/proc/<pid>/task/*/children``): an app-server counted with
the sandbox helpers it runs. Reading ``smaps_rollup`` of a process walks its mappings (~0.1–0.5 ms for an
app-server here); nothing here touches the database.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Memory", "children", "descendants", "process_memory", "tree_memory"]


@dataclass(frozen=True)
class Memory:
    """``private_kb`` (USS), ``pss_kb`` and ``rss_kb`` of a process or a tree, in kB (1024 bytes)."""

    private_kb: int = 0
    pss_kb: int = 0
    rss_kb: int = 0

    def __add__(self, other: Memory) -> Memory:
        return Memory(self.private_kb + other.private_kb, self.pss_kb + other.pss_kb, self.rss_kb + other.rss_kb)

    @property
    def private_mb(self) -> float:
        """``private_kb`` in MiB."""
        return self.private_kb / 1024


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def process_memory(pid: int | None) -> Memory:
    """The ``Memory`` of process ``pid`` alone; all zero once it is gone, for a zombie (no mappings) or
    ``None``."""
    if pid is None:
        return Memory()
    fields: dict[str, int] = {}
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
            fields[name] = int(rest.split()[0])
    return Memory(private_kb=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
                  pss_kb=fields.get("Pss", 0), rss_kb=fields.get("Rss", 0))


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
    out: list[int] = []
    todo = children(pid)
    while todo:
        c = todo.pop(0)
        if c not in out:
            out.append(c)
            todo += children(c)
    return out


def tree_memory(pid: int | None) -> Memory:
    """The ``Memory`` of ``pid`` plus all its descendants (zero when ``pid`` is ``None`` or gone)."""
    if pid is None:
        return Memory()
    total = process_memory(pid)
    for d in descendants(pid):
        total += process_memory(d)
    return total
