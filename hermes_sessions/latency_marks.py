"""Timestamp marks along a turn's way through the stack — off unless ``HERMES_LATENCY_MARKS`` names a file.

Why: every session that worked on the warm turn's cost (``make bench``'s ``ratio_vs_warm``) added the same
temporary marks by hand — the ``POST`` in the API, the wake, the claim, ``turn/start``, ``turn/completed``,
the finalize, the event hub, the terminal frame — and removed them again. Here they stay, free when off
(one test of a module global per mark). With ``HERMES_LATENCY_MARKS=/path/file`` in the environment of the
API, the worker and ``make bench-warm``, every process appends one line per mark::

    <key> <name> <epoch seconds> <this thread's CPU seconds> <pid> <thread name>

``key`` is the turn's id where the code knows it (the ``POST``'s first mark has only the session's id).
``make bench-warm`` also writes its client's records beside it (``<file>.records.json``), and
``python -m devtools.latency_report <file>`` prints the median of every hop. One clock: the processes must
share a host (as the bench's do). Lines are written with one ``write`` on a file opened ``O_APPEND``, so
processes and threads do not interleave within a line.
"""
from __future__ import annotations

import os
import threading
import time

ENV = "HERMES_LATENCY_MARKS"

_fd: int | None = None
_pid = 0


def _open() -> int | None:
    path = os.environ.get(ENV)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None


def enabled() -> bool:
    """Whether marks are written in this process (``HERMES_LATENCY_MARKS`` was set when it was imported)."""
    return _enabled


def mark(name: str, key: object = "") -> None:
    """Append ``<key> <name> <time.time()> <time.thread_time()> <pid> <thread>`` to the marks file; nothing
    when off. ``key``: the turn's id (or the session's, before a turn exists); no spaces."""
    if not _enabled:
        return
    global _fd, _pid
    if _pid != os.getpid():  # opened again after a fork (Celery's pool, gunicorn's workers)
        _fd, _pid = _open(), os.getpid()
    if _fd is None:
        return
    line = f"{key or '-'} {name} {time.time():.6f} {time.thread_time():.6f} {os.getpid()} {threading.current_thread().name}\n"
    os.write(_fd, line.encode())


_enabled = bool(os.environ.get(ENV))
