"""Spare app-servers: ``codex app-server`` processes spawned and initialized ahead of need, each on a
home of its own, so a turn with no warm process starts at restore + resume instead of spawn.

Facts this rests on (``docs/codex.md`` §11, ``tests/codex/test_warm_facts.py``): a spare needs nothing
session-specific at spawn — codex reads ``config.toml`` again at ``thread/resume``, so the session's
config (its permission profile for its work dir) and the thread's rollout are written into the spare's
home after ``initialize``; ``-c thread_unload_delay_secs=0`` makes ``thread/unsubscribe`` release a
thread at once. Cost: the spare's home is at another absolute path than the session's own home, so a
thread moved onto a spare gets one more skills developer message on its next model request.

Lifecycle (one pool per worker *process*; ``spare_pool()``):

* ``size`` spares at most, spawned by the pool's own filler thread (a daemon thread that lives as long
  as the process: ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned a child ends, so spawning
  from short-lived threads would kill the spares at once);
* a spare is used for one turn (``take``), then closed and its home removed by the caller
  (``Spare.discard``): nothing of one session is ever in a process that later serves another;
* a spare older than ``max_age`` seconds, or whose process died, is replaced, never handed out;
* ``close()`` (the worker's ``worker_process_shutdown``, and ``atexit``) closes them all; a worker
  killed with SIGKILL takes them with it (each spare is spawned with ``PR_SET_PDEATHSIG = SIGKILL``,
  and in its own process group, which ``AppServerClient.close`` kills);
* homes of spares whose owning process is gone (``.spare-<pid>-<n>`` under ``CODEX_HOMES_ROOT``) are
  removed when a pool starts (session ids never start with ``.``).
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from ...codex.client import AppServerClient, ServerRequestHandler
from ...codex.launch import SessionHome, app_server_argv, app_server_env, write_home_config

logger = logging.getLogger(__name__)

UNLOAD_AT_ONCE = ["-c", "thread_unload_delay_secs=0"]  # docs/codex.md §11
SPARE_PREFIX = ".spare-"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of a spare: SIGKILL it when the thread that spawned it (the filler) ends, i.e.
    when the worker process dies, however it dies (kill -9 included). Linux only."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Spare:
    """One initialized app-server and its home. ``init`` is its ``initialize`` result
    (``{"userAgent", "codexHome", …}``, docs/codex.md §2); ``born`` its ``time.monotonic()`` at spawn.
    ``handler`` answers codex's server requests; set it for the session before the first request."""

    client: AppServerClient
    home: SessionHome
    init: dict[str, Any]
    born: float
    handler: ServerRequestHandler | None = None
    _discarded: bool = field(default=False, repr=False)

    def answer(self, method: str, params: dict) -> dict:
        if self.handler is None:
            raise LookupError("no session has taken this spare")
        return self.handler(method, params)

    def discard(self) -> None:
        """Close the app-server (idempotent) and remove its home."""
        if self._discarded:
            return
        self._discarded = True
        self.client.close()
        shutil.rmtree(self.home.home.parent, ignore_errors=True)


