"""App-servers kept with a session's thread loaded between its turns (session affinity), per process.

After a turn that completed and whose rollout was stored, the worker process keeps the app-server that
ran it, with the thread still loaded, for an idle window: the session's next turn on this process skips
spawn, ``initialize``, the rollout restore and ``thread/resume`` (``turn/start`` goes to the loaded
thread, ``TurnSpec.thread_loaded``; a resume under the session's permission profile costs ~150–1,000 ms
cold, ``docs/codex.md`` §11). Nothing here touches the database; ``worker/affinity.py`` does (routing, heartbeat, release).

Facts this rests on (``docs/codex.md`` §7, §11): the rollout file is complete when ``turn/completed``
arrives, so a turn's delta is read with the process still running; a plain ``thread/resume`` of a
loaded thread writes nothing; closing stdin releases the thread (its writer lock) at once.

Safety: a kept thread is used only when the claim's thread and rollout generation equal what this
process stored, the session's effective config is unchanged, the process is alive and the rollout file
is the very file (device, inode, size, mtime) it left after its last turn — another worker on this host
that ran the session meanwhile re-made the session's home, and a copy whose thread moved on is closed,
never used (``KeptThread.usable_for``).

Bounds: the host's memory budget, ``HERMES_WARM_MEMORY_BUDGET_MB`` of private memory (USS, with children)
shared by every worker process of the host (``memory_budget.py``: this process's least recently used
copies are closed first to make room), with ``HERMES_WARM_MAX_THREADS`` per process as a safety cap; each
copy for ``HERMES_WARM_IDLE_SECONDS``, ``HERMES_WARM_MAX_TURNS`` turns and ``HERMES_WARM_MAX_PRIVATE_MB`` of
private memory (measured after each turn, ``process_memory.py``). None outlives its worker: ``close_all`` at worker shutdown and ``atexit``; a worker killed
with SIGKILL takes them along (``PR_SET_PDEATHSIG``, set when spawned, ``warm.die_with_parent``).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from ...codex.client import AppServerClient
from ...codex.rollout_files import RolloutBase, find_rollout
from ..process import runtime
from .memory_budget import HostLedger, admit
from .process_memory import tree_memory

logger = logging.getLogger(__name__)


def rollout_stamp(home: Path, thread_id: str) -> tuple[int, int, int, int] | None:
    """``(st_dev, st_ino, st_size, st_mtime_ns)`` of ``thread_id``'s rollout under ``home``, or ``None``."""
    try:
        path = find_rollout(home, thread_id)
        st = path.stat() if path is not None else None
    except Exception:  # noqa: BLE001 — an unreadable or ambiguous file: not the file we left
        return None
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class KeptThread:
    """A running, initialized app-server with ``thread_id`` loaded for ``session_id``.

    ``base`` is the thread's rollout as PostgreSQL holds it after this process's last turn (its
    ``generation`` is the stored one), ``home`` the ``CODEX_HOME`` it runs on, ``config`` the session's
    effective config it was started with (``policy.effective_config``), ``version`` codex's version,
    ``turns`` how many turns this process ran, ``stamp`` the rollout file's ``rollout_stamp`` when kept,
    ``close`` what releases it (closes the process; for a spare also removes its home), ``private_kb`` the
    app-server's private memory with its children when kept (``process_memory.tree_memory``)."""

    session_id: str
    thread_id: str
    client: AppServerClient
    home: Path
    base: RolloutBase
    config: dict[str, Any]
    version: str
    close: Callable[[], None]
    turns: int = 1
    stamp: tuple[int, int, int, int] | None = None
    kept_at: float = field(default_factory=time.monotonic)
    private_kb: int = 0

    def usable_for(self, *, thread_id: str | None, generation: int | None, config: dict[str, Any],
                   check_file: bool = True) -> str:
        """Why this copy may not run the claimed turn (``""``: it may). ``thread_id``/``generation``: the
        claim's bound thread and its stored rollout generation; ``config``: the session's effective config.
        ``check_file=False``: not the rollout file's stamp (checked before an early ``turn/start``, after
        which codex appends to it, ``worker/warm/early_start.py``)."""
        if thread_id != self.thread_id:
            return f"the session is bound to thread {thread_id}, not {self.thread_id}"
        if generation is None:  # forgotten (``forget_rollout``) or never stored
            return f"the session has no stored rollout (this copy holds generation {self.base.generation})"
        if generation != self.base.generation:
            return f"the rollout moved on to generation {generation} (this copy holds {self.base.generation})"
        if config != self.config:
            return "the session's codex settings changed"
        if not self.client.alive():
            return "the app-server exited"
        if check_file and rollout_stamp(self.home, self.thread_id) != self.stamp:
            return "the rollout file on disk is not the one this app-server wrote (another run re-made the home)"
        return ""


