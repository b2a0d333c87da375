"""Warm direct app-servers driven all at once: the throughput codex alone gives on this host, which
``make bench``'s throughput run divides the stack's by (``throughput_ratio_vs_direct``).

A ``DirectFleet`` of ``n`` app-servers, each in its own session home under a session's permission profile
(``bench_app_server_memory._app_server``: ``workspace-write``, as a worker starts one) with one loaded
thread that has run a turn (``_load_thread``); a round sends one ``turn/start`` to every app-server at
once, one client thread each, and lasts from the first send to the last ``turn/completed``. No PostgreSQL,
no broker: the bench process talks to codex over stdio. Needs Django set up on the bench's settings
(``CODEX_*`` and the stand-in's URL), as ``bench._setup_django`` leaves it."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from devtools.bench_app_server_memory import _app_server, _load_thread

START_THREADS = 4  # app-servers started at once while the fleet is made (spawn + thread/start + a turn each)


class DirectFleet:
    """``n`` warm direct app-servers named ``<prefix>-<i>`` (their session ids); ``start`` makes them,
    ``round`` times one turn on each at once, ``close`` ends them."""

    def __init__(self, n: int, prefix: str):
        self.n, self.prefix = n, prefix
        self.servers: list[tuple[Any, str]] = []  # (devtools.bench.Direct, its loaded thread's id)
        self._lock = threading.Lock()

    def start(self) -> float:
        """Start the app-servers, ``START_THREADS`` at a time; seconds it took."""
        t0 = time.monotonic()

        def one(i: int) -> None:
            d, work = _app_server(f"{self.prefix}-{i}")
            with self._lock:
                self.servers.append((d, ""))
                slot = len(self.servers) - 1
            thread = _load_thread(d, work)
            with self._lock:
                self.servers[slot] = (d, thread)

        with ThreadPoolExecutor(START_THREADS) as pool:
            list(pool.map(one, range(self.n)))
        return time.monotonic() - t0

    def round(self, text: str) -> tuple[float, int]:
        """One turn on every app-server at once: ``(seconds from the first send to the last end, failed
        turns)`` — a turn fails if codex answers anything but ``completed`` or the pipe breaks."""
        failed = 0

        def turn(server: tuple[Any, str]) -> None:
            nonlocal failed
            d, thread = server
            try:
                d.turn(thread, text)
            except (AssertionError, OSError, RuntimeError, ValueError) as exc:
                with self._lock:
                    failed += 1
                print(f"  direct: a turn failed: {exc!r}", file=sys.stderr)

        threads = [threading.Thread(target=turn, args=(s,)) for s in self.servers]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0, failed

    def close(self) -> None:
        for d, _ in self.servers:
            try:
                d.close()
            except Exception:  # noqa: BLE001 — an app-server that will not exit: kill it, the run goes on
                d.proc.kill()
        self.servers = []
