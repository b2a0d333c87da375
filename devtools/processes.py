"""Process helpers shared by the fault harness, the benchmark and the tests: a free port, the model
stand-in as a child process, and the scan for codex processes a run left behind (Linux ``/proc``)."""
from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CodexProcess", "ancestors", "codex_pids", "codex_processes", "free_port", "stand_in_argv",
           "wait_for_port_file"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; another process may
    still take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------- the model stand-in


def stand_in_argv(port_file: Path, *, slow_seconds: float | None = None) -> list[str]:
    """argv that runs the model stand-in (:mod:`devtools.model_stand_in`) on a free port and writes
    that port to ``port_file``; read it with :func:`wait_for_port_file`."""
    argv = [sys.executable, "-m", "devtools.model_stand_in", "--port", "0", "--port-file", str(port_file)]
    if slow_seconds is not None:
        argv += ["--slow-seconds", str(slow_seconds)]
    return argv


def wait_for_port_file(port_file: Path, *, timeout: float, failed: Callable[[], str | None] = lambda: None) -> int:
    """The port a child wrote to ``port_file``, once it is there (polled every 50 ms).

    ``failed()`` is asked on each poll; a string it returns (say, the child's log tail when it exited)
    is raised at once. Raises ``RuntimeError`` after ``timeout`` seconds or on such a failure."""
    deadline = time.monotonic() + timeout
    while True:
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            return int(text)
        reason = failed()
        if reason is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no port in {port_file} after {timeout:.0f} s" if reason is None else reason)
        time.sleep(0.05)


# --------------------------------------------------------------------------------------- codex processes


@dataclass(frozen=True)
class CodexProcess:
    """A live process found by :func:`codex_processes`: its pid, parent pid, working directory and
    command line (``""`` where ``/proc`` would not say)."""

    pid: int
    ppid: int
    cwd: str
    cmd: str


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: ``[state, ppid, …]`` (``[]`` once it is gone)."""
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return stat.rsplit(")", 1)[1].split() if ")" in stat else []


def _ppid(pid: int) -> int:
    fields = _stat_fields(pid)
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def codex_processes(codex_home: str | Path) -> list[CodexProcess]:
    """Live processes that codex spawned with this ``CODEX_HOME`` or one below it (a homes root).

    codex gets ``CODEX_HOME`` in its environment, not its argv, so ``pgrep -f`` cannot find them; its
    environment is allow-listed and so, unlike the project's own Python processes (a worker started
    with ``CODEX_HOME`` set), carries no ``DATABASE_URL``. Zombies are not counted: they run nothing."""
    marker = f"CODEX_HOME={codex_home}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        env = _read(f"/proc/{pid}/environ").split(b"\0")
        if not any(e == marker or e.startswith(marker + b"/") for e in env) or any(
                e.startswith(b"DATABASE_URL=") for e in env):
            continue
        fields = _stat_fields(pid)
        if not fields or fields[0] == "Z":
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        found.append(CodexProcess(pid=pid, ppid=int(fields[1]), cwd=cwd, cmd=cmd))
    return found


def codex_pids(codex_home: str | Path) -> list[int]:
    """The pids of :func:`codex_processes` (``[]`` when none is left)."""
    return [p.pid for p in codex_processes(codex_home)]


def ancestors(pid: int) -> list[int]:
    """Parent, grandparent, … of ``pid`` up to init (at most 20), from ``/proc``."""
    out: list[int] = []
    while pid > 1 and len(out) < 20:
        pid = _ppid(pid)
        out.append(pid)
    return out