class SparePool:
    """At most ``size`` spares kept ready; see the module docstring. ``take`` never waits: no ready
    spare means ``None`` (the caller runs the turn cold)."""

    def __init__(self, size: int, *, max_age: float, spawn: Callable[[SessionHome], Spare] | None = None) -> None:
        self.size, self.max_age = size, max_age
        self._spawn = spawn or spawn_spare
        self._ready: list[Spare] = []
        self._cv = threading.Condition()
        self._closed = False
        self._counter = 0
        self.spawned = 0  # how many spares this pool started (tests, bench)
        _remove_orphaned_homes()
        self._filler = threading.Thread(target=self._fill_forever, name="codex-spare-filler", daemon=True)
        self._filler.start()

    def take(self) -> Spare | None:
        """A ready, live spare (removed from the pool), or ``None``. Wakes the filler to replace it."""
        with self._cv:
            while self._ready:
                spare = self._ready.pop(0)
                if spare.client.alive() and time.monotonic() - spare.born < self.max_age:
                    self._cv.notify_all()
                    return spare
                self._retire(spare)
            self._cv.notify_all()
            return None

    def ready(self) -> int:
        with self._cv:
            return len(self._ready)

    def wait_ready(self, count: int, timeout: float) -> bool:
        """Block until ``count`` spares are ready (tests, bench, warm-up). Returns whether they are."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._ready) < count and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
            return len(self._ready) >= count

    def pids(self) -> list[int]:
        with self._cv:
            return [pid for s in self._ready if (pid := s.client.pid) is not None]

    def close(self) -> None:
        """Stop the filler and close every ready spare (idempotent)."""
        with self._cv:
            self._closed = True
            spares, self._ready = self._ready, []
            self._cv.notify_all()
        for spare in spares:
            spare.discard()
        if self._filler is not threading.current_thread():
            self._filler.join(timeout=30)

    def _retire(self, spare: Spare) -> None:
        # Closing takes ~30 ms; do it off the caller's path.
        threading.Thread(target=spare.discard, name="codex-spare-retire", daemon=True).start()

    def _fill_forever(self) -> None:
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.size and not self._stale_locked():
                    self._cv.wait(timeout=max(1.0, self.max_age / 4))
                if self._closed:
                    return
                now = time.monotonic()
                for spare in [s for s in self._ready if not s.client.alive() or now - s.born >= self.max_age]:
                    self._ready.remove(spare)
                    self._retire(spare)
                if len(self._ready) >= self.size:
                    continue
                self._counter += 1
                home = _spare_home(self._counter)
            try:
                spare = self._spawn(home)
            except Exception:  # noqa: BLE001 — a spare that cannot start is no spare; turns run cold
                logger.exception("codex spare app-server did not start")
                shutil.rmtree(home.home.parent, ignore_errors=True)
                with self._cv:
                    self._cv.wait(timeout=5.0)  # do not spin on a broken binary
                continue
            if not self._keep(spare):
                spare.discard()
                return

    def _keep(self, spare: Spare) -> bool:
        """Add a new spare to the ready list; False when the pool closed meanwhile."""
        with self._cv:
            self.spawned += 1
            if self._closed:
                return False
            self._ready.append(spare)
            self._cv.notify_all()
            return True

    def _stale_locked(self) -> bool:
        now = time.monotonic()
        return any(not s.client.alive() or now - s.born >= self.max_age for s in self._ready)


def _spare_home(n: int) -> SessionHome:
    root = Path(settings.CODEX_HOMES_ROOT).resolve() / f"{SPARE_PREFIX}{os.getpid()}-{n}"
    return SessionHome(home=root / "home", user_home=root / "user_home")


def _remove_orphaned_homes() -> None:
    """Remove ``.spare-<pid>-<n>`` homes whose process is gone (a worker killed before it could)."""
    root = Path(settings.CODEX_HOMES_ROOT).resolve()
    for path in root.glob(f"{SPARE_PREFIX}*") if root.is_dir() else []:
        try:
            pid = int(path.name[len(SPARE_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn_spare(home: SessionHome) -> Spare:
    """Make ``home`` (a config naming no session), spawn the app-server on it with
    ``thread_unload_delay_secs=0`` and ``PR_SET_PDEATHSIG``, and initialize it. Raises what
    ``AppServerClient.start`` raises."""
    shutil.rmtree(home.home.parent, ignore_errors=True)
    home.home.mkdir(parents=True)
    home.user_home.mkdir(parents=True)
    write_home_config(home.home)
    holder: list[Spare] = []

    def answer(method: str, params: dict) -> dict:
        return holder[0].answer(method, params)

    client = AppServerClient(
        app_server_argv() + UNLOAD_AT_ONCE,
        env=app_server_env(home),
        cwd=str(home.user_home),
        request_timeout=settings.CODEX_REQUEST_TIMEOUT,
        max_frame_bytes=settings.CODEX_MAX_FRAME_BYTES,
        stderr_tail_lines=12,
        server_request_handler=answer,
        preexec_fn=die_with_parent,
    )
    born = time.monotonic()
    spare = Spare(client=client, home=home, init={}, born=born)
    holder.append(spare)
    spare.init = client.start()
    return spare


_pool: tuple[int, SparePool] | None = None
_pool_lock = threading.Lock()


def spare_pool() -> SparePool | None:
    """This process's pool (made on first use, after any fork), or ``None`` when
    ``settings.HERMES_WARM_POOL`` is 0 (the default: every turn spawns its own app-server)."""
    global _pool
    size = int(settings.HERMES_WARM_POOL)
    if size <= 0:
        return None
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():  # a pool made before a fork belongs to the parent
            _pool = (os.getpid(), SparePool(size, max_age=float(settings.HERMES_WARM_POOL_MAX_AGE)))
        return _pool[1]


def close_spare_pool() -> None:
    """Close this process's pool, if it has one (worker shutdown, tests)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and pool[0] == os.getpid():
        pool[1].close()


atexit.register(close_spare_pool)