class Keeper:
    """This process's kept threads, by session id. ``take`` hands one out (it leaves the registry: the
    turn owns it); ``keep`` puts one back after a turn; ``expired`` / ``release`` close them. All
    closing happens outside the lock (a close takes ~30 ms). ``budget_mb``: the host's memory budget
    (private MiB; ``None``: none), whose other users ``ledger`` reads and this keeper's total it records
    (``None``: no ledger, this process alone counts)."""

    def __init__(self, *, max_threads: int, idle_seconds: float, max_turns: int, max_private_mb: float,
                 budget_mb: float | None = None, ledger: HostLedger | None = None) -> None:
        self.max_threads, self.idle_seconds = max_threads, idle_seconds
        self.max_turns, self.max_private_mb = max_turns, max_private_mb
        self.budget_mb, self.ledger = budget_mb, ledger
        self._kept: OrderedDict[str, KeptThread] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, session_id: str) -> KeptThread | None:
        with self._lock:
            return self._kept.pop(session_id, None)

    def peek(self, session_id: str) -> KeptThread | None:
        """The copy of ``session_id`` without taking it (``None``: none kept)."""
        with self._lock:
            return self._kept.get(session_id)

    def keep(self, kept: KeptThread) -> list[KeptThread]:
        """Keep ``kept`` if within bounds; return what was closed to make room (or ``[kept]`` itself
        when it was over a bound) so the caller can clear their routing."""
        kept.private_kb = tree_memory(kept.client.pid).private_kb
        why = self._over_bound(kept)
        others_kb = self.ledger.others_kb() if self.ledger is not None and self.budget_mb is not None else 0
        evicted: list[KeptThread] = []
        if not why:
            with self._lock:
                old = self._kept.pop(kept.session_id, None)
                if old is not None:
                    evicted.append(old)
                decision = admit(candidate_kb=kept.private_kb, others_kb=others_kb,
                                 kept=[(k.session_id, k.private_kb) for k in self._kept.values()],
                                 budget_kb=None if self.budget_mb is None else int(self.budget_mb * 1024),
                                 max_threads=self.max_threads)
                evicted += [self._kept.pop(key) for key in decision.evict]
                if decision.keep:
                    kept.kept_at = time.monotonic()
                    self._kept[kept.session_id] = kept
                why = decision.reason
        if why:
            logger.info("session %s: not keeping its app-server loaded: %s", kept.session_id, why)
            evicted.append(kept)
        for victim in evicted:
            _close(victim)
        self._publish()
        return evicted

    def _over_bound(self, kept: KeptThread) -> str:
        if self.max_threads <= 0 or self.idle_seconds <= 0:
            return "keeping is off"
        if kept.turns >= self.max_turns:
            return f"it ran {kept.turns} turns (HERMES_WARM_MAX_TURNS {self.max_turns}); recycled"
        if kept.private_kb / 1024 > self.max_private_mb:
            return (f"it uses {kept.private_kb / 1024:.0f} MiB of private memory "
                    f"(HERMES_WARM_MAX_PRIVATE_MB {self.max_private_mb:.0f})")
        if not kept.client.alive():
            return "the app-server exited"
        return ""

    def private_kb(self) -> int:
        """The private kB of this process's kept app-servers, as measured when each was kept."""
        with self._lock:
            return sum(k.private_kb for k in self._kept.values())

    def _publish(self) -> None:
        if self.ledger is not None:
            self.ledger.publish(self.private_kb)

    def expired(self) -> list[KeptThread]:
        """Close and return the copies idle longer than the window or whose process died."""
        now = time.monotonic()
        with self._lock:
            gone = [k for k in self._kept.values() if now - k.kept_at >= self.idle_seconds or not k.client.alive()]
            for k in gone:
                del self._kept[k.session_id]
        for k in gone:
            _close(k)
        if gone:
            self._publish()
        return gone

    def release(self, session_id: str, *, reason: str) -> KeptThread | None:
        """Close the copy of ``session_id`` (another worker took the session, …); ``None`` if none kept."""
        with self._lock:
            kept = self._kept.pop(session_id, None)
        if kept is not None:
            logger.info("session %s: released its loaded thread: %s", session_id, reason)
            _close(kept)
            self._publish()
        return kept

    def kept_threads(self) -> list[tuple[str, str, int]]:
        """``(session id, thread id, generation)`` of every kept copy."""
        with self._lock:
            return [(k.session_id, k.thread_id, k.base.generation) for k in self._kept.values()]

    def pids(self) -> list[int]:
        with self._lock:
            return [pid for k in self._kept.values() if (pid := k.client.pid) is not None]

    def close_all(self) -> list[KeptThread]:
        with self._lock:
            kept, self._kept = list(self._kept.values()), OrderedDict()
        for k in kept:
            _close(k)
        self._publish()
        return kept


