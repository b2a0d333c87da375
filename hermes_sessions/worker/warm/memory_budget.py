"""The host's memory budget for kept threads: private memory (USS, ``process_memory.py``) of every kept
app-server of every worker process on the host, capped by ``HERMES_WARM_MEMORY_BUDGET_MB``.

How the worker processes of a host see each other: a file per process under
``HERMES_VAR_DIR/warm-memory/``, named ``<pid>-<start time>`` and holding the private kB of that
process's kept app-servers, rewritten (temp file + rename) whenever its kept set changes. A reader sums
the files of live processes and removes those of processes that are gone (a pid reused by another
process has another start time). A file rather than PostgreSQL's worker rows: the budget is a fact of
one host, which ``HERMES_VAR_DIR`` already is (one per deployment and host, ``StateDirectory=`` under
systemd); a keep must not add a database round trip to the warm path; and a worker killed with SIGKILL
leaves a file that the next reader drops at once (its pid is gone), where a row would wait for the
sweep. What it gives up: two processes admitting at the same moment each see the other's total from
before, so the host can exceed the budget by one app-server per process until their next keep —
``admit`` is a soft bound, ``HERMES_WARM_MAX_THREADS`` per process the hard one.

``admit`` is the decision alone (pure, ``tests/codex/test_memory_budget.py``); ``HostLedger`` the files.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    """``keep``: whether the candidate is kept; ``evict``: the keys of this process's kept threads to
    close first (least recently used first); ``reason``: why the candidate is not kept (``""`` when it is)."""

    keep: bool
    evict: tuple[str, ...] = ()
    reason: str = ""


def admit(*, candidate_kb: int, kept: list[tuple[str, int]], others_kb: int, budget_kb: int | None,
          max_threads: int) -> Admission:
    """Whether a thread whose app-server holds ``candidate_kb`` private kB may be kept.

    ``kept``: this process's other kept threads as ``(key, private kB)``, least recently used first;
    ``others_kb``: the other worker processes' kept private kB on this host (``HostLedger.others_kb``);
    ``budget_kb``: the host's budget (``None``: no memory budget, the count alone bounds);
    ``max_threads``: this process's count cap (the safety cap). This process's least recently used
    threads are evicted until the candidate fits both; another process's are never touched (it evicts
    its own at its next keep). A candidate that cannot fit even with all of this process's others gone
    is not kept, and nothing is evicted for it."""
    if max_threads <= 0:
        return Admission(False, reason="keeping is off (HERMES_WARM_MAX_THREADS 0)")
    if budget_kb is not None and others_kb + candidate_kb > budget_kb:
        return Admission(False, reason=(
            f"its {candidate_kb / 1024:.0f} MiB private memory does not fit the host's budget "
            f"(HERMES_WARM_MEMORY_BUDGET_MB {budget_kb // 1024}; other workers keep {others_kb / 1024:.0f} MiB)"))
    evict: list[str] = []
    total = others_kb + candidate_kb + sum(kb for _, kb in kept)
    count = len(kept) + 1
    for key, kb in kept:
        if count <= max_threads and (budget_kb is None or total <= budget_kb):
            break
        evict.append(key)
        total -= kb
        count -= 1
    return Admission(True, tuple(evict))


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot), or ``None`` when gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    return stat.rpartition(")")[2].split()[19]


class HostLedger:
    """This host's worker processes' kept private memory, one file each under ``directory``
    (module docstring). Every method is safe to call from any thread; a file that cannot be read or
    written counts as nothing (logged): the count cap still bounds."""

    def __init__(self, directory: Path, *, pid: int | None = None) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self.name = f"{self.pid}-{_start_time(self.pid)}"
        # One writer at a time: the process's turns keep and close copies on several runner threads, and
        # they share the one temporary file (``tests/codex/test_memory_budget.py``).
        self._writing = threading.Lock()

    def publish(self, private_kb: int | Callable[[], int]) -> None:
        """Record this process's kept private kB (0 removes the file); a callable is read under the
        writer's lock, so that of two threads the one that writes last writes the newer figure."""
        with self._writing:
            self._write(private_kb() if callable(private_kb) else private_kb)

    def _write(self, private_kb: int) -> None:
        target = self.directory / self.name
        try:
            if private_kb <= 0:
                target.unlink(missing_ok=True)
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{self.name}.tmp"
            tmp.write_text(str(private_kb))
            os.replace(tmp, target)
        except OSError as exc:
            logger.warning("warm memory ledger %s: not written: %s", target, exc)

    def others_kb(self) -> int:
        """The kept private kB the host's other live worker processes published; files of processes that
        are gone are removed."""
        total = 0
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        for name in names:
            if name.startswith(".") or name == self.name:
                continue
            pid, _, start = name.partition("-")
            if not pid.isdigit() or _start_time(int(pid)) != start:
                (self.directory / name).unlink(missing_ok=True)
                continue
            try:
                total += int((self.directory / name).read_text() or 0)
            except (OSError, ValueError):
                continue
        return total
