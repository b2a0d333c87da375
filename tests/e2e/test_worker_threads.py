"""The threads of a real worker process (docs/architecture.md §7): three of ours besides Celery's while no
turn waits for a person.

A real ``celery worker -c 1`` (a route: it keeps threads loaded and listens for wakes) with one spare
app-server (``HERMES_WARM_POOL=1``), as in production with the pool on, after turns ran on it cold and then
warm (woken, early ``turn/start``). Its pool process logs its thread names (``tasks.log_worker_threads``).
Not counted: Celery's own (the pool process's main thread, which runs the tasks) and the codex client's
pipe readers (``codex-app-server-<pid>-<role>``: stdout, stderr, server-requests, watch), which live
only as long as their app-server (``hermes_sessions/codex/client.py``).
"""
from __future__ import annotations

import re
import time

import pytest

from hermes_sessions import services, tasks
from hermes_sessions.models import TurnWorker

from .test_affinity import _turn, _wait, stand_in, workers  # noqa: F401 — the fixtures
from .test_seed_e2e import TURN_QUEUE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

CELERYS = {"MainThread"}
CODEX_CLIENTS = re.compile(r"^codex-app-server-\d+-(stdout|stderr|server-requests|watch)$")
OURS_AT_MOST = 3  # the scheduler, the wake listener and one runner (hermes_sessions/worker/process.py)


def _threads_logged(workers, name: str, after: int) -> list[str]:  # noqa: F811 — the fixture's value
    """The thread names the pool process of worker ``name`` logs (``log_worker_threads``), its line after
    the ``after`` th."""
    tasks.log_worker_threads.apply_async(queue=TURN_QUEUE)
    lines: list[str] = []

    def logged() -> bool:
        lines[:] = re.findall(r"worker process \d+ threads: (.*)", workers.log(name))
        return len(lines) > after

    _wait(logged, 30, "the worker logged no thread names")
    return [n.strip() for n in lines[after].split(",")]


def test_a_worker_process_runs_three_threads_of_ours_and_reuses_its_runner(user, workers, stand_in):  # noqa: F811
    workers.env.update(HERMES_WARM_POOL="1")
    workers.start("a")
    session = services.session_create(owner=user, session_id="threads-counted")
    first = _turn(session, user, "cold one")
    assert first.status == "succeeded", first.error
    _wait(lambda: TurnWorker.objects.filter(wakeable=True).exists(), 10, "the wake listener is not listening")
    second = _turn(session, user, "warm one")
    assert second.status == "succeeded", second.error
    assert second.timings.get("woken") == 1 and second.timings.get("warm") == 1, second.timings
    time.sleep(1.5)  # a sweep round, a heartbeat and the spare's refill have run meanwhile

    names = _threads_logged(workers, "a", after=0)
    ours = sorted(n for n in names if n not in CELERYS and not CODEX_CLIENTS.match(n))
    # One runner ran both turns, the Celery delivery's and the woken one (none is started per turn).
    assert ours == ["hermes-runner-1", "hermes-scheduler", "hermes-wake"], names
    assert len(ours) <= OURS_AT_MOST
    assert any(CODEX_CLIENTS.match(n) for n in names), names  # the kept app-server's and the spare's readers
