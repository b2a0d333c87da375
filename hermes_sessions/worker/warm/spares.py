"""Spare app-servers: ``codex app-server`` processes spawned and initialized ahead of need, each on a
home of its own, so a turn with no warm process starts at restore + resume instead of spawn.

Facts this rests on (``docs/codex.md`` §11, ``tests/codex/test_warm_facts.py``): a spare needs nothing
session-specific at spawn — codex reads ``config.toml`` again at ``thread/resume``, so the session's
config (its permission profile for its work dir) and the thread's rollout are written into the spare's
home after ``initialize``; ``-c thread_unload_delay_secs=0`` makes ``thread/unsubscribe`` release a
thread at once. Cost: the spare's home is at another absolute path than the session's own home, so a
thread moved onto a spare gets one more skills developer message on its next model request.

Lifecycle (one pool per worker *process*; ``spare_pool()``):

* ``size`` spares at most, started by a job on the process's scheduler (``worker/scheduler.py``; its
  thread lives as long as the process: ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned a child
  ends, so spawning from short-lived threads would kill the spares at once). The scheduler's jobs must
  not block, so a start only spawns the process and sends ``initialize`` (``AppServerClient.launch``);
  the codex client's reader thread takes the answer in, and the next check (``CHECK_STARTING_SECONDS``
  later) counts the spare ready once its answer is in (``Spare.started``);
* a spare is used for one turn (``take``), then closed and its home removed by the caller
  (``Spare.discard``): nothing of one session is ever in a process that later serves another;
* a spare older than ``max_age`` seconds, or whose process died, is replaced, never handed out; it is
  retired without waiting: SIGKILL now (``AppServerClient.kill_nowait``), reaped and its home removed
  by a job ``REAP_AFTER_SECONDS`` later;
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

from ...codex.client import AppServerClient, PendingRequest, ServerRequestHandler
from ...codex.launch import SessionHome, app_server_argv, app_server_env, write_home_config
from ..process import runtime
from ..scheduler import Job, Scheduler

logger = logging.getLogger(__name__)

UNLOAD_AT_ONCE = ["-c", "thread_unload_delay_secs=0"]  # docs/codex.md §11
SPARE_PREFIX = ".spare-"
CHECK_STARTING_SECONDS = 0.02  # how often a starting spare's initialize answer is looked for
REAP_AFTER_SECONDS = 0.2  # a retired (SIGKILLed) spare is reaped and its home removed this much later
FAILED_START_PAUSE_SECONDS = 5.0  # after a spare that could not start: do not spin on a broken binary
_PR_SET_PDEATHSIG = 1


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up once: the child of a fork only calls it


def die_with_parent() -> None:
    """``preexec_fn`` of a spare: SIGKILL it when the thread that spawned it (the scheduler's) ends, i.e.
    when the worker process dies, however it dies (kill -9 included). Linux only."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


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
    launched: bool = True  # its readers run and ``initialize`` was sent (``launch``); a new spare's is False
    initialize: PendingRequest | None = None  # ``launch``'s, until ``started`` read it
    _discarded: bool = field(default=False, repr=False)

    def launch(self) -> None:
        """Start the client's reader threads and send ``initialize`` (``AppServerClient.launch``: no wait)."""
        self.launched = True
        self.initialize = self.client.launch()

    def started(self) -> bool | None:
        """Whether its ``initialize`` answer is in and good (``init`` is set, ``initialized`` sent);
        ``None`` while it is not in yet (or not ``launch``ed). Never waits. ``False``: the start failed
        (the caller retires it)."""
        if not self.launched:
            return None
        if self.initialize is None:
            return True
        if not self.initialize.answered():
            return None
        pending, self.initialize = self.initialize, None
        try:
            self.init = pending.result()  # in already: no wait
            self.client.notify("initialized")
        except Exception as exc:  # noqa: BLE001 — a spare that cannot start is no spare; turns run cold
            logger.warning("codex spare app-server did not start: %s", exc)
            return False
        return True

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
    spare means ``None`` (the caller runs the turn cold). Its jobs run on ``scheduler`` (default: this
    process's, ``process.runtime()``); ``start`` (default ``start_spare``) must not block."""

    def __init__(self, size: int, *, max_age: float, start: Callable[[SessionHome], Spare] | None = None,
                 scheduler: Scheduler | None = None) -> None:
        self.size, self.max_age = size, max_age
        self._start = start or start_spare
        self._scheduler = scheduler or runtime().scheduler
        self._starting: list[Spare] = []
        self._ready: list[Spare] = []
        self._retiring: list[Spare] = []  # SIGKILLed, not yet reaped
        self._cv = threading.Condition()
        self._closed = False
        self._counter = 0
        self._job: Job | None = None
        self.spawned = 0  # how many spares this pool started (tests, bench)
        _remove_orphaned_homes()
        self._check_in(0.0)

    def take(self) -> Spare | None:
        """A ready, live spare (removed from the pool), or ``None``. Asks for a replacement at once."""
        with self._cv:
            spare = None
            while self._ready and spare is None:
                candidate = self._ready.pop(0)
                if self._fresh(candidate, time.monotonic()):
                    spare = candidate
                else:
                    self._retire(candidate)
        self._check_in(0.0)
        return spare

    def ready(self) -> int:
        with self._cv:
            return len(self._ready)

    def launched(self) -> int:
        """How many spares were launched (``initialize`` sent) and wait for their answer."""
        with self._cv:
            return sum(1 for s in self._starting if s.launched)

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
        """Stop checking and close every spare, ready or starting (idempotent; waits for them: worker
        shutdown, not a scheduler job)."""
        with self._cv:
            self._closed = True
            job, self._job = self._job, None  # the check under way, if one is: it ends first
            self._cv.notify_all()
        self._scheduler.cancel(job, wait=5.0)
        with self._cv:
            spares = self._ready + self._starting + self._retiring
            self._ready, self._starting, self._retiring = [], [], []
        for spare in spares:
            spare.discard()

    # ------------------------------------------------------------------ the scheduler's jobs

    def _check_in(self, seconds: float) -> None:
        """(Re)schedule the check ``seconds`` from now, unless one is due sooner. A slow job: it may spawn
        or launch a spare (``scheduler.py``'s rule)."""
        due = time.monotonic() + seconds
        with self._cv:
            if self._closed or (self._job is not None and not self._job.cancelled and self._job.due <= due):
                return
            if self._job is not None:
                self._job.cancel()
            self._job = self._scheduler.at(due, self._check, name="spares: check and start", slow=True)

    def _check(self) -> None:
        """One round (a slow scheduler job, a few ms): count started spares ready, retire failed, dead
        and stale ones, then one step of a start — ``launch`` a spawned spare, or spawn one more — and
        schedule the next round (at once after a spawn, so its launch is the next step)."""
        with self._cv:
            if self._closed:
                return
            current = self._job  # stays set while it runs: ``close`` waits for it
            self._sort_locked(time.monotonic())
            spawned = next((s for s in self._starting if not s.launched), None)
            home = None
            if spawned is None and len(self._ready) + len(self._starting) < self.size:
                self._counter += 1
                home = _spare_home(self._counter)
            self._cv.notify_all()
        delay = self._step(spawned, home)
        with self._cv:
            if self._job is current:
                self._job = None
            if delay is None:
                busy = bool(self._starting) or len(self._ready) < self.size
                delay = CHECK_STARTING_SECONDS if busy else max(1.0, self.max_age / 4)
        self._check_in(delay)

    def _step(self, spawned: Spare | None, home: SessionHome | None) -> float | None:
        """``launch`` ``spawned``, or spawn a spare on ``home``; the delay of the next round when it is not
        the usual one (0 after a spawn: its launch; ``FAILED_START_PAUSE_SECONDS`` after a failure)."""
        try:
            if spawned is not None:
                spawned.launch()
                return None
            if home is None:
                return None
            spare = self._start(home)
        except Exception:  # noqa: BLE001 — a spare that cannot start is no spare; turns run cold
            logger.exception("codex spare app-server did not start")
            with self._cv:
                if spawned is not None and spawned in self._starting:
                    self._starting.remove(spawned)
                    self._retire(spawned)
            if home is not None and spawned is None:
                shutil.rmtree(home.home.parent, ignore_errors=True)
            return FAILED_START_PAUSE_SECONDS
        if not self._add_starting(spare):
            spare.discard()  # closed meanwhile (shutdown): not left to a reap the scheduler may drop
        return 0.0

    def _add_starting(self, spare: Spare) -> bool:
        """Count ``spare`` as starting; ``False`` when the pool closed meanwhile."""
        with self._cv:
            self.spawned += 1
            if self._closed:
                return False
            self._starting.append(spare)
            return True

    def _sort_locked(self, now: float) -> None:
        """Starting spares whose answer is in become ready (or retire when it failed or they died);
        dead and stale ready ones retire. Holding ``_cv``."""
        for spare in list(self._starting):
            state = spare.started()
            if state is None and spare.client.alive():
                continue
            self._starting.remove(spare)
            if state:
                self._ready.append(spare)
            else:
                self._retire(spare)
        for spare in [s for s in self._ready if not self._fresh(s, now)]:
            self._ready.remove(spare)
            self._retire(spare)

    def _fresh(self, spare: Spare, now: float) -> bool:
        return spare.client.alive() and now - spare.born < self.max_age

    def _retire(self, spare: Spare) -> None:
        """SIGKILL now, reap and remove its home later (a slow job): closing waits (~30 ms), a job must
        not. Holding ``_cv``; ``close`` reaps what is still retiring."""
        spare.client.kill_nowait()
        self._retiring.append(spare)
        self._scheduler.after(REAP_AFTER_SECONDS, lambda: self._reap(spare), name="spares: reap a retired one",
                              slow=True)

    def _reap(self, spare: Spare) -> None:
        with self._cv:
            if spare not in self._retiring:
                return  # ``close`` did
            self._retiring.remove(spare)
        spare.discard()


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


def start_spare(home: SessionHome) -> Spare:
    """Make ``home`` (a config naming no session), spawn the app-server on it with
    ``thread_unload_delay_secs=0`` and ``PR_SET_PDEATHSIG`` (``AppServerClient.spawn``), nothing more:
    ``Spare.launch`` sends ``initialize`` (a step of its own, ``SparePool._check``), ``Spare.started``
    reads the answer. Raises what ``AppServerClient.spawn`` raises."""
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
    spare = Spare(client=client, home=home, init={}, born=born, launched=False)
    holder.append(spare)
    client.spawn()
    return spare


def spare_pool() -> SparePool | None:
    """This process's pool (``process.runtime().spares``, made on first use), or ``None`` when
    ``settings.HERMES_WARM_POOL`` is 0 (the default: every turn spawns its own app-server)."""
    size = int(settings.HERMES_WARM_POOL)
    if size <= 0:
        return None
    rt = runtime()
    with rt.lock:
        if rt.spares is None:
            rt.spares = SparePool(size, max_age=float(settings.HERMES_WARM_POOL_MAX_AGE), scheduler=rt.scheduler)
        return rt.spares


def close_spare_pool() -> None:
    """Close this process's pool, if it has one (worker shutdown, tests)."""
    rt = runtime()
    with rt.lock:
        pool, rt.spares = rt.spares, None
    if pool is not None:
        pool.close()


atexit.register(close_spare_pool)