def _close(kept: KeptThread) -> None:
    try:
        kept.close()
    except Exception:  # noqa: BLE001 — a process that will not close is killed by its group anyway
        logger.exception("session %s: closing its kept app-server failed", kept.session_id)


def keeper_make() -> Keeper | None:
    """This process's keeper, made now if it was not (``process.runtime().keeper``), or ``None`` when
    keeping is off: ``HERMES_WARM_IDLE_SECONDS`` or ``HERMES_WARM_MAX_THREADS`` is 0. Its budget is
    ``HERMES_WARM_MEMORY_BUDGET_MB`` (0: none), its ledger under ``HERMES_VAR_DIR/warm-memory``."""
    if float(settings.HERMES_WARM_IDLE_SECONDS) <= 0 or int(settings.HERMES_WARM_MAX_THREADS) <= 0:
        return None
    rt = runtime()
    with rt.lock:
        if rt.keeper is None:
            budget = float(settings.HERMES_WARM_MEMORY_BUDGET_MB)
            rt.keeper = Keeper(
                max_threads=int(settings.HERMES_WARM_MAX_THREADS),
                idle_seconds=float(settings.HERMES_WARM_IDLE_SECONDS),
                max_turns=int(settings.HERMES_WARM_MAX_TURNS),
                max_private_mb=float(settings.HERMES_WARM_MAX_PRIVATE_MB),
                budget_mb=budget if budget > 0 else None,
                ledger=HostLedger(Path(settings.HERMES_VAR_DIR) / "warm-memory") if budget > 0 else None,
            )
        return rt.keeper


def keeper_if_made() -> Keeper | None:
    """This process's keeper if one was made (``keeper_make``); makes none."""
    return runtime().keeper


def close_keeper() -> list[KeptThread]:
    """Close every kept app-server of this process (worker shutdown, tests); returns them."""
    rt = runtime()
    with rt.lock:
        k, rt.keeper = rt.keeper, None
    return k.close_all() if k is not None else []


atexit.register(close_keeper)
