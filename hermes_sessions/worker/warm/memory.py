"""The memory the app-servers a worker keeps (kept threads, spares) hold, from Linux's ``/proc``.

Per process tree (an app-server and every process below it: the commands and sandboxes codex runs),
from ``/proc/<pid>/smaps_rollup`` (Linux ≥ 4.14): **USS**, the memory only that process holds and would
free at its exit (``Private_Clean`` + ``Private_Dirty``), and **PSS** (``Pss``: its own plus its share of
pages it shares). Resident size (``VmRSS``) counts the shared codex binary once per process and
overstates what more kept threads cost. Children come from ``/proc/<pid>/task/<tid>/children`` when
the kernel has it (``CONFIG_PROC_CHILDREN``), else from one pass over ``/proc/*/stat``. A process that
ended meanwhile counts 0. Reading a rollup walks the process's page tables: ~0.1–1 ms each.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class TreeMemory:
    """Bytes: ``uss`` (Private_Clean + Private_Dirty) and ``pss`` of processes added up."""

    uss: int = 0
    pss: int = 0

    def __add__(self, other: TreeMemory) -> TreeMemory:
        return TreeMemory(self.uss + other.uss, self.pss + other.pss)


def process_memory(pid: int) -> TreeMemory:
    """One process's ``smaps_rollup`` figures; zero when it is gone or unreadable."""
    fields: dict[str, int] = {}
    try:
        with open(PROC / str(pid) / "smaps_rollup") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Private_Clean", "Private_Dirty"):
                    fields[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return TreeMemory()
    return TreeMemory(uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0), pss=fields.get("Pss", 0))


def _children_by_parent() -> dict[int, list[int]]:
    """``{ppid: [pid, …]}`` of every process, from ``/proc/*/stat`` (the fallback)."""
    found: dict[int, list[int]] = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid …": comm may hold spaces and parentheses; the last ")" ends it.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        found.setdefault(ppid, []).append(int(entry.name))
    return found


def _children(pid: int) -> list[int] | None:
    """``pid``'s children from ``/proc/<pid>/task/*/children``; ``None`` when the kernel has no such file."""
    kids: list[int] = []
    try:
        tasks = list(os.scandir(PROC / str(pid) / "task"))
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"{task.path}/children") as fh:
                kids.extend(int(p) for p in fh.read().split())
        except FileNotFoundError:
            return None
        except OSError:
            continue
    return kids


def tree_memory(pids: Iterable[int]) -> TreeMemory:
    """The memory of the processes ``pids`` and all their descendants, added up."""
    roots = list(pids)
    if not roots:
        return TreeMemory()
    by_parent: dict[int, list[int]] | None = None
    total, seen, todo = TreeMemory(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += process_memory(pid)
        kids = _children(pid) if by_parent is None else None
        if kids is None:
            if by_parent is None:
                by_parent = _children_by_parent()
            kids = by_parent.get(pid, [])
        todo.extend(kids)
    return total
