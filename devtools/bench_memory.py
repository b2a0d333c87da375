"""``make bench``'s memory figures: memory of a Celery turn worker's processes and of the codex app-servers it
keeps, read from Linux ``/proc`` (kB) by ``hermes_sessions.worker.warm.process_memory`` — private (USS) and PSS,
with RSS beside them.

A worker started as ``celery … worker -c 1`` is a tree: the Celery main process, its one prefork pool
child, and below the child the app-servers it spawned (spare ones, a kept-loaded one, the one running a
turn) with whatever codex runs under them (sandbox helpers, briefly). ``worker_memory`` splits that
tree into the worker's Python processes and the app-servers, each app-server counted with its own
descendants."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hermes_sessions.worker.warm.process_memory import Memory

__all__ = ["WorkerMemory", "pss_kb", "rss_kb", "worker_memory"]

# ``process_memory`` is imported inside the functions: importing ``hermes_sessions.worker`` loads the models,
# which the benches may do only after ``bench._setup_django`` (``python -m devtools.bench`` imports this
# module first).


def rss_kb(pid: int) -> int:
    """``Rss`` of ``pid`` in kB (0 once it is gone, or for a zombie)."""
    from hermes_sessions.worker.warm.process_memory import process_memory

    return process_memory(pid).rss_kb


def pss_kb(pid: int) -> int:
    """``Pss`` of ``pid`` in kB (pages shared with other processes counted once across them); 0 once gone."""
    from hermes_sessions.worker.warm.process_memory import process_memory

    return process_memory(pid).pss_kb


def _is_python(pid: int) -> bool:
    exe = ""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    return "python" in os.path.basename(exe)


@dataclass
class WorkerMemory:
    """One sample of a worker tree: ``worker_rss_kb`` / ``worker_pss_kb`` / ``worker_private_kb`` = the Celery
    main process plus its Python pool child(ren); ``app_servers`` = each app-server's ``Memory`` with its
    descendants'."""

    worker_rss_kb: int = 0
    worker_pss_kb: int = 0
    worker_private_kb: int = 0
    worker_pids: list[int] = field(default_factory=list)
    app_servers: list[Memory] = field(default_factory=list)


def worker_memory(main_pid: int) -> WorkerMemory:
    """A sample of the worker whose Celery main process is ``main_pid``."""
    from hermes_sessions.worker.warm.process_memory import children, process_memory, tree_memory

    m = WorkerMemory(worker_pids=[main_pid])
    for child in children(main_pid):
        if _is_python(child):
            m.worker_pids.append(child)
            for grandchild in children(child):
                if _is_python(grandchild):
                    m.worker_pids.append(grandchild)
                else:
                    m.app_servers.append(tree_memory(grandchild))
        else:
            m.app_servers.append(tree_memory(child))
    own = [process_memory(p) for p in m.worker_pids]
    m.worker_rss_kb = sum(x.rss_kb for x in own)
    m.worker_pss_kb = sum(x.pss_kb for x in own)
    m.worker_private_kb = sum(x.private_kb for x in own)
    return m
